"""Declare the streams, KV buckets and consumers of one namespace, idempotently.

Whoever connects first (``rollfleet broker``, a worker, a client) declares what is
missing; what exists is left as it is, so a second declaration changes and loses nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from rollfleet.broker.errors import is_stream_name_in_use
from rollfleet.runtime.backoff import Backoff
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import ConstraintKind, Names
from rollfleet.schemas.errors import ServiceUnavailable

log = get_logger("rollfleet.broker.topology")


class TopologyConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Broker-side settings of a namespace. Sized for a fleet, not left at server defaults."""

    replicas: int = 1  # R3 on a 3-node cluster
    duplicate_window_s: float = 600.0  # resubmitting a key within this window makes no second job
    ack_wait_s: float = 30.0  # a silent holder loses its job after this; long jobs send progress acks
    max_deliver: int = 10
    results_max_age_s: float = 24 * 3600.0
    events_max_age_s: float = 24 * 3600.0
    max_msg_bytes: int = 4 * 1024 * 1024
    jobs_max_bytes: int = 1024**3  # reserved per namespace on the broker's file store
    # Per jobs consumer: how many jobs may be held unacked across the fleet (the sum of the
    # capacities of the replicas serving it, with headroom), and how many pull requests may
    # wait. The broker's work per delivered job grows with the requests waiting on its consumer,
    # so this bounds it whatever the fleet size: past it, replicas stand by (a refused request
    # is not renewed until a bell calls them in; clients ring when jobs wait unpulled).
    fleet_slots: int = 4096
    max_waiting: int = 128
    consumer_inactive_s: float = 6 * 3600.0  # idle per-version consumers are cleaned up
    fleet_entry_ttl_s: float = 3600.0  # the registry forgets a replica entry untouched this long
    session_record_ttl_s: float = 24 * 3600.0  # session records untouched this long are removed
    # A claim is refreshed while its job runs and removed once the job is answered; this bounds
    # how long one left by a dead holder is kept. An at_most_once job's time-out may not exceed
    # it (the client refuses one that does), so a job redelivered after the claim is gone is
    # past its deadline and answered Expired, never run a second time.
    claims_ttl_s: float = 24 * 3600.0
    # A resumable job's progress records; a finished job's are rolled up into one small done
    # record at once, so this bounds only what jobs that never finish leave behind.
    progress_max_age_s: float = 24 * 3600.0
    policy_history: int = 1

    def job_consumer_config(self, names: Names, kind: ConstraintKind, version: int) -> ConsumerConfig:
        return self._jobs_consumer(names.job_consumer(kind, version), names.job_subject(kind, version))

    def replica_consumer_config(self, names: Names, worker_id: str) -> ConsumerConfig:
        """One replica's own jobs subject (sessions' sticky turns); removed when idle."""
        return self._jobs_consumer(names.replica_consumer(worker_id), names.replica_job_subject(worker_id))

    def _jobs_consumer(self, name: str, subject: str) -> ConsumerConfig:
        return ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            max_ack_pending=self.fleet_slots,
            max_waiting=self.max_waiting,
            inactive_threshold=self.consumer_inactive_s,
            num_replicas=self.replicas if self.replicas > 1 else None,
        )

    def results_consumer_config(self, names: Names, client_id: str, instance: str | None = None) -> ConsumerConfig:
        """The results consumer of a client id; with ``instance`` (a shared client id), one of
        that process's own: every instance sees every answer from its start on (a key answered
        before is looked up in the stream), and the broker removes it soon after the process."""
        name = names.results_consumer(client_id, instance)
        return ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=names.results_filter(client_id),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL if instance is None else DeliverPolicy.NEW,
            ack_wait=60.0,
            max_ack_pending=65_536,
            max_waiting=64,
            inactive_threshold=self.results_max_age_s if instance is None else SHARED_INSTANCE_GONE_S,
            num_replicas=self.replicas if self.replicas > 1 else None,
        )


