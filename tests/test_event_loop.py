"""The loop a ``rollfleet`` process runs on: chosen by the CLI alone (flag, then environment, then
uvloop where installed), run without touching the process's global loop policy, and never chosen
by library code: a trainer importing ``RolloutClient`` keeps the loop it has."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from rollfleet.cli import event_loop
from rollfleet.cli.event_loop import EVENT_LOOP_ENV
from rollfleet.cli.main import build_parser
from rollfleet.schemas.errors import InvalidRequest

ROLLFLEET = Path(__file__).resolve().parents[1] / "rollfleet"


def test_the_flag_wins_over_the_environment_and_auto_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert event_loop.chosen(None) == "auto"
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert event_loop.chosen(None) == "asyncio"
    assert event_loop.chosen("uvloop") == "uvloop"
    monkeypatch.setenv(EVENT_LOOP_ENV, "tokio")
    with pytest.raises(InvalidRequest, match="tokio"):
        event_loop.chosen(None)
    assert build_parser().parse_args(["--event-loop", "asyncio", "status"]).event_loop == "asyncio"


def test_auto_takes_uvloop_where_installed_for_a_command_that_gains_and_a_named_loop_is_never_another() -> None:
    assert event_loop.resolve("auto", have_uvloop=True, gains=True) == "uvloop"
    assert event_loop.resolve("auto", have_uvloop=True, gains=False) == "asyncio"
    assert event_loop.resolve("auto", have_uvloop=False, gains=True) == "asyncio"
    for gains in (True, False):
        assert event_loop.resolve("asyncio", have_uvloop=True, gains=gains) == "asyncio"
        assert event_loop.resolve("uvloop", have_uvloop=True, gains=gains) == "uvloop"
        with pytest.raises(InvalidRequest, match="not installed"):
            event_loop.resolve("uvloop", have_uvloop=False, gains=gains)
    assert event_loop.UVLOOP_GAINS == {"worker", "gateway"}  # (up's own loop only waits)


async def _running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_a_process_runs_on_the_loop_it_chose_and_leaves_the_global_policy_alone() -> None:
    policy = asyncio.get_event_loop_policy()
    assert event_loop.run(_running_loop_module(), "asyncio", command="worker").startswith("asyncio.")
    assert event_loop.run(_running_loop_module(), "auto", command="up").startswith("asyncio.")
    if event_loop.uvloop_available():
        assert event_loop.run(_running_loop_module(), "uvloop", command="up") == "uvloop"
        assert event_loop.run(_running_loop_module(), "auto", command="worker") == "uvloop"
        assert event_loop.run(_running_loop_module(), "auto", command="gateway") == "uvloop"
    assert asyncio.get_event_loop_policy() is policy


def test_no_library_code_chooses_or_replaces_a_loop() -> None:
    """Only the CLI, which owns its processes' loops, may name uvloop or set a loop or policy."""
    forbidden = re.compile(r"\buvloop\b|set_event_loop_policy|set_event_loop\(|asyncio\.run\([^)]*loop_factory")
    offenders = [
        str(path.relative_to(ROLLFLEET))
        for path in ROLLFLEET.rglob("*.py")
        if path.parent.name != "cli" and forbidden.search(path.read_text())
    ]
    assert offenders == [], offenders
