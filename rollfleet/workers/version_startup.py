"""The checkpoint a (re)started replica serves first: the latest committed version if it
materializes, else the newest older committed version that does.

Exiting instead would let a bad commit take down every replica that restarts after it, so a
start exits (``NoServableVersion``) only when no version can be served. Each step is
``following.start_step``'s decision; this module carries them out. A start-up prepare past its
bound (slow reads) does not refuse the others: the next older version is tried in a second
checkpoint directory (the fallback slot), the first of them to materialize is served, and while
nothing has yet the replica waits, ``starting`` with its ``degraded_reason`` saying why, for as
long as a prepare may still return.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.policy_store import MaterializeResult
from rollfleet.schemas.errors import NoServableVersion, PolicyError, PrepareTimeout
from rollfleet.workers.materializations import Flight, Materializations, past_bound
from rollfleet.workers.registry import Registration
from rollfleet.workers.version_failures import reason_of
from rollfleet.workers.version_following import Attempt, start_step


@dataclass
class StartedOn:
    """What a start serves: ``version``, materialized in ``where`` (``result``); ``latest_error``:
    why the latest commit could not be served, where an older version is (None: it is the latest)."""

    version: int
    result: MaterializeResult
    where: Path
    latest_error: BaseException | None


def waiting_reason(errors: dict[int, BaseException]) -> str:
    """What a starting replica that serves nothing yet says while it waits."""
    shown = "; ".join(f"version {v}: {reason_of(errors[v])}" for v in sorted(errors, reverse=True)[:4])
    return f"serving nothing yet, waiting for a prepare still running ({shown})"


class StartUp:
    """One start's attempts: which versions were tried, in which slot, and how each went."""

    def __init__(
        self,
        materializations: Materializations,
        slots: Sequence[Path],
        *,
        bound_s: float,
        older_committed: Callable[[int], Awaitable[list[int]]],
        store_label: str,
        log: Any,
    ) -> None:
        self._running = materializations
        self._slots = slots
        self._bound_s = bound_s
        self._older_committed = older_committed
        self._store_label = store_label
        self.log = log
        self.attempts: dict[int, Attempt] = {}
        self.flights: dict[int, Flight] = {}
        self.errors: dict[int, BaseException] = {}
        self.bound_at: dict[int, float] = {}
        for flight in self._running.flights.values():  # (left by an earlier try of this start: waited for too)
            self.attempts[flight.version], self.flights[flight.version] = "stuck", flight
            self.errors[flight.version] = PrepareTimeout(
                f"an earlier prepare of version {flight.version} is still running"
            )

    async def run(self, latest: int, held: bool, registration: Registration | None) -> StartedOn:
        """Carry out ``start_step``'s steps until one version is served; waits while a prepare past
        its bound may still return; ``NoServableVersion`` when every one failed. ``held``: that
        version and no other."""
        older: list[int] | None = [] if held else None
        while True:
            free = [slot for slot in self._slots if slot not in self._running.flights]
            step = start_step(latest, older, self.attempts, len(free))
            if step.action == "serve":
                assert step.version is not None
                flight = self.flights[step.version]
                failed = self.errors[latest] if step.version < latest else None
                return StartedOn(step.version, flight.task.result(), flight.where, failed)
            if step.action == "list":
                older = await self._older_committed(latest)
            elif step.action == "try":
                assert step.version is not None
                self._try(step.version, latest, free[0])
            elif step.action == "give_up":
                raise self.errors[latest] if held else self._none_servable(latest)
            else:  # wait: for a prepare to return, or for the one within its bound to pass it
                await self._wait()
                if self._settle() and registration is not None:
                    # Serving nothing yet, and why ("degraded" would tell clients it pulls jobs).
                    await registration.write(degraded_reason=waiting_reason(self.errors))

    def _try(self, version: int, latest: int, slot: Path) -> None:
        if version != latest:
            self.log.warning("trying an older version", version=version, local_dir=str(slot))
        self.flights[version] = self._running.launch(version, slot)
        self.attempts[version] = "running"
        self.bound_at[version] = time.monotonic() + self._bound_s

    def _none_servable(self, latest: int) -> NoServableVersion:
        errors = self.errors
        shown = "; ".join(f"version {v}: {reason_of(exc)}" for v, exc in list(errors.items())[:4])
        return NoServableVersion(
            f"no committed version at or below {latest} can be served from {self._store_label} ({shown})",
            latest=latest,
            failures={v: getattr(exc, "code", type(exc).__name__) for v, exc in errors.items()},
        )

    async def _wait(self) -> None:
        """Until a prepare returns, or the one within its bound passes it."""
        attempts = self.attempts
        running = [self.bound_at[v] for v, a in attempts.items() if a == "running"]
        pending = {self.flights[v].task for v, a in attempts.items() if a in ("running", "stuck")}
        pending |= {f.task for f in self._running.flights.values()}  # (whatever holds a directory)
        timeout = max(0.0, min(running) - time.monotonic()) if running else None
        await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    def _settle(self) -> bool:
        """Record how the start-up prepares went since the last look; True if one failed or passed
        its bound while one is stuck (what the replica says while it waits changed)."""
        attempts, errors = self.attempts, self.errors
        changed = False
        for v, attempt in list(attempts.items()):
            task = self.flights[v].task
            if attempt in ("running", "stuck") and task.done():
                exc = task.exception()
                if exc is None:
                    attempts[v] = "done"
                    continue
                if not isinstance(exc, (PolicyError, OSError)):
                    raise exc
                attempts[v], errors[v] = "failed", exc
                self.log.warning("a version cannot be served", version=v, error=str(exc))
                changed = True
            elif attempt == "running" and time.monotonic() >= self.bound_at[v]:
                self.flights[v].abandoned = True  # (its thread goes on; this start no longer waits on it alone)
                attempts[v] = "stuck"
                errors[v] = past_bound(v, self._bound_s)
                self.log.warning("a prepare is past its bound; waiting for it", version=v, error=str(errors[v]))
                changed = True
        return changed and "stuck" in attempts.values()