DEFAULT_TOPOLOGY = TopologyConfig()
# A shared client id's instance consumer is removed by the broker this long after its process
# stopped asking (its answers are in the stream; nothing is lost with it).
SHARED_INSTANCE_GONE_S = 300.0


class _MaxDeliveries(msgspec.Struct):
    stream_seq: int


def given_up_seq(advisory: bytes) -> int | None:
    """The stream sequence of the message a consumer gave up on (delivered ``max_deliver`` times),
    from the broker's advisory (``Names.max_deliveries_advisory``); None if it does not say."""
    try:
        return msgspec.json.decode(advisory, type=_MaxDeliveries).stream_seq
    except (msgspec.DecodeError, RecursionError):
        return None


def _stream_configs(names: Names, cfg: TopologyConfig) -> list[StreamConfig]:
    def stream(name: str, subject: str, **settings: Any) -> StreamConfig:
        return StreamConfig(
            name=name, subjects=[subject], storage=StorageType.FILE, num_replicas=cfg.replicas, **settings
        )

    return [
        stream(
            names.jobs_stream,
            names.jobs_wildcard,
            retention=RetentionPolicy.WORK_QUEUE,
            duplicate_window=cfg.duplicate_window_s,
            max_msg_size=cfg.max_msg_bytes,
            max_bytes=cfg.jobs_max_bytes,
            allow_direct=True,
        ),
        stream(
            names.results_stream,
            names.results_wildcard,
            retention=RetentionPolicy.LIMITS,
            duplicate_window=cfg.duplicate_window_s,
            max_age=cfg.results_max_age_s,
            max_msg_size=cfg.max_msg_bytes,
            allow_direct=True,
        ),
        stream(
            names.events_stream,
            names.events_wildcard,
            retention=RetentionPolicy.LIMITS,
            max_age=cfg.events_max_age_s,
            max_msgs=100_000,
        ),
        stream(
            names.progress_stream,
            names.progress_wildcard,
            retention=RetentionPolicy.LIMITS,
            max_age=cfg.progress_max_age_s,
            max_msg_size=cfg.max_msg_bytes,
            duplicate_window=120.0,  # a checkpoint's retried publish is stored once (Nats-Msg-Id)
            allow_rollup_hdrs=True,  # a finished job's records roll up into one done record
            allow_direct=True,  # a resuming worker reads the records with direct gets
        ),
    ]


def _bucket_configs(names: Names, cfg: TopologyConfig) -> list[KeyValueConfig]:
    return [
        KeyValueConfig(
            bucket=names.policy_bucket,
            history=cfg.policy_history,
            storage=StorageType.FILE,
            replicas=cfg.replicas,
            direct=True,  # reads of `latest` (catch-up, resync) are direct gets, not JetStream API requests
        ),
        KeyValueConfig(
            bucket=names.claims_bucket,
            history=1,
            ttl=cfg.claims_ttl_s,  # (see TopologyConfig.claims_ttl_s)
            storage=StorageType.FILE,
            replicas=cfg.replicas,
            direct=True,  # claims are read on every turn and at_most_once job: direct gets
        ),
        KeyValueConfig(
            bucket=names.sessions_bucket,
            history=1,
            ttl=cfg.session_record_ttl_s,  # a backstop: a session's own ttl is in its record
            storage=StorageType.FILE,
            replicas=cfg.replicas,
        ),
        KeyValueConfig(
            bucket=names.fleet_bucket,
            history=1,
            ttl=cfg.fleet_entry_ttl_s,
            storage=StorageType.FILE,
            replicas=cfg.replicas,
        ),
    ]


