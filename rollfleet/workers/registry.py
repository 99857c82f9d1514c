"""The worker's entry in the fleet registry (KV ``RF_<NS>_FLEET``, key ``replica.<id>``).

Written, and acknowledged, on every state change (starting, preparing, ready, degraded,
draining; draining is final: nothing written after it says the replica serves again). Between
changes it is refreshed once per ``heartbeat_interval_s`` (20 s by default, with a little
jitter), fire-and-forget: one stored message and no reply, so an idle
replica costs the broker one message in and one out per watching trainer per interval. Readers
ignore an entry whose heartbeat is older than three intervals (``ReplicaStatus.is_live``), so
a replica that died without deregistering stops counting within 3 x ``heartbeat_interval_s``.
A clean stop deletes the entry at once.

A replica that turns busy (no job running, then one) or idle again is refreshed promptly
(``note_busy_changed``), at most once per ``BUSY_REFRESH_GAP_S``, so ``rollfleet status`` never
shows a busy replica as idle for a whole interval. A replica that stays busy or stays idle
writes nothing more: an idle fleet still costs only its heartbeats.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from collections.abc import Callable

from rollfleet.broker.types import NATS, JetStreamContext, KeyValue
from rollfleet.runtime.aio import wait_event
from rollfleet.runtime.logs import get_logger
from rollfleet.runtime.secrets import redact_urls
from rollfleet.schemas import Names, ReplicaStatus, encode

log = get_logger("rollfleet.registry")

_JITTER = 0.1  # each refresh waits the interval times 1 +- this, so a fleet started at once spreads out
BUSY_REFRESH_GAP_S = 1.0  # busy/idle refreshes at most this often: a replica flapping costs 1 message/s


class Registration:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        status: ReplicaStatus,
        refresh: Callable[[ReplicaStatus], None] | None = None,
        nc: NATS | None = None,
    ) -> None:
        self._js = js
        self._nc = nc  # for the unacknowledged refresh; without it a refresh is an acknowledged write
        self._names = names
        self.status = status
        self._refresh = refresh  # fills in live fields (in-flight count...) before each write
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None
        self._written = asyncio.Event()  # set by every write: the next refresh is one interval later
        self._written_at = 0.0  # monotonic time of the last write
        self._busy_refresh: asyncio.Task[None] | None = None  # a busy/idle refresh not yet written
        self._stopped = False  # deregistered: a job ending later must not write the entry back
        self.status.host = self.status.host or socket.gethostname()
        self.status.pid = self.status.pid or os.getpid()

    @property
    def key(self) -> str:
        return self._names.replica_key(self.status.worker_id)

    @property
    def _subject(self) -> str:
        return f"$KV.{self._names.fleet_bucket}.{self.key}"

    async def start(self) -> None:
        self._kv = await self._js.key_value(self._names.fleet_bucket)
        await self.write()
        self._task = asyncio.create_task(self._beat(), name="heartbeat")

    def _prepare(self, changes: dict[str, object]) -> bytes:
        if self.status.state == "draining":
            # Draining is final: a stop's write may be followed by one of a version sync still in
            # flight (a prepare failing: "degraded"), and an entry that says it serves again draws
            # bells and turns the replica will never take (campaign seed 747108: 8 s of stalled
            # bells went to a draining replica shown "degraded" with free slots).
            changes = {name: value for name, value in changes.items() if name != "state"}
        for name, value in changes.items():
            setattr(self.status, name, value)
        if self._refresh is not None:
            self._refresh(self.status)
        if self.status.degraded_reason:  # error text may quote a URL: its credentials stay out of the registry
            self.status.degraded_reason = redact_urls(self.status.degraded_reason)
        self.status.heartbeat_at = time.time()
        self._written_at = time.monotonic()
        self._written.set()
        return encode(self.status)

    async def write(self, **changes: object) -> None:
        """Apply ``changes`` to the status and store it now (acknowledged)."""
        data = self._prepare(changes)
        if self._kv is None:
            return
        try:
            await self._kv.put(self.key, data)
        except Exception as exc:  # broker away: the next refresh retries
            log.warning("registry write failed", error=str(exc), worker_id=self.status.worker_id)

    async def refresh(self) -> None:
        """Store the current status without waiting for an acknowledgement (the heartbeat)."""
        if self._nc is None:
            await self.write()
            return
        data = self._prepare({})
        if self._kv is None:
            return
        try:
            await self._nc.publish(self._subject, data)
        except Exception as exc:
            log.debug("registry refresh failed", error=str(exc), worker_id=self.status.worker_id)

    def note_busy_changed(self) -> None:
        """The replica turned busy or idle: refresh now, or at the end of the rate-limit gap.
        The write reads the live figures when it happens, so the last change always lands."""
        if self._kv is None or self._stopped or self._busy_refresh is not None:
            return  # not started, deregistered, or a refresh is already on its way
        delay = max(0.0, self._written_at + BUSY_REFRESH_GAP_S - time.monotonic())
        self._busy_refresh = asyncio.create_task(self._refresh_after(delay), name="busy-refresh")

    async def _refresh_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._busy_refresh = None  # a change from here on needs a write of its own
        await self.refresh()

    async def _beat(self) -> None:
        interval = self.status.heartbeat_interval_s
        first = True
        while True:
            self._written.clear()
            # The first wait has a random phase, so replicas started together do not beat together.
            wait = interval * (random.uniform(0.5, 1.0) if first else random.uniform(1 - _JITTER, 1 + _JITTER))
            first = False
            if await wait_event(self._written, wait):
                continue  # a write just happened: the next refresh is an interval after it
            await self.refresh()

    async def stop(self) -> None:
        self._stopped = True
        for task in (self._task, self._busy_refresh):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        if self._kv is not None:
            try:
                await self._kv.delete(self.key)
            except Exception as exc:
                log.warning("registry delete failed", error=str(exc), worker_id=self.status.worker_id)
