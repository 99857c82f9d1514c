"""FleetView: what the trainer knows about the fleet and the policy versions.

Follows the fleet registry and the policy KV with one watcher each, and re-reads both only
at start and after a reconnect (when watcher updates may have been missed), never
periodically: an idle fleet costs the trainer one registry refresh per replica per heartbeat
interval, and nothing else.

The request path asks it three questions per submitted job, each answered from an index
rebuilt only when a replica's routing state changes or one may have gone stale:
``compatible`` (fail fast), ``covered`` (is a request surely waiting for this subject, so no
bell is needed) and ``bell_target`` (which one replica to wake, round robin).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rollfleet.broker.buckets import KVBucket
from rollfleet.broker.kv import read_latest, read_replicas
from rollfleet.broker.kv_watch import watch_keys
from rollfleet.broker.types import JetStreamContext, KeyValue
from rollfleet.runtime.aio import stop_tasks, wait_event
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    HeardClock,
    Names,
    ReplicaStatus,
    VersionConstraint,
    VersionRecord,
    decode,
    heartbeat_on_readers_clock,
)
from rollfleet.schemas.errors import InvalidRequest, ServiceUnavailable
from rollfleet.schemas.names import listened_subjects

log = get_logger("rollfleet.fleet")

_SERVING = ("ready", "preparing", "activating", "degraded")  # states in which a replica pulls jobs
_SETTLE_S = 0.005


def _routing(status: ReplicaStatus) -> tuple[object, ...]:
    return status.state, status.active_version, status.preparing_version


@dataclass
class _Index:
    """The live fleet as the request path needs it; valid until a listed replica may go stale."""

    live: list[ReplicaStatus]
    valid_until: float
    pullers: list[ReplicaStatus]  # live replicas that pull jobs, by active version
    listened: set[tuple[str, int]]  # subjects some of those keep a request waiting on when idle
    compatible: dict[tuple[str, int], list[ReplicaStatus]] = field(default_factory=dict)

    @classmethod
    def build(cls, replicas: dict[str, ReplicaStatus], now: float) -> _Index:
        live = sorted((r for r in replicas.values() if r.is_live(now)), key=lambda r: r.worker_id)
        until = min((r.heartbeat_at + r.stale_after_s() for r in live), default=math.inf)
        pullers = sorted((r for r in live if r.state in _SERVING), key=lambda r: (r.active_version, r.worker_id))
        # A replica idle at version w keeps one request waiting on each of the first `capacity`
        # subjects of its window (workers/worker.py, _placement).
        listened = {s for r in pullers for s in listened_subjects(r.active_version)[: max(r.capacity, 1)]}
        return cls(live, until, pullers, listened)


def with_room_first(fit: list[ReplicaStatus]) -> list[ReplicaStatus]:
    """Of the replicas that may take a job, those the registry shows with a free slot, else all
    of them. A replica with every slot taken has no pull request open: a bell rung there wakes
    nothing that can take the job, and the job waits for the next stall check's bell."""
    room = [r for r in fit if r.in_flight < r.capacity]
    return room or fit


def _first_at_or_above(pullers: list[ReplicaStatus], version: int) -> int:
    """Index of the first replica (sorted by active version) at ``version`` or above."""
    return bisect.bisect_left(pullers, version, key=lambda r: r.active_version)


