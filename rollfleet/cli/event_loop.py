"""The event loop a ``rollfleet`` process runs on: uvloop or asyncio's own.

Only a process that owns its loop chooses it (``rollfleet worker``, ``gateway``, ``up``): this
module is the CLI's, and nothing a library user imports (``RolloutClient``, the integrations)
ever sets or replaces its host's loop or loop policy.

``--event-loop`` (or ``ROLLFLEET_EVENT_LOOP``): ``uvloop`` requires it; ``asyncio`` never uses it;
``auto`` (the default) runs on uvloop where it is installed and the command gains from it
(``UVLOOP_GAINS``), and on asyncio's loop otherwise. The choice is kept in the environment, so
the processes a command starts (``up``'s workers) choose as their parent was told.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar, get_args

from rollfleet.schemas.errors import InvalidRequest

EVENT_LOOP_ENV = "ROLLFLEET_EVENT_LOOP"
LoopChoice = Literal["auto", "uvloop", "asyncio"]
LOOP_CHOICES: tuple[str, ...] = get_args(LoopChoice)

T = TypeVar("T")

# Where ``auto`` takes uvloop: the commands whose same-run figures showed a gain on it
# (docs/performance.md). The gateway: its CPU a request 0.8286x to 0.9032x of its on asyncio's loop
# in three runs on a quiet machine. The worker: the request path's CPU a job 0.9690x to 0.9829x in
# three of four runs (1.0004x in the fourth). ``up``'s own loop only waits (its workers choose
# for themselves, told by the environment).
UVLOOP_GAINS = frozenset({"worker", "gateway"})


def chosen(flag: str | None = None) -> LoopChoice:
    """The loop asked for: the flag, else the environment, else ``auto``."""
    value = (flag or os.environ.get(EVENT_LOOP_ENV) or "auto").strip().lower()
    if value not in LOOP_CHOICES:
        raise InvalidRequest(f"the event loop must be one of {', '.join(LOOP_CHOICES)}; got {value!r}")
    return value  # type: ignore[return-value]


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: LoopChoice, *, have_uvloop: bool, gains: bool) -> Literal["uvloop", "asyncio"]:
    """Which loop runs: ``auto`` takes uvloop when it is there and the command ``gains`` from it;
    ``uvloop`` without it is an error (a loop asked for by name is never silently another)."""
    if choice == "uvloop" and not have_uvloop:
        raise InvalidRequest("--event-loop uvloop: uvloop is not installed (it has no Windows build)")
    if choice == "uvloop" or (choice == "auto" and have_uvloop and gains):
        return "uvloop"
    return "asyncio"


def resolved(command: str, choice: LoopChoice | None = None) -> Literal["uvloop", "asyncio"]:
    """The loop ``rollfleet COMMAND`` runs on, as asked (``choice``, else the environment)."""
    return resolve(chosen(choice), have_uvloop=uvloop_available(), gains=command in UVLOOP_GAINS)


def run(main: Coroutine[Any, Any, T], choice: LoopChoice, *, command: str) -> T:
    """``asyncio.run(main)`` on the loop ``command`` runs on (``asyncio.Runner`` with a loop
    factory: Python 3.11 has no ``loop_factory`` on ``asyncio.run``)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if resolved(command, choice) == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