async def ensure_topology(js: JetStreamContext, names: Names, cfg: TopologyConfig = DEFAULT_TOPOLOGY) -> list[str]:
    """Create what is missing; return the names created (empty on a second run)."""
    created: list[str] = []
    try:
        for scfg in _stream_configs(names, cfg):
            try:
                await js.stream_info(scfg.name)  # type: ignore[arg-type]
            except nats.js.errors.NotFoundError:
                try:
                    await js.add_stream(scfg)
                    created.append(scfg.name or "")
                except nats.js.errors.BadRequestError as exc:  # a racing declarer won
                    if not is_stream_name_in_use(exc):
                        raise
        for kcfg in _bucket_configs(names, cfg):
            try:
                await js.key_value(kcfg.bucket)
            except nats.js.errors.BucketNotFoundError:
                await js.create_key_value(kcfg)
                created.append(kcfg.bucket)
    except nats.errors.Error as exc:
        raise ServiceUnavailable(f"cannot declare the topology of namespace {names.namespace!r}: {exc}") from exc
    return created


# A worker that finds part of its namespace missing (lost with the broker's store) waits this long
# for a trainer to declare it again before it tries itself: under the generated permissions a
# worker may not declare (the broker refuses and logs a violation), and a trainer's client
# declares what was lost within a second or two of noticing.
WORKER_DECLARE_AFTER_S = 30.0
# All of it missing is a bare broker where the worker came first, or a broker that lost its whole
# store (a wipe): a worker that logs in as a user (the generated permissions) waits this long for
# a trainer before it tries, so a wipe costs no refused declaration; an anonymous one (a bare
# local broker) declares at once.
WORKER_DECLARE_BARE_AFTER_S = 5.0

TopologyStep = Literal["ready", "declare", "wait"]


def topology_step(
    missing: int, total: int, waited_s: float, tried: bool, declare_after_s: float, bare_after_s: float = 0.0
) -> TopologyStep:
    """A starting worker's next step: ``ready`` when nothing is missing; ``declare`` (once) when
    all of it has been missing for ``bare_after_s`` (a bare broker where the worker came first,
    or a wiped one no trainer has declared again yet) or part of it for ``declare_after_s``;
    else ``wait`` for a trainer."""
    if missing == 0:
        return "ready"
    bare = missing == total and waited_s >= bare_after_s
    if not tried and (bare or waited_s >= declare_after_s):
        return "declare"
    return "wait"


async def wait_for_topology(
    js: JetStreamContext,
    names: Names,
    cfg: TopologyConfig = DEFAULT_TOPOLOGY,
    *,
    declare_after_s: float = WORKER_DECLARE_AFTER_S,
    bare_after_s: float = 0.0,
    poll_s: float = 0.2,
) -> None:
    """A worker's start: the namespace's streams and buckets exist (``topology_step``). A worker
    refused the declaration (it may not, under the generated permissions) waits for a trainer
    (``rollfleet declare``, or a trainer's client) instead of exiting."""
    t0 = time.monotonic()
    tried = said = False
    while True:
        try:
            times = await stream_creation_times(js, names)
        except nats.errors.Error as exc:
            raise ServiceUnavailable(f"cannot read the topology of namespace {names.namespace!r}: {exc}") from exc
        missing = [name for name, created in times.items() if created is None]
        step = topology_step(len(missing), len(times), time.monotonic() - t0, tried, declare_after_s, bare_after_s)
        if step == "ready":
            return
        if step == "declare":
            tried = True
            try:
                await ensure_topology(js, names, cfg)
                continue
            except ServiceUnavailable as exc:
                log.warning("could not declare the namespace; waiting for a trainer to", error=str(exc))
        elif not said:
            log.info("waiting for a trainer to declare the namespace again", missing=missing)
            said = True
        await asyncio.sleep(poll_s)


async def stream_creation_times(js: JetStreamContext, names: Names) -> dict[str, str | None]:
    """Each stream and bucket of the namespace -> when it was created (None: missing)."""
    out: dict[str, str | None] = {}
    for name in topology_streams(names):
        try:
            info = await js.stream_info(name)
            out[name] = str(info.created)
        except nats.js.errors.NotFoundError:
            out[name] = None
    return out