class FleetView:
    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self._js = js
        self._names = names
        self._replicas: dict[str, ReplicaStatus] = {}
        self._clocks: dict[str, HeardClock] = {}  # worker id -> what its heartbeats taught of its clock
        self._latest: int | None = None
        # What the fleet's autoscaler last published (``Names.AUTOSCALER_STATUS_KEY``), as its
        # bytes: heard by the registry's own watcher at no cost; a gateway's 409 reads it.
        self.autoscaler_status: bytes | None = None
        self._fleet_kv: KeyValue | None = None
        self._policy_kv: KeyValue | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._index: _Index | None = None
        self._turns: dict[tuple[str, int], itertools.count[int]] = {}  # round robin of bells
        self._changed = asyncio.Event()  # replaced on every change; waiters hold the old one

    async def start(self) -> FleetView:
        self._fleet_kv = await self._js.key_value(self._names.fleet_bucket)
        self._policy_kv = await self._js.key_value(self._names.policy_bucket)
        await self.refresh()
        self._watch()
        return self

    def _watch(self) -> None:
        assert self._fleet_kv is not None and self._policy_kv is not None
        self._tasks = [
            asyncio.create_task(watch_keys(self._fleet_kv, ">", self._on_entry, log), name="fleet-watch"),
            asyncio.create_task(
                watch_keys(self._policy_kv, self._names.LATEST_KEY, self._on_entry, log), name="policy-watch"
            ),
        ]

    async def rewatch(self) -> None:
        """The registry or the policy bucket was lost and declared again: a watcher of the lost one
        may wait for ever on a consumer that no longer exists, without an error. Watch both anew
        and re-read them."""
        await stop_tasks(self._tasks)
        self._watch()
        await self.refresh()

    async def close(self) -> None:
        await stop_tasks([*self._tasks, *self._background])

    # -- reading ----------------------------------------------------------------------------
    @property
    def latest_version(self) -> int | None:
        """The newest committed policy version (None before the first commit)."""
        return self._latest

    def replicas(self, live_only: bool = True) -> list[ReplicaStatus]:
        if live_only:  # the newest entry of each (the index keeps the one it was built from)
            current = self._replicas
            return [current[r.worker_id] for r in self._current().live if r.worker_id in current]
        return sorted(self._replicas.values(), key=lambda r: r.worker_id)

    def replica(self, worker_id: str) -> ReplicaStatus | None:
        """The newest registry entry of one replica (live or not); None if it has none."""
        return self._replicas.get(worker_id)

    def compatible(self, constraint: VersionConstraint) -> list[ReplicaStatus]:
        """Live replicas at, or preparing, a version the constraint accepts."""
        index = self._current()
        key = (constraint.kind, constraint.version)
        found = index.compatible.get(key)
        if found is None:
            found = index.compatible[key] = [r for r in index.live if r.can_serve(constraint)]
        return found

    def will_serve(self, constraint: VersionConstraint) -> bool:
        """Whether a live replica can serve the constraint or is bound to (``ReplicaStatus.will_serve``:
        one following ``latest`` reaches every committed version): what a request is refused on."""
        if self.compatible(constraint):
            return True
        return any(r.will_serve(constraint, self._latest) for r in self._current().live)

    def covered(self, constraint: VersionConstraint) -> bool:
        """Whether a live replica listens on the constraint's subject: an idle replica at
        version w keeps a pull request waiting on each of the first ``capacity`` subjects of its
        window (``listened_subjects``), so a job there needs no bell."""
        return (constraint.kind, constraint.version) in self._current().listened

    def bell_target(self, constraint: VersionConstraint) -> ReplicaStatus | None:
        """The next live replica, round robin, whose active version can take the job now (one with a
        free slot, where the registry shows any: ``with_room_first``)."""
        index = self._current()
        pullers = index.pullers
        if constraint.kind == "exact":
            fit = [r for r in pullers if r.takes_now(constraint)]  # (not one activating away from it)
        else:  # sorted by version: those from the first at or above it
            fit = pullers[_first_at_or_above(pullers, constraint.version) :]
        pool = with_room_first(fit)
        if not pool:
            return None
        # (Kept across index rebuilds: a rebuild must not send every bell to the first replica.)
        turn = self._turns.setdefault((constraint.kind, constraint.version), itertools.count())
        return pool[next(turn) % len(pool)]

    def mark_gone(self, worker_id: str) -> None:
        """The broker says nobody listens on this replica's bell: it is gone (its next registry
        update, if any, brings it back)."""
        if self._replicas.pop(worker_id, None) is not None:
            self._index = None
            self._notify()

    async def version_record(self, version: int) -> VersionRecord | None:
        assert self._policy_kv is not None
        entry = await KVBucket(self._policy_kv).read(self._names.version_key(version))
        if entry is None:
            return None
        return decode(entry.value or b"", VersionRecord, what="version record") if entry.value else None

    async def refresh(self) -> None:
        """Re-read the registry and the latest version from the broker (one snapshot each)."""
        assert self._fleet_kv is not None and self._policy_kv is not None
        now, read = time.time(), await read_replicas(self._fleet_kv)
        self._clocks = {w: c for w, c in self._clocks.items() if w in read}
        self._replicas = {w: self._timed(w, r, now, live=False) for w, r in read.items()}
        self._index = None
        latest = await read_latest(self._policy_kv)
        if latest is not None:
            self._set_latest(latest)
        self._notify()

    def note_reconnected(self) -> None:
        """After a reconnect: updates may have been missed; re-read once."""
        task = asyncio.ensure_future(self._refresh_quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_for_version(
        self,
        version: int,
        *,
        replicas: int | None = None,
        fraction: float | None = None,
        timeout: float = 120.0,
    ) -> list[ReplicaStatus]:
        """Wait until ``replicas`` live replicas (or ``fraction`` of the live fleet; default: all,
        at least one) serve ``version`` or newer. Raises ``ServiceUnavailable`` on time-out.
        Driven by the watch; the view is re-read only after a reconnect."""
        if replicas is not None and fraction is not None:
            raise InvalidRequest("give replicas or fraction, not both")
        deadline = time.monotonic() + timeout

        def satisfied() -> list[ReplicaStatus] | None:
            now = time.time()
            live = [r for r in self._replicas.values() if r.is_live(now) and r.state not in ("draining", "starting")]
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
            # The time-out re-evaluates liveness (a replica going stale is no event); no read.
            await wait_event(self._changed, min(remaining, 1.0))
            await asyncio.sleep(_SETTLE_S)  # count once per burst (a fleet activating), not per entry
        return done

    # -- following --------------------------------------------------------------------------
    def _current(self) -> _Index:
        now = time.time()
        if self._index is None or now > self._index.valid_until:
            self._index = _Index.build(self._replicas, now)
        return self._index

    def _set_latest(self, version: int) -> None:
        if self._latest is None or version > self._latest:
            self._latest = version

    def note_committed(self, version: int) -> None:
        """Called by a publisher in this process right after it commits."""
        self._set_latest(version)

    def changed(self) -> asyncio.Event:
        """Set at the next change of the view (a registry entry or ``latest``)."""
        return self._changed

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _apply(self, key: str, value: bytes | None, deleted: bool, heard_at: float | None = None) -> None:
        """One registry entry or ``latest``. ``heard_at``: this client's time when the entry was
        heard as it was written (a live watch update); None: read from a snapshot (start,
        reconnect). Heartbeats are timed on this client's clock (``_timed``)."""
        if key == self._names.LATEST_KEY:
            if value and not deleted:
                with suppress(ValueError):
                    self._set_latest(int(value))
            return
        if key == Names.AUTOSCALER_STATUS_KEY:
            self.autoscaler_status = None if deleted else value
            return
        if not key.startswith(Names.REPLICA_PREFIX):
            return
        worker_id = key[len(Names.REPLICA_PREFIX) :]
        if deleted or not value:
            self._clocks.pop(worker_id, None)
            if self._replicas.pop(worker_id, None) is not None:
                self._index = None
            return
        try:
            status = decode(value, ReplicaStatus, what="replica status")
        except InvalidRequest as exc:
            log.warning("ignoring undecodable registry entry", key=key, error=exc.message)
            return
        live = heard_at is not None
        status = self._timed(worker_id, status, heard_at if heard_at is not None else time.time(), live=live)
        before = self._replicas.get(worker_id)
        self._replicas[worker_id] = status
        if before is None or _routing(before) != _routing(status) or not before.is_live():
            self._index = None  # a heartbeat of a listed replica changes nothing the index holds

    def _timed(self, worker_id: str, status: ReplicaStatus, heard_at: float, *, live: bool) -> ReplicaStatus:
        """The entry with its heartbeat on this client's clock (``heartbeat_on_readers_clock``)."""
        known = self._clocks.get(worker_id, HeardClock())
        when, self._clocks[worker_id] = heartbeat_on_readers_clock(
            known, status.started_at, status.heartbeat_at, heard_at, live=live
        )
        return msgspec.structs.replace(status, heartbeat_at=when)

    def _on_entry(self, entry: Any, live: bool = False) -> None:
        self._apply(entry.key, entry.value, entry.operation in ("DEL", "PURGE"), time.time() if live else None)
        self._notify()

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:
            log.debug("fleet refresh failed", error=str(exc))
