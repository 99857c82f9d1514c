"""Reading the demand signal from the broker: the facts ``signal.demand_signal`` sorts.

- the jobs stream, per subject: jobs waiting, jobs running, the oldest one's age
  (``broker.jobs_load.jobs_on_subjects``: one request when idle, a few per subject with jobs);
- the registry: every live replica, its version, slots and busy slots, and whether it holds a
  version (``ReplicaStatus.held_version``), through the client's ``FleetView`` (one watcher,
  heartbeats timed on this process's clock);
- the open sessions pinned to a version (one watcher on the sessions bucket);
- the requests refused ``NoCompatibleReplica`` lately, as clients say them on
  ``Names.demand_refused_subject`` (``trainer_client.refusals``): heard, counted over
  ``REFUSAL_WINDOW_S``, never stored. A controller that restarts hears the next refusal;
- with a store directory: whether a version asked for can still be materialized there.

Everything read here is recomputed from the broker by a controller that restarts: nothing is
kept that the broker does not hold.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path
from typing import Any

from rollfleet.autoscale.signal import ReplicaFacts, Signal, SubjectKey, SubjectLoad, demand_signal, with_own_pending
from rollfleet.broker.buckets import KVBucket, open_bucket
from rollfleet.broker.jobs_load import SubjectJobs, jobs_on_subjects
from rollfleet.broker.kv_watch import watch_keys
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, ReplicaStatus, SessionRecord, VersionRecord, decode
from rollfleet.schemas.bell_wire import parse_bell_payload
from rollfleet.schemas.errors import InvalidRequest, PolicyError, RollfleetError
from rollfleet.trainer_client.fleet import FleetView

log = get_logger("rollfleet.autoscale")

REFUSAL_WINDOW_S = 30.0  # a refusal counts as demand this long after it was heard
# How long a store's answer is taken as true: a version found whole stays so for a minute (no look
# at the store each tick); one found missing is looked at again within seconds, since a flaky mount
# or a directory being moved hides a version for a moment, and a request that waits for a replica at
# it would otherwise expire while the controller believes retention deleted it.
PRESENT_RECHECK_S = 60.0
MISSING_RECHECK_S = 5.0


def store_check_due(checked: tuple[float, bool], now: float) -> bool:
    """Whether to look at the store again for a version last found ``(when, present)``."""
    when, present = checked
    return now - when > (PRESENT_RECHECK_S if present else MISSING_RECHECK_S)


def subject_loads(names: Names, jobs: dict[str, SubjectJobs]) -> dict[SubjectKey, SubjectLoad]:
    """The broker's per-subject facts keyed as the signal reads them."""
    out: dict[SubjectKey, SubjectLoad] = {}
    for subject, facts in jobs.items():
        load = SubjectLoad(pending=facts.pending, in_flight=facts.in_flight, oldest_at=facts.oldest_at)
        parsed = names.parse_job_subject(subject)
        if parsed is not None:
            out[parsed] = load
            continue
        worker_id = names.parse_replica_job_subject(subject)
        if worker_id is not None:
            out[("replica", worker_id)] = load
    return out


def replica_facts(status: ReplicaStatus, managed: bool) -> ReplicaFacts:
    return ReplicaFacts(
        worker_id=status.worker_id,
        held=status.held_version,
        active_version=status.active_version,
        preparing_version=status.preparing_version,
        state=status.state,
        capacity=status.capacity,
        in_flight=status.in_flight,
        sessions=status.sessions,
        managed=managed,
        started_at=status.started_at,
        host=status.host,
    )


def pinned_counts(pins: Iterable[tuple[int, float]], now: float) -> dict[int, int]:
    """Open pinned sessions per version: ``(pin, expires_at)`` each, expired ones left out."""
    counts: dict[int, int] = {}
    for pin, expires_at in pins:
        if expires_at >= now:
            counts[pin] = counts.get(pin, 0) + 1
    return counts


def store_has(store: Path, version: int) -> bool:
    """Whether ``store`` can still materialize ``version`` (its chain is whole): retention may
    have deleted it, or the versions its delta needs."""
    from rollfleet.policy_store.materialize import plan as plan_chain

    try:
        plan_chain(store, None, version)
    except PolicyError:
        return False
    return True


