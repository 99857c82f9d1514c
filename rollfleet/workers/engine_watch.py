"""The engine's health, watched locally: a dead or hung engine makes the replica ``down``
(taking no jobs, the pull loop cancelling every request), said in one line and in the registry,
until it is back. A failed generation says so at once too (``JobRunner``'s ``on_engine_down``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from rollfleet.workers.engines import Engine
from rollfleet.workers.registry import Registration
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.worker_metrics import WorkerMetrics


class EngineWatch:
    def __init__(
        self,
        engine: Engine,
        served: ServedVersion,
        metrics: WorkerMetrics,
        log: Any,
        *,
        health_s: float,
        registration: Callable[[], Registration | None],
        served_changed: Callable[[], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self._engine = engine
        self._served = served
        self._metrics = metrics
        self.log = log
        self._health_s = health_s
        self._registration = registration  # (none before the replica registers)
        self._served_changed = served_changed  # what the replica accepts changed: the puller looks
        self._spawn = spawn

    def down(self, detail: str) -> None:
        """The engine is dead or hung: take no more jobs (the pull loop cancels every request),
        say so in one line and in the registry (``down``, with the reason), until it is back."""
        if self._served.down:
            return
        self._served.down = True
        self.log.error("engine down; taking no jobs until it is back", engine=self._engine.name, reason=detail)
        self._metrics.engine_down.set(1)
        registration = self._registration()
        if registration is not None:
            reason = f"engine {self._engine.name} down: {detail}"
            self._spawn(registration.write(state="down", degraded_reason=reason))
        self._served_changed()

    async def _up(self) -> None:
        self._served.down = False
        self._metrics.engine_down.set(0)
        self.log.info("engine back; taking jobs again", engine=self._engine.name)
        registration = self._registration()
        if registration is not None:
            await registration.write(state="ready", degraded_reason=None)
        self._served_changed()

    async def watch(self) -> None:
        """Check the engine's health every ``health_s`` (a local call: an HTTP engine asks its
        server, the others look at themselves). Runs until cancelled."""
        while True:
            await asyncio.sleep(self._health_s)
            try:
                bound = max(self._engine.health_timeout_s + 1.0, 2 * self._health_s)
                health = await asyncio.wait_for(self._engine.health(), bound)
                ok, detail = health.ok, health.detail
            except Exception as exc:  # a hung check is a hung engine
                ok, detail = False, f"health check failed: {exc!r}"
            if not ok:
                self.down(detail)
            elif self._served.down:
                await self._up()
