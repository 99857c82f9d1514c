"""FleetView: what the trainer knows about the fleet and the policy versions.

Follows the fleet registry and the policy KV with watchers, and re-reads both
periodically, because watcher updates can be missed across a reconnect.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import suppress
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollfleet.broker.kv import read_latest, read_replicas
from rollfleet.broker.watch import watch_keys
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, ReplicaStatus, VersionConstraint, VersionRecord, decode
from rollfleet.schemas.errors import InvalidRequest, ServiceUnavailable

log = get_logger("rollfleet.fleet")


class FleetView:
    def __init__(self, js: JetStreamContext, names: Names, refresh_s: float = 5.0) -> None:
        self._js = js
        self._names = names
        self._refresh_s = refresh_s
        self._replicas: dict[str, ReplicaStatus] = {}
        self._latest: int | None = None
        self._fleet_kv: KeyValue | None = None
        self._policy_kv: KeyValue | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()  # replaced on every change; waiters hold the old one

    async def start(self) -> FleetView:
        self._fleet_kv = await self._js.key_value(self._names.fleet_bucket)
        self._policy_kv = await self._js.key_value(self._names.policy_bucket)
        await self.refresh()
        self._tasks = [
            asyncio.create_task(watch_keys(self._fleet_kv, ">", self._on_entry, log), name="fleet-watch"),
            asyncio.create_task(
                watch_keys(self._policy_kv, self._names.LATEST_KEY, self._on_entry, log), name="policy-watch"
            ),
            asyncio.create_task(self._periodic(), name="fleet-refresh"),
        ]
        return self

    async def close(self) -> None:
        await stop_tasks(self._tasks)

    # -- reading ----------------------------------------------------------------------------
    @property
    def latest_version(self) -> int | None:
        """The newest committed policy version (None before the first commit)."""
        return self._latest

    def replicas(self, live_only: bool = True) -> list[ReplicaStatus]:
        now = time.time()
        return sorted(
            (r for r in self._replicas.values() if not live_only or r.is_live(now)), key=lambda r: r.worker_id
        )

    def compatible(self, constraint: VersionConstraint) -> list[ReplicaStatus]:
        """Live replicas at, or preparing, a version the constraint accepts."""
        return [r for r in self.replicas() if r.can_serve(constraint)]

    async def version_record(self, version: int) -> VersionRecord | None:
        assert self._policy_kv is not None
        try:
            entry = await self._policy_kv.get(self._names.version_key(version))
        except nats.js.errors.KeyNotFoundError:
            return None
        return decode(entry.value or b"", VersionRecord, what="version record") if entry.value else None

    async def refresh(self) -> None:
        """Re-read the registry and the latest version from the broker."""
        assert self._fleet_kv is not None and self._policy_kv is not None
        self._replicas = await read_replicas(self._fleet_kv)
        latest = await read_latest(self._policy_kv)
        if latest is not None:
            self._set_latest(latest)
        self._notify()

    async def wait_for_version(
        self,
        version: int,
        *,
        replicas: int | None = None,
        fraction: float | None = None,
        timeout: float = 120.0,
    ) -> list[ReplicaStatus]:
        """Wait until ``replicas`` live replicas (or ``fraction`` of the live fleet; default: all,
        at least one) serve ``version`` or newer. Raises ``ServiceUnavailable`` on time-out."""
        if replicas is not None and fraction is not None:
            raise InvalidRequest("give replicas or fraction, not both")
        deadline = time.monotonic() + timeout

        def satisfied() -> list[ReplicaStatus] | None:
            live = [r for r in self.replicas() if r.state not in ("draining", "starting")]
            at = [r for r in live if r.active_version >= version]
            if replicas is not None:
                need = replicas
            elif fraction is not None:
                need = max(1, math.ceil(fraction * len(live)))
            else:
                need = max(1, len(live))
            return at if len(at) >= need else None

        while (done := satisfied()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                have = {r.worker_id: r.active_version for r in self.replicas()}
                raise ServiceUnavailable(f"fleet did not reach version {version} in {timeout:.0f}s: {have}")
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
            except TimeoutError:
                await self._refresh_quietly()
        return done

    # -- following --------------------------------------------------------------------------
    def _set_latest(self, version: int) -> None:
        if self._latest is None or version > self._latest:
            self._latest = version

    def note_committed(self, version: int) -> None:
        """Called by a publisher in this process right after it commits."""
        self._set_latest(version)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _apply(self, key: str, value: bytes | None, deleted: bool) -> None:
        if key == self._names.LATEST_KEY:
            if value and not deleted:
                with suppress(ValueError):
                    self._set_latest(int(value))
            return
        if not key.startswith(Names.REPLICA_PREFIX):
            return
        worker_id = key[len(Names.REPLICA_PREFIX) :]
        if deleted or not value:
            self._replicas.pop(worker_id, None)
            return
        try:
            self._replicas[worker_id] = decode(value, ReplicaStatus, what="replica status")
        except InvalidRequest as exc:
            log.warning("ignoring undecodable registry entry", key=key, error=exc.message)

    def _on_entry(self, entry: Any) -> None:
        self._apply(entry.key, entry.value, entry.operation in ("DEL", "PURGE"))
        self._notify()

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:
            log.debug("fleet refresh failed", error=str(exc))

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self._refresh_quietly()