class SignalReader:
    """Holds the watchers; ``read`` gives one moment's facts."""

    def __init__(self, nc: NATS, js: JetStreamContext, names: Names, store: Path | None = None) -> None:
        self._nc, self._js, self._names, self._store = nc, js, names, store
        self.fleet = FleetView(js, names)
        self._pins: dict[str, tuple[int, float]] = {}  # session key -> (pin, expires at, on this clock)
        self._refusals: deque[tuple[float, str, int]] = deque()  # (monotonic time heard, kind, version)
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Any = None
        self._checked: dict[int, tuple[float, bool]] = {}  # version -> (when checked, in the store)
        self._commits: dict[int, tuple[float, bool]] = {}  # version -> (when read, its record says committed)
        self._policy_kv: KVBucket | None = None
        self.clock = time.monotonic  # (what the store's answers are timed by)

    async def start(self) -> SignalReader:
        await self.fleet.start()
        sessions = await self._js.key_value(self._names.sessions_bucket)
        self._tasks = [asyncio.create_task(watch_keys(sessions, ">", self._on_session, log), name="sessions-watch")]
        self._sub = await self._nc.subscribe(self._names.demand_refused_subject(), cb=self._on_refused)
        return self

    async def close(self) -> None:
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
        await stop_tasks(self._tasks)
        await self.fleet.close()

    def _on_session(self, entry: Any, live: bool = False) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self._pins.pop(entry.key, None)
            return
        try:
            record = decode(entry.value, SessionRecord, what="session record")
        except InvalidRequest:
            return
        if record.version_policy == "pinned" and record.last_version is not None:
            # (its idle time counted from when this process heard it: the writer's clock is not ours)
            self._pins[entry.key] = (record.last_version, time.time() + record.ttl_s)
        else:
            self._pins.pop(entry.key, None)

    async def _on_refused(self, msg: Msg) -> None:
        parsed = parse_bell_payload(msg.data)
        if parsed is not None:
            (kind, version), _ = parsed
            self._refusals.append((time.monotonic(), kind, version))
            if len(self._refusals) > 10_000:
                self._refusals.popleft()

    def refusals(self) -> dict[tuple[str, int], int]:
        horizon = time.monotonic() - REFUSAL_WINDOW_S
        while self._refusals and self._refusals[0][0] < horizon:
            self._refusals.popleft()
        counts: dict[tuple[str, int], int] = {}
        for _, kind, version in self._refusals:
            counts[(kind, version)] = counts.get((kind, version), 0) + 1
        return counts

    async def _unavailable(self, versions: Iterable[int]) -> set[int]:
        """Of ``versions``, those the store directory cannot materialize now (``store_check_due``:
        one found whole is looked at again after a minute, one found missing after seconds; an
        object store is not looked at: its versions count)."""
        if self._store is None:
            return set()
        gone = set()
        now = self.clock()
        for v in versions:
            checked = self._checked.get(v)
            if checked is None or store_check_due(checked, now):
                checked = (now, await asyncio.to_thread(store_has, self._store, v))
                self._checked[v] = checked
            if not checked[1]:
                gone.add(v)
        return gone

    async def read(self, managed: Iterable[str] = ()) -> tuple[Signal, list[ReplicaFacts]]:
        """One moment: the signal, and the registry's live replicas (``managed``: the ids the
        driver started; the controller adds the ones that have not registered yet, and those it
        knows by their host)."""
        jobs = await jobs_on_subjects(self._js, self._names)
        now = time.time()
        mine = set(managed)
        subjects = subject_loads(self._names, jobs)
        replicas = with_own_pending(
            [replica_facts(r, r.worker_id in mine) for r in self.fleet.replicas(live_only=True)], subjects
        )
        latest = self.fleet.latest_version
        signal = demand_signal(
            latest, subjects, replicas, now, pinned=pinned_counts(self._pins.values(), now), refusals=self.refusals()
        )
        old = [int(k) for k, d in signal.classes.items() if isinstance(k, int) and d.wanted]
        # (a version held by a replica counts too: one never committed is to be let go)
        old += [r.held for r in replicas if r.held is not None and r.held not in old]
        gone = await self._unavailable(old)
        never = await self._never_committed(old)
        if gone or never:
            signal = Signal(signal.latest, signal.classes, frozenset(gone), frozenset(never))
        return signal, replicas

    async def _never_committed(self, versions: Iterable[int]) -> set[int]:
        """Of ``versions``, those whose record in the policy KV does not say they were committed
        (``VersionRecord.committed``; no record: never published). A publisher killed between the
        record and the compare-and-set of ``latest`` leaves a whole directory that the fleet must
        never serve. Read as ``store_check_due`` says: a committed one is read again after a minute,
        one not (yet) after seconds."""
        out = set()
        now = self.clock()
        for v in versions:
            known = self._commits.get(v)
            if known is None or store_check_due(known, now):
                known = (now, await self._committed(v))
                self._commits[v] = known
            if not known[1]:
                out.add(v)
        return out

    async def _committed(self, version: int) -> bool:
        """Whether ``v.<version>`` says the version was committed (absent, unreadable: no)."""
        try:
            if self._policy_kv is None:
                self._policy_kv = await open_bucket(self._js, self._names.policy_bucket)
            entry = await self._policy_kv.get(self._names.version_key(version))
            return decode(entry.value or b"", VersionRecord, what="version record").committed
        except RollfleetError:  # (the broker's errors are ones)
            return False
