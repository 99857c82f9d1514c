"""The rollout worker process: its lifecycle.

It connects, registers, catches up with the published policy (``version_sync``), then pulls
only jobs its live version can serve, never more than its free slots (``pulling.JobPuller``
decides where its pull requests wait and what it fetches; ``scheduler`` orders the subjects).
Each pulled job runs as its own task in ``jobs.JobRunner``. SIGTERM drains: no new pulls,
running jobs finish, the registry entry is removed. The engine's health is watched locally: a
dead or hung engine makes the replica ``down`` (taking no jobs) until it is back.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.broker.connection import connect, logs_in
from rollfleet.broker.startup import until_ready
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    WORKER_DECLARE_BARE_AFTER_S,
    TopologyConfig,
    wait_for_topology,
)
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.runtime.aio import cancel_until_done, stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Limits,
    Names,
    ReplicaStatus,
    VersionPublished,
    decode,
)
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.names import check_token
from rollfleet.workers.engines import Engine
from rollfleet.workers.job_puller import JobPuller
from rollfleet.workers.job_runner import JobRunner
from rollfleet.workers.registry import Registration
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.version_sync import VersionSync
from rollfleet.workers.weight_swap import announce_start
from rollfleet.workers.worker_metrics import WorkerMetrics
from rollfleet.workers.worker_settings import worker_default


@dataclass
class WorkerConfig:
    nats_url: str
    namespace: str
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    version: int = 0
    # Every default below that is a number or a switch comes from the one table of worker settings
    # (``worker_settings.py``: what each means, its ``rollfleet worker`` flag), written nowhere else.
    capacity: int = worker_default("capacity")
    heartbeat_s: float = worker_default("heartbeat_s")
    aging_s: float = worker_default("aging_s")
    wait_pull_s: float = worker_default("wait_pull_s")
    hot_s: float = worker_default("hot_s")
    max_waiting_pulls: int = worker_default("max_waiting_pulls")
    rebalance_s: float = worker_default("rebalance_s")
    standby_s: float = worker_default("standby_s")
    progress_s: float = worker_default("progress_s")
    health_s: float = worker_default("health_s")
    drain_timeout_s: float = worker_default("drain_timeout_s")
    exact_drain_s: float = worker_default("exact_drain_s")
    # Weights: follow published versions from a store (store_dir + local_dir), or serve a
    # fixed checkpoint (model_dir) at ``version``. Neither: a model-free engine such as echo,
    # which follows committed versions only with ``follow_versions``.
    store_dir: Path | str | None = None  # a directory or an object store URL (s3://, gs://, az://)
    store_endpoint: str | None = None  # an S3-compatible endpoint for an s3:// store
    local_dir: Path | None = None
    model_dir: Path | None = None
    follow_versions: bool = worker_default("follow_versions")
    catch_up_wait_s: float = worker_default("catch_up_wait_s")
    resync_s: float = worker_default("resync_s")
    pre_read_hook: str | None = None
    prepare_timeout_s: float = worker_default("prepare_timeout_s")
    verify_live: bool = worker_default("verify_live")
    checkpoint_tokens: int = worker_default("checkpoint_tokens")
    checkpoint_s: float = worker_default("checkpoint_s")
    hold_version: int | None = None  # serve this version of the store and no other (see VersionSync)
    metrics_port: int | None = None  # Prometheus endpoint; 0 picks a free port
    limits: Limits = DEFAULT_LIMITS
    topology: TopologyConfig = DEFAULT_TOPOLOGY
    connect_options: dict[str, Any] = field(default_factory=dict)


class Worker:
    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        check_token(config.worker_id, "worker_id")
        self.config = config
        self.engine = engine
        self.names = Names(config.namespace)
        self.served = ServedVersion(config.version)  # routing, the registry and version sync read it
        self.scheduler = SubjectScheduler(self.served, aging_s=config.aging_s)
        self.log = get_logger("rollfleet.worker", worker_id=config.worker_id, namespace=config.namespace)
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.registration: Registration | None = None
        self.sync: VersionSync | None = None
        self.pulling: JobPuller | None = None  # which jobs to pull, and pulling them (job_puller.py)
        self._keepalive_task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.metrics = WorkerMetrics(config.worker_id, engine.name)
        self.jobs: JobRunner | None = None

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the replica, in this order (each phase below awaits the one before it): connect and
        wait for the namespace, open the job runner and the puller, register as ``starting``, catch
        up and start the engine, subscribe to the fleet's control subjects, register as ready, then
        take the backlog and start the loops."""
        await self._connect()
        await self._open_job_runner()
        self._open_puller()
        await self._register_starting()
        await self._catch_up_and_start_engine()
        await self._subscribe_control()
        await self._register_ready()
        await self._start_loops()

    async def _connect(self) -> None:
        """Connect to the broker and wait until the namespace is declared."""
        cfg = self.config
        self.nc = await connect(
            cfg.nats_url,
            name=f"rollfleet-worker-{cfg.worker_id}",
            reconnect_hooks=[self._on_reconnect],
            inbox_prefix=self.names.inbox_prefix("worker", cfg.worker_id),  # its deliveries are its own
            **cfg.connect_options,
        )
        self.js = self.nc.jetstream()
        # (a trainer declares the namespace: a worker started while it is missing waits for it, and
        # one started while the broker is not ready, a cluster electing, tries again; so does each
        # broker read of the start below, should the broker stall meanwhile)
        bare_after_s = WORKER_DECLARE_BARE_AFTER_S if logs_in(cfg.nats_url, cfg.connect_options) else 0.0
        await until_ready(
            lambda: wait_for_topology(self.js, self.names, cfg.topology, bare_after_s=bare_after_s), what="namespace"
        )

    async def _open_job_runner(self) -> None:
        """The ``JobRunner`` that runs each pulled job (it needs the claims bucket)."""
        cfg = self.config
        self.jobs = JobRunner(
            self.js,
            self.names,
            self.engine,
            worker_id=cfg.worker_id,
            limits=cfg.limits,
            ack_wait_s=cfg.topology.ack_wait_s,
            metrics=self.metrics,
            log=self.log,
            served=self.served,
            claims=await until_ready(lambda: self.js.key_value(self.names.claims_bucket), what="claims", typed=False),
            on_engine_down=self.engine_down,
            max_message_bytes=min(self.nc.max_payload, cfg.topology.max_msg_bytes),
            checkpoint_tokens=cfg.checkpoint_tokens,
            checkpoint_s=cfg.checkpoint_s,
        )

    def _open_puller(self) -> None:
        """The ``JobPuller`` that decides which jobs to pull and pulls them (not started yet)."""
        cfg = self.config
        self.pulling = JobPuller(
            self.nc,
            self.js,
            self.names,
            self.served,
            self.scheduler,
            worker_id=cfg.worker_id,
            capacity=cfg.capacity,
            wait_pull_s=cfg.wait_pull_s,
            hot_s=cfg.hot_s,
            max_waiting_pulls=cfg.max_waiting_pulls,
            rebalance_s=cfg.rebalance_s,
            standby_s=cfg.standby_s,
            log=self.log,
            in_flight=lambda: len(self._inflight),
            run_job=self._run_job,
            stopping=self._stopping,
        )

    async def _register_starting(self) -> None:
        """The registry entry, ``starting`` (the metrics endpoint served first, so it names it)."""
        cfg = self.config
        now = time.time()
        status = ReplicaStatus(
            worker_id=cfg.worker_id,
            state="starting",
            active_version=self.version,
            engine=self.engine.name,
            capacity=cfg.capacity,
            in_flight=0,
            heartbeat_at=now,
            heartbeat_interval_s=cfg.heartbeat_s,
            started_at=now,
            held_version=cfg.hold_version
            if cfg.hold_version is not None
            else None
            if cfg.store_dir is not None or cfg.follow_versions
            else cfg.version,
        )
        if cfg.metrics_port is not None:
            port = self.metrics.serve(cfg.metrics_port)
            status.metrics_url = f"http://{os.uname().nodename}:{port}/metrics"
        self.registration = Registration(self.js, self.names, status, refresh=self._refresh_status, nc=self.nc)
        await until_ready(self.registration.start, what="registry", typed=False)

    async def _catch_up_and_start_engine(self) -> None:
        """Start the engine: on the version caught up with where it follows versions (``VersionSync``),
        else on its fixed checkpoint."""
        cfg = self.config
        if cfg.store_dir is not None or cfg.follow_versions:
            # A new or restarted replica catches up before it registers as ready.
            self.sync = VersionSync(
                self.js,
                self.names,
                self.engine,
                self.served,
                cfg.store_dir,
                cfg.local_dir or Path(f".rollfleet/replicas/{cfg.worker_id}"),
                worker_id=cfg.worker_id,
                on_activated=self._activated,
                drain_exact=self.jobs.drain_exact,
                exact_drain_s=cfg.exact_drain_s,
                resync_s=cfg.resync_s,
                pre_read_hook=cfg.pre_read_hook,
                metrics=self.metrics,
                verify_live=cfg.verify_live,
                prepare_timeout_s=cfg.prepare_timeout_s,
                hold_version=cfg.hold_version,
                store_endpoint=cfg.store_endpoint,
            )
            await self.nc.subscribe(self.names.versions_published, cb=self._on_published)
            sync = self.sync
            caught_up = await until_ready(
                lambda: sync.catch_up(cfg.catch_up_wait_s, self.registration), what="policy", typed=False
            )
            self.served.version = caught_up.version
            await self.engine.start(self.sync.local_dir if cfg.store_dir is not None else None, self.served.version)
            if cfg.verify_live:
                await announce_start(self.js, self.names, self.engine, cfg.worker_id, self.served.version)
        else:
            await self.engine.start(cfg.model_dir, self.served.version)

    async def _subscribe_control(self) -> None:
        """The core subjects that steer this replica: its bell, cancels, consumers declared, leader moves."""
        cfg = self.config
        await self.nc.subscribe(self.names.bell_subject(cfg.worker_id), cb=self._on_bell)
        await self.nc.subscribe(self.names.cancel_subject(), cb=self._on_cancel)
        await self.nc.subscribe(self.names.consumers_declared, cb=self._on_declared)
        await self.nc.subscribe(self.names.consumer_leader_advisory(self.names.jobs_stream), cb=self._on_leader)

    async def _register_ready(self) -> None:
        """The registry entry, ``ready`` (or ``degraded``, saying why), and version sync's loop started."""
        # Started on an older version than the latest commit (it could not be served): say so and why.
        reason = self.sync.start_degraded if self.sync is not None else None
        await self.registration.write(
            state="degraded" if reason else "ready",
            active_version=self.version,
            preparing_version=None,
            degraded_reason=reason,
        )
        if self.sync is not None:
            self.sync.start(self.registration)

    async def _start_loops(self) -> None:
        """Take the backlog stored before this replica existed, then start pulling, progress
        reports, the engine's health watch and the running jobs' keep-alive."""
        cfg = self.config
        await self.pulling.scan_once()  # backlog stored before this replica existed
        self._tasks = [
            asyncio.create_task(self.pulling.run(), name="pull-loop"),
            asyncio.create_task(self._report_progress(), name="progress"),
            asyncio.create_task(self._watch_engine(), name="engine-health"),
        ]
        self._keepalive_task = asyncio.create_task(self.jobs.keep_alive(), name="keep-alive")
        self.log.info("worker ready", version=self.version, engine=self.engine.name, capacity=cfg.capacity)

    @property
    def version(self) -> int:
        """The version this worker serves and advertises (``served`` owns it)."""
        return self.served.version

    @property
    def jobs_done(self) -> int:
        return self.jobs.jobs_done if self.jobs is not None else 0

    @property
    def outcomes(self) -> dict[str, int]:
        return dict(self.jobs.outcomes) if self.jobs is not None else {}

    def _activated(self) -> None:
        """A version was activated and announced: stop pulling what it no longer allows, pull
        its subjects from here on."""
        self.metrics.active_version.set(self.version)
        if self.pulling is not None:
            self.pulling.activated()

    # -- the engine's health ------------------------------------------------------------------
    def engine_down(self, detail: str) -> None:
        """The engine is dead or hung: take no more jobs (the pull loop cancels every request),
        say so in one line and in the registry (``down``, with the reason), until it is back."""
        if self.served.down:
            return
        self.served.down = True
        self.log.error("engine down; taking no jobs until it is back", engine=self.engine.name, reason=detail)
        self.metrics.engine_down.set(1)
        if self.registration is not None:
            reason = f"engine {self.engine.name} down: {detail}"
            self._spawn(self.registration.write(state="down", degraded_reason=reason))
        self._served_changed()

    async def _engine_up(self) -> None:
        self.served.down = False
        self.metrics.engine_down.set(0)
        self.log.info("engine back; taking jobs again", engine=self.engine.name)
        if self.registration is not None:
            await self.registration.write(state="ready", degraded_reason=None)
        self._served_changed()

    async def _watch_engine(self) -> None:
        """Check the engine's health every ``health_s`` (a local call: an HTTP engine asks its
        server, the others look at themselves); a failed generation says so at once too."""
        while True:
            await asyncio.sleep(self.config.health_s)
            try:
                bound = max(self.engine.health_timeout_s + 1.0, 2 * self.config.health_s)
                health = await asyncio.wait_for(self.engine.health(), bound)
                ok, detail = health.ok, health.detail
            except Exception as exc:  # a hung check is a hung engine
                ok, detail = False, f"health check failed: {exc!r}"
            if not ok:
                self.engine_down(detail)
            elif self.served.down:
                await self._engine_up()

    def _served_changed(self) -> None:
        if self.pulling is not None:
            self.pulling.served_changed()

    async def release_unaccepted(self) -> None:
        if self.pulling is not None:
            await self.pulling.release_unaccepted()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_reconnect(self) -> None:
        """The broker may have dropped our pull requests, bells and announcements meanwhile."""
        if self.pulling is not None:
            self.pulling.reconnected()
        if self.sync is not None:
            self.sync.notice(None)
        if self.registration is not None:
            self._spawn(self.registration.refresh())

    def request_stop(self) -> None:
        """Drain: no new pulls; running jobs finish; then ``run`` returns."""
        self._stopping.set()
        if self.pulling is not None:
            self.pulling.wake()

    async def run(self) -> None:
        """Start, serve until asked to stop, then drain. A stop asked for while still starting
        (connecting, catching up with the policy) ends the start at once."""
        starting = asyncio.create_task(self.start(), name="start")
        stop_asked = asyncio.create_task(self._stopping.wait(), name="stop-asked")
        try:
            await asyncio.wait({starting, stop_asked}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                self.log.info("stop asked while starting; not starting")
                await cancel_until_done(starting, timeout=10.0)
            else:
                starting.result()  # a failed start raises here
                await self._stopping.wait()
        finally:
            stop_asked.cancel()
            await self.stop()

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopping.set()
        if self.pulling is not None:
            self.pulling.wake()
        self.log.info("draining", in_flight=len(self._inflight))
        if self.registration is not None:
            await self.registration.write(state="draining")
        if self.sync is not None:
            await self.sync.stop()
        await stop_tasks(self._tasks)
        # End every open request; a job the broker sent before that still runs, so nothing is
        # left unacked (an at_most_once job must not be bounced).
        if self.pulling is not None:
            await self.pulling.cancel_all()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.wait(list(self._inflight), timeout=0.1)
        for task in list(self._inflight):  # past the drain time-out: redelivered elsewhere
            task.cancel()
        if self._keepalive_task is not None:  # only now: draining jobs still need progress acks
            await stop_tasks([self._keepalive_task])
        await stop_tasks(list(self._background))
        if self.registration is not None:
            await self.registration.stop()
        if self.pulling is not None:
            await self.pulling.stop_background()
            await self.pulling.close()
        await self.engine.close()
        self.metrics.close()
        if self.nc is not None:
            with suppress(Exception):
                await self.nc.flush(timeout=2)
            with suppress(Exception):
                await self.nc.close()
        self._stopped.set()
        self.log.info("stopped", jobs_done=self.jobs_done)

    def _refresh_status(self, status: ReplicaStatus) -> None:
        self.metrics.in_flight.set(len(self._inflight))
        self.metrics.active_version.set(self.version)
        status.in_flight = len(self._inflight)
        status.jobs_done = self.jobs_done
        if self.jobs is not None:
            status.resumed = self.jobs.resumable.resumed
            status.tokens_kept = self.jobs.resumable.tokens_kept
            status.tokens_regenerated = self.jobs.resumable.tokens_regenerated
        stats = self.engine.session_cache_stats()
        status.sessions = stats.entries if stats is not None else 0
        self.metrics.sessions.set(status.sessions)
        self.metrics.session_cache_bytes.set(stats.bytes if stats is not None else 0)

    # -- hearing about work -----------------------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        """A trainer cancelled a job: if it runs here, it stops and is answered with what it made."""
        self.jobs.cancel(msg.data.decode(errors="replace")[:64])

    async def _on_bell(self, msg: Msg) -> None:
        assert self.pulling is not None
        if msg.data == Names.REPLICA_BELL:  # a session's turn waits on this replica's own subject
            self.pulling.own_pending()
            return
        ended = Names.parse_end_session(msg.data)
        if ended is not None:
            self._spawn(self.engine.end_session(ended))
            return
        parsed = self.names.parse_bell_payload(msg.data)
        if parsed is None:
            return  # (a client's liveness probe, or noise)
        subject, stalled = parsed
        self.pulling.bell(subject, stalled, waited_s=Names.bell_waited_s(msg.headers))

    async def _on_declared(self, _: Msg) -> None:
        if self.pulling is not None:
            self.pulling.declared()

    async def _on_leader(self, msg: Msg) -> None:
        if self.pulling is not None:
            self.pulling.leader_changed(msg.subject.rpartition(".")[2])

    async def _on_published(self, msg: Msg) -> None:
        if self.sync is None:
            return
        try:
            announced = decode(msg.data, VersionPublished, what="version announcement")
        except InvalidRequest:
            self.sync.notice(None)  # unreadable: read the version from the policy KV instead
            return
        self.sync.notice(announced.record.version)

    def _run_job(self, msg: Msg, info: tuple[int, float, int] | None) -> None:
        """A delivered job runs as its own task; its slot is free again when it ends."""
        assert self.jobs is not None
        task = asyncio.create_task(self.jobs.handle(msg, info))
        self._inflight.add(task)
        task.add_done_callback(self._job_done)
        # Turned busy, or full: `status` shows it within a second, and clients ring the bells of
        # replicas with a free slot first (``FleetView.bell_target``).
        if len(self._inflight) in (1, self.config.capacity) and self.registration is not None:
            self.registration.note_busy_changed()

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if self.pulling is not None:
            self.pulling.wake()
        if len(self._inflight) in (0, self.config.capacity - 1) and self.registration is not None:
            self.registration.note_busy_changed()  # idle again, or a slot free again

    async def _report_progress(self) -> None:
        """An info line per interval for operators (per-job lines are at debug level)."""
        last_done, last_t = self.jobs_done, time.monotonic()
        while True:
            await asyncio.sleep(self.config.progress_s)
            now = time.monotonic()
            done = self.jobs_done - last_done
            if done or self._inflight:
                self.log.info(
                    "progress",
                    version=self.version,
                    jobs_done=self.jobs_done,
                    jobs_per_s=round(done / (now - last_t), 2),
                    in_flight=len(self._inflight),
                    outcomes=self.outcomes,
                )
            last_done, last_t = self.jobs_done, now


def default_worker_id() -> str:
    return f"{os.uname().nodename.split('.')[0][:40]}-{os.getpid()}".replace("_", "-")
