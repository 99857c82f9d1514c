"""The jobs a replica runs now, each as its own task holding one slot until it ends.

Turning busy, or full, and idle again, or a slot free again, is noted in the registry at once
(``Registration.note_busy_changed``): ``status`` shows it within a second, and clients ring the
bells of replicas with a free slot first (``FleetView.bell_target``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from rollfleet.broker.types import Msg
from rollfleet.workers.registry import Registration

Delivery = tuple[int, float, int] | None


class JobsInFlight:
    def __init__(
        self,
        capacity: int,
        *,
        handle: Callable[[Msg, Delivery], Coroutine[Any, Any, None]],
        registration: Callable[[], Registration | None],
        on_done: Callable[[], None],
    ) -> None:
        self._capacity = capacity
        self._handle = handle  # one job's whole life (``JobRunner.handle``)
        self._registration = registration  # (none before the replica registers)
        self._on_done = on_done  # a slot is free again: the pull loop looks
        self.tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self.tasks)

    def run(self, msg: Msg, info: Delivery) -> None:
        """A delivered job runs as its own task; its slot is free again when it ends."""
        task = asyncio.create_task(self._handle(msg, info))
        self.tasks.add(task)
        task.add_done_callback(self._done)
        # Turned busy, or full: `status` shows it within a second, and clients ring the bells of
        # replicas with a free slot first (``FleetView.bell_target``).
        registration = self._registration()
        if len(self.tasks) in (1, self._capacity) and registration is not None:
            registration.note_busy_changed()

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._on_done()
        registration = self._registration()
        if len(self.tasks) in (0, self._capacity - 1) and registration is not None:
            registration.note_busy_changed()  # idle again, or a slot free again

    async def drain(self, timeout_s: float) -> None:
        """Let the running jobs finish, for ``timeout_s`` at most; past it they are cancelled (their
        jobs, unacked, are redelivered elsewhere)."""
        deadline = time.monotonic() + timeout_s
        while self.tasks and time.monotonic() < deadline:
            await asyncio.wait(list(self.tasks), timeout=0.1)
        for task in list(self.tasks):  # past the drain time-out: redelivered elsewhere
            task.cancel()
