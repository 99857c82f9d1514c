"""The worker's entry in the fleet registry (KV ``RF_<NS>_FLEET``, key ``replica.<id>``).

Rewritten on every heartbeat and on every state change, so readers can ignore entries
whose heartbeat is older than three intervals (a dead worker goes stale on its own).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, ReplicaStatus, encode

log = get_logger("rollfleet.registry")


class Registration:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        status: ReplicaStatus,
        refresh: Callable[[ReplicaStatus], None] | None = None,
    ) -> None:
        self._js = js
        self._names = names
        self.status = status
        self._refresh = refresh  # fills in live fields (in-flight count...) before each write
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None
        self.status.host = self.status.host or socket.gethostname()
        self.status.pid = self.status.pid or os.getpid()

    @property
    def key(self) -> str:
        return self._names.replica_key(self.status.worker_id)

    async def start(self) -> None:
        self._kv = await self._js.key_value(self._names.fleet_bucket)
        await self.write()
        self._task = asyncio.create_task(self._beat(), name="heartbeat")

    async def write(self, **changes: object) -> None:
        """Apply ``changes`` to the status and publish it now."""
        for name, value in changes.items():
            setattr(self.status, name, value)
        if self._refresh is not None:
            self._refresh(self.status)
        self.status.heartbeat_at = time.time()
        if self._kv is None:
            return
        try:
            await self._kv.put(self.key, encode(self.status))
        except Exception as exc:  # broker away: the next beat retries
            log.warning("registry write failed", error=str(exc), worker_id=self.status.worker_id)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.status.heartbeat_interval_s)
            await self.write()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._kv is not None:
            try:
                await self._kv.delete(self.key)
            except Exception as exc:
                log.warning("registry delete failed", error=str(exc))