async def ensure_job_consumer(
    js: JetStreamContext, names: Names, kind: ConstraintKind, version: int, cfg: TopologyConfig = DEFAULT_TOPOLOGY
) -> str:
    """The shared durable pull consumer of one jobs subject (created on first use)."""
    await declare_job_consumer(js, names, kind, version, cfg)
    return names.job_consumer(kind, version)


async def declare_job_consumer(
    js: JetStreamContext, names: Names, kind: ConstraintKind, version: int, cfg: TopologyConfig = DEFAULT_TOPOLOGY
) -> bool:
    """Create the shared consumer of a jobs subject if missing; True if this call created it."""
    return await _declare_consumer(js, names.jobs_stream, cfg.job_consumer_config(names, kind, version))


async def declare_replica_consumer(
    js: JetStreamContext, names: Names, worker_id: str, cfg: TopologyConfig = DEFAULT_TOPOLOGY
) -> bool:
    """Create one replica's own consumer if missing (the trainer does; the replica binds)."""
    return await _declare_consumer(js, names.jobs_stream, cfg.replica_consumer_config(names, worker_id))


async def _declare_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> bool:
    try:
        await js.consumer_info(stream, config.durable_name or "")
    except nats.js.errors.NotFoundError:
        await js.add_consumer(stream, config)
        return True
    return False


async def bind_job_consumer(js: JetStreamContext, names: Names, kind: ConstraintKind, version: int) -> str | None:
    """The shared consumer of a jobs subject if it exists, else None (workers bind; only the
    trainer, which stores the jobs, creates them)."""
    return await _bind(js, names.jobs_stream, names.job_consumer(kind, version))


async def bind_replica_consumer(js: JetStreamContext, names: Names, worker_id: str) -> str | None:
    """A replica's own consumer if it exists (the trainer creates it with the first turn sent there)."""
    return await _bind(js, names.jobs_stream, names.replica_consumer(worker_id))


async def _bind(js: JetStreamContext, stream: str, name: str) -> str | None:
    try:
        await js.consumer_info(stream, name)
    except nats.js.errors.NotFoundError:
        return None
    return name


async def ensure_results_consumer(
    js: JetStreamContext,
    names: Names,
    client_id: str,
    cfg: TopologyConfig = DEFAULT_TOPOLOGY,
    instance: str | None = None,
) -> str:
    await declare_results_consumer(js, names, client_id, cfg, instance)
    return names.results_consumer(client_id, instance)


async def declare_results_consumer(
    js: JetStreamContext,
    names: Names,
    client_id: str,
    cfg: TopologyConfig = DEFAULT_TOPOLOGY,
    instance: str | None = None,
) -> bool:
    """Declare the results consumer of a client id (or of one instance of a shared id) if the
    broker lacks it; True when it had to be created. A shared instance's consumer starts at new
    answers, so one created again has missed whatever was stored while it was missing."""
    name = names.results_consumer(client_id, instance)
    try:
        await js.consumer_info(names.results_stream, name)
    except nats.js.errors.NotFoundError:
        await js.add_consumer(names.results_stream, cfg.results_consumer_config(names, client_id, instance))
        return True
    return False


async def queue_depths(js: JetStreamContext, names: Names) -> dict[tuple[ConstraintKind, int], int]:
    """Jobs waiting (stored, not yet acknowledged) per jobs subject."""
    info = await js.stream_info(names.jobs_stream, subjects_filter=names.jobs_wildcard)
    depths: dict[tuple[ConstraintKind, int], int] = {}
    for subject, count in (info.state.subjects or {}).items():
        parsed = names.parse_job_subject(subject)
        if parsed is not None and count:
            depths[parsed] = int(count)
    return depths


# -- declaring again what the broker lost ------------------------------------------------------------

