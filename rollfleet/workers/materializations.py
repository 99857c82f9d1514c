"""Materializations in flight: a version pulled, applied and verified into a checkpoint directory
on a daemon thread, bounded by the caller's wait, never by the thread's life.

Past its bound a prepare is not abandoned: its thread goes on holding the checkpoint directory it
writes, and its work is kept. A directory is written by one materialization at a time
(``holds``); the thread's return (``on_late``) tells the owner of one its caller gave up on, so
the follow loop can continue from what it materialized. The threads are daemons, so a stop never
waits for them; while one runs, ``stuck`` says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.policy_store import MaterializeResult
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.local_disk import as_local_disk_error
from rollfleet.policy_store.remote import materialize_from
from rollfleet.runtime.aio import in_daemon_thread
from rollfleet.schemas.errors import PrepareTimeout


@dataclass
class Flight:
    """A materialization running on a daemon thread into ``where``; ``abandoned``: its caller
    stopped waiting (past its bound, or the start that launched it moved on)."""

    version: int
    where: Path
    task: asyncio.Task[MaterializeResult]
    abandoned: bool = False


def past_bound(version: int, bound_s: float) -> PrepareTimeout:
    """A materialization its caller stopped waiting for, its thread still running."""
    return PrepareTimeout(
        f"materializing version {version} took longer than {bound_s:g} s (a read that is slow "
        "or never returns); still running"
    )


class Materializations:
    """The materializations running, by the checkpoint directory each holds."""

    def __init__(
        self,
        store: Path | Bucket,
        *,
        pre_read_hook: str | None,
        on_late: Callable[[Flight, BaseException | None], None],
        log: Any,
    ) -> None:
        self._store = store
        self._pre_read_hook = pre_read_hook
        self._on_late = on_late  # a flight whose caller gave up returned (its error, or None)
        self._log = log
        self.flights: dict[Path, Flight] = {}  # materializations running, by the directory they hold

    def holds(self, where: Path) -> Flight | None:
        """The materialization writing ``where``, if one runs."""
        return self.flights.get(where)

    @property
    def stuck(self) -> bool:
        """Whether a materialization's thread is still running (a prepare stuck in a read, or one
        a stop did not wait for): its pool's threads would hold the interpreter's exit."""
        return bool(self.flights)

    async def bounded(self, target: int, where: Path, bound_s: float) -> MaterializeResult:
        """Materialize ``target`` into ``where``, bounded; past the bound the thread goes on
        (``launch``) and ``PrepareTimeout`` is raised."""
        held = self.flights.get(where)
        if held is not None:  # (the follow loop waits for it; never two writers in one directory)
            raise PrepareTimeout(f"the prepare of version {held.version} is still running; not preparing {target}")
        flight = self.launch(target, where)
        try:
            return await asyncio.wait_for(asyncio.shield(flight.task), bound_s)
        except TimeoutError:
            flight.abandoned = True
            raise past_bound(target, bound_s) from None

    def launch(self, target: int, where: Path) -> Flight:
        """``materialize`` of ``target`` into ``where`` on a daemon thread (a stop never waits for it),
        held in ``flights`` until the thread returns, however long after its caller gave up."""
        store = self._store
        assert where not in self.flights

        def run() -> MaterializeResult:
            try:
                return materialize_from(store, where, target, pre_read_hook=self._pre_read_hook)
            except OSError as exc:  # the replica's own disk refusing a write: typed, retried later
                typed = as_local_disk_error(exc, str(where))
                if typed is None:
                    raise
                raise typed from exc

        flight = Flight(target, where, asyncio.ensure_future(in_daemon_thread(run)))
        self.flights[where] = flight
        flight.task.add_done_callback(lambda _: self._landed(flight))
        return flight

    def _landed(self, flight: Flight) -> None:
        """A materialization's thread returned. One its caller gave up on is told to ``on_late``."""
        self.flights.pop(flight.where, None)
        if flight.task.cancelled():
            return
        exc = flight.task.exception()  # (retrieved here: nobody may be awaiting it any more)
        if not flight.abandoned:
            return
        self._log.info(
            "a prepare past its bound returned",
            version=flight.version,
            local_dir=str(flight.where),
            error=None if exc is None else str(exc),
        )
        self._on_late(flight, exc)