# A process that declares the namespace (a trainer's client, a gateway) looks whether its streams
# and buckets still exist when the broker says one was deleted (``Names.stream_deleted_advisory``)
# and after every reconnect (a broker restarted on an empty or older store): never on a timer, so
# an idle trainer costs the broker nothing. A look the broker did not answer is tried again after
# a second, until one is answered (a reconnect pokes it at once anyway).
TOPOLOGY_RETRY = Backoff.fixed(1.0)


def topology_check_due(last_checked: float | None, poked: bool) -> bool:
    """Whether to look at the namespace's streams and buckets now: the first time, and at once
    when poked (a reconnect, a deletion advisory); never on a timer."""
    return poked or last_checked is None


def renewed_streams(before: dict[str, str | None], now: dict[str, str | None]) -> list[str]:
    """The streams (KV buckets are streams too) that are not the ones seen before: missing now, or
    created at another time (deleted and declared again, by this process or any other). What lived
    in them is gone, and each process restores its own part (``on_declared``)."""
    return sorted(name for name, created in now.items() if created is None or before.get(name, created) != created)


def topology_streams(names: Names) -> list[str]:
    """The stream name of every stream and KV bucket of the namespace."""
    cfg = DEFAULT_TOPOLOGY
    streams = [s.name or "" for s in _stream_configs(names, cfg)]
    return streams + [f"KV_{b.bucket}" for b in _bucket_configs(names, cfg)]


class TopologyKeeper:
    """Keeps the namespace declared: looks when ``poke``d (a reconnect, the broker's advisory that a
    stream of the namespace was deleted) at each stream and bucket, declares what is missing, and
    calls ``on_declared``
    with the streams that were lost (missing, or declared again since the last look, by anyone;
    after a reconnect, all of them: a store rolled back keeps the streams but loses their last
    writes), so the process restores what it keeps in them (its results consumer, its keys)."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        cfg: TopologyConfig = DEFAULT_TOPOLOGY,
        *,
        on_declared: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> None:
        self._js, self._names, self._cfg = js, names, cfg
        self._on_declared = on_declared
        self._poked = asyncio.Event()
        self._seen: dict[str, str | None] = {}  # stream -> its creation time, as last looked at
        self._unrestored: set[str] = set()  # lost, and on_declared not yet through for them
        self._failures = 0  # retries since the last look the broker answered (the retry's attempt)
        self.redeclared: list[tuple[float, list[str]]] = []  # (wall time, streams lost): for tests and logs

    def poke(self) -> None:
        self._poked.set()

    def _retry_later(self) -> None:
        asyncio.get_running_loop().call_later(TOPOLOGY_RETRY.delay_s(self._failures), self._poked.set)
        self._failures += 1

    async def _look(self) -> dict[str, str | None]:
        return await stream_creation_times(self._js, self._names)

    async def run(self) -> None:
        last: float | None = None
        while True:
            if last is not None:
                await self._poked.wait()
            poked = self._poked.is_set()
            self._poked.clear()
            if not topology_check_due(last, poked):
                continue
            first, last = last is None, time.monotonic()
            try:
                seen = await self._look()
                lost = renewed_streams(self._seen, seen) if not first else []
                if any(created is None for created in seen.values()):
                    await ensure_topology(self._js, self._names, self._cfg)
                    seen = await self._look()
            except (ServiceUnavailable, nats.errors.Error, nats.js.errors.Error, OSError):
                self._retry_later()  # the broker is away: look again shortly (a reconnect pokes too)
                continue
            self._failures = 0
            self._seen = seen
            if lost:
                self.redeclared.append((time.time(), lost))
                log.warning("namespace declared again: the broker had lost part of it", lost=lost)
            self._unrestored |= set(lost) | (set(seen) if poked and not first else set())
            if not self._unrestored or self._on_declared is None:
                continue
            try:
                await self._on_declared(sorted(self._unrestored))
                self._unrestored.clear()
            except (ServiceUnavailable, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                # (kept: the next look restores them again, even if nothing more was lost)
                log.warning("restoring after a lost namespace failed; trying again", error=str(exc))
                self._retry_later()
