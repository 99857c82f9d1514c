"""The rollout worker process: its lifecycle, and deciding which jobs to pull.

It connects, registers, catches up with the published policy (``version_sync``), then pulls
only jobs its live version can serve, never more than its free slots (``scheduler`` orders
the subjects). Each pulled job runs as its own task in ``jobs.JobRunner``. SIGTERM drains:
no new pulls, running jobs finish, the registry entry is removed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollfleet.broker.connection import connect
from rollfleet.broker.pull import PullConsumer
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    TopologyConfig,
    bind_job_consumer,
    ensure_topology,
    queue_depths,
)
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Limits,
    Names,
    ReplicaStatus,
)
from rollfleet.schemas.names import check_token
from rollfleet.workers.engines import Engine
from rollfleet.workers.jobs import JobRunner
from rollfleet.workers.metrics import WorkerMetrics
from rollfleet.workers.registry import Registration
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.serving import ServedVersion, Subject
from rollfleet.workers.version_sync import VersionSync

_NO_CONSUMER_RECHECK_S = 5.0  # a bell for the subject rechecks at once


@dataclass
class WorkerConfig:
    nats_url: str
    namespace: str
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    version: int = 0
    capacity: int = 4  # jobs run at once; never more are pulled
    heartbeat_s: float = 2.0
    poll_s: float = 1.0  # backstop scan of queue depths (bells can be missed during a reconnect)
    aging_s: float = 5.0
    wait_pull_s: float = 1.0  # an idle worker's pull requests wait this long at the broker
    hot_s: float = 30.0  # a subject stays "hot" (gets waiting pulls) this long after its last job
    max_waiting_pulls: int = 4
    progress_s: float = 30.0  # period of the info-level progress line
    drain_timeout_s: float = 120.0
    # Before an activation, exact jobs of the old version may run this long to finish; then they
    # are aborted and handed back unanswered (another replica at that version may serve them).
    exact_drain_s: float = 30.0
    # Weights: follow published versions from a store (store_dir + local_dir), or serve a
    # fixed checkpoint (model_dir) at ``version``. Neither: a model-free engine such as echo.
    store_dir: Path | None = None
    local_dir: Path | None = None
    model_dir: Path | None = None
    catch_up_wait_s: float = 0.0  # how long to wait for a first commit before serving the base
    resync_s: float = 5.0
    pre_read_hook: str | None = None
    prepare_timeout_s: float = 1800.0  # a prepare past this marks the replica degraded
    verify_live: bool = False  # announce a digest of the live weights after each activation
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
        self._pullers: dict[Subject, PullConsumer] = {}
        self._no_consumer: dict[Subject, float] = {}  # subject -> when to look for its consumer again
        self._hot: dict[Subject, float] = {}  # subject -> when work last came from it
        self._keepalive_task: asyncio.Task[None] | None = None
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._task_ids = itertools.count()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics = WorkerMetrics(config.worker_id, engine.name)
        self.jobs: JobRunner | None = None

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.nc = await connect(
            cfg.nats_url,
            name=f"rollfleet-worker-{cfg.worker_id}",
            reconnect_hooks=[self._on_reconnect],
            inbox_prefix=self.names.inbox_prefix("worker"),
            **cfg.connect_options,
        )
        self.js = self.nc.jetstream()
        await ensure_topology(self.js, self.names, cfg.topology)
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
            claims=await self.js.key_value(self.names.claims_bucket),
            max_message_bytes=min(self.nc.max_payload, cfg.topology.max_msg_bytes),
        )
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
        )
        if cfg.metrics_port is not None:
            port = self.metrics.serve(cfg.metrics_port)
            status.metrics_url = f"http://{os.uname().nodename}:{port}/metrics"
        self.registration = Registration(self.js, self.names, status, refresh=self._refresh_status)
        await self.registration.start()
        if cfg.store_dir is not None:
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
            )
            caught_up = await self.sync.catch_up(cfg.catch_up_wait_s, self.registration)
            self.served.version = caught_up.version
            await self.engine.start(self.sync.local_dir, self.served.version)
        else:
            await self.engine.start(cfg.model_dir, self.served.version)
        await self.nc.subscribe(self.names.bell_wildcard, cb=self._on_bell)
        await self.registration.write(state="ready", active_version=self.version, preparing_version=None)
        if self.sync is not None:
            self.sync.start(self.registration)
        self._tasks = [
            asyncio.create_task(self._pull_loop(), name="pull-loop"),
            asyncio.create_task(self._poll_loop(), name="poll-loop"),
            asyncio.create_task(self._report_progress(), name="progress"),
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
        """A version was activated and announced: pull its subjects from here on."""
        self.metrics.active_version.set(self.version)
        self._wake.set()

    def _on_reconnect(self) -> None:
        for puller in self._pullers.values():
            puller.reset()
        self._wake.set()

    def request_stop(self) -> None:
        """Drain: no new pulls; running jobs finish; then ``run`` returns."""
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        """Start, serve until asked to stop, then drain. A stop asked for while still starting
        (connecting, catching up with the policy) ends the start at once."""
        starting = asyncio.create_task(self.start(), name="start")
        stop_asked = asyncio.create_task(self._stopping.wait(), name="stop-asked")
        try:
            await asyncio.wait({starting, stop_asked}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                self.log.info("stop asked while starting; not starting")
                await stop_tasks([starting], timeout=10.0)
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
        self._wake.set()
        self.log.info("draining", in_flight=len(self._inflight))
        if self.registration is not None:
            await self.registration.write(state="draining")
        if self.sync is not None:
            await self.sync.stop()
        await stop_tasks(self._tasks)
        # Requests still open at the broker may hand us jobs for up to wait_pull_s more: run
        # those too, so nothing is left unacked (an at_most_once job must not be bounced).
        deadline = time.monotonic() + self.config.drain_timeout_s
        while (self._inflight or any(p.busy for p in self._pullers.values())) and time.monotonic() < deadline:
            if self._inflight:
                await asyncio.wait(list(self._inflight.values()), timeout=0.1)
            else:
                await asyncio.sleep(0.05)
        for task in list(self._inflight.values()):  # past the drain time-out: redelivered elsewhere
            task.cancel()
        if self._keepalive_task is not None:  # only now: draining jobs still need progress acks
            await stop_tasks([self._keepalive_task])
        if self.registration is not None:
            await self.registration.stop()
        for puller in self._pullers.values():
            await puller.close()
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

    # -- deciding what to pull --------------------------------------------------------------
    async def _on_bell(self, msg: Msg) -> None:
        parsed = self.names.parse_bell_subject(msg.subject)
        if parsed is None:
            return
        self._no_consumer.pop(parsed, None)  # a job was stored there: its consumer exists now
        puller = self._pullers.get(parsed)
        if puller is not None and puller.busy:
            return  # a request is waiting there: the job is (being) delivered to it already
        if self.scheduler.note_pending(parsed, time.monotonic()):
            self._wake.set()

    async def _poll_loop(self) -> None:
        assert self.js is not None
        while not self._stopping.is_set():
            try:
                depths = await queue_depths(self.js, self.names)
            except Exception as exc:  # broker away; keep trying
                self.log.debug("queue scan failed", error=str(exc))
                depths = {}
            now = time.monotonic()
            if any(self.scheduler.note_pending(subject, now) for subject in depths):
                self._wake.set()
            await asyncio.sleep(self.config.poll_s)

    async def _puller(self, subject: Subject) -> PullConsumer | None:
        """The pull consumer of a subject; None while its shared consumer does not exist (the
        trainer creates it with the first job there; workers may not, see broker_config/auth)."""
        puller = self._pullers.get(subject)
        if puller is None:
            assert self.js is not None and self.nc is not None
            if time.monotonic() < self._no_consumer.get(subject, 0.0):
                return None
            consumer = await bind_job_consumer(self.js, self.names, *subject)
            if consumer is None:
                self._no_consumer[subject] = time.monotonic() + _NO_CONSUMER_RECHECK_S
                return None
            puller = await PullConsumer(self.nc, self.names.jobs_stream, consumer, self._dispatch).start()
            puller.on_idle = self._wake.set
            self._pullers[subject] = puller
        return puller

    def _reserved(self) -> int:
        """Slots promised to open pull requests: with those running, never above capacity."""
        return sum(p.outstanding for p in self._pullers.values())

    def _hot_subjects(self, now: float) -> list[Subject]:
        """Where work is likely to arrive: this version's own subjects and recently busy ones."""
        for subject in [s for s, t in self._hot.items() if now - t > self.config.hot_s or not self.served.accepts(s)]:
            del self._hot[subject]
        recent = sorted(self._hot, key=self._hot.__getitem__, reverse=True)[: self.config.max_waiting_pulls]
        own: list[Subject] = [s for s in (("min", self.version), ("exact", self.version)) if self.served.accepts(s)]
        return list(dict.fromkeys([*recent, *own]))[: max(self.config.max_waiting_pulls, 1)]

    async def _pull_loop(self) -> None:
        """Two regimes. With known backlog, pull at once (no_wait) from the best subject first.
        Otherwise keep requests waiting at the broker on the hot subjects, so a new job is
        delivered the moment it is stored, split so their batches fit the free slots."""
        cfg = self.config
        while not self._stopping.is_set():
            self._wake.clear()
            now = time.monotonic()
            free = cfg.capacity - len(self._inflight) - self._reserved()
            try:
                if free > 0 and await self._pull_backlog(free, now):
                    continue
                free = cfg.capacity - len(self._inflight) - self._reserved()
                if free > 0 and not self.scheduler.has_candidates():
                    pullers = [p for s in self._hot_subjects(now) if (p := await self._puller(s)) is not None]
                    idle = [p for p in pullers if not p.busy][:free]
                    for i, puller in enumerate(idle):
                        batch = free // len(idle) + (1 if i < free % len(idle) else 0)
                        await puller.request(batch, wait_s=cfg.wait_pull_s)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                self.log.warning("pull failed", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), cfg.poll_s)

    async def _pull_backlog(self, free: int, now: float) -> bool:
        """Pull from the best subject with known backlog; True if that changed anything."""
        for subject in self.scheduler.order(now):
            if self._stopping.is_set() or not self.served.accepts(subject):
                return False
            puller = await self._puller(subject)
            if puller is None:  # no job was ever submitted there
                self.scheduler.note_empty(subject)
                continue
            if puller.busy:  # a waiting request there already takes whatever arrives
                continue
            before = puller.delivered
            await puller.request(free)
            await puller.wait_idle(timeout=5.0)
            if puller.delivered == before:
                self.scheduler.note_empty(subject)
                continue
            self.scheduler.note_served(subject, time.monotonic())
            return True
        return False

    def _dispatch(self, msg: Msg) -> None:
        subject = self.names.parse_job_subject(msg.subject)
        if subject is not None:
            self._hot[subject] = time.monotonic()
        task_id = next(self._task_ids)
        assert self.jobs is not None
        task = asyncio.create_task(self.jobs.handle(msg), name=f"job-{task_id}")
        self._inflight[task_id] = task

        def done(_: asyncio.Task[None]) -> None:
            self._inflight.pop(task_id, None)
            self._wake.set()

        task.add_done_callback(done)

    async def _report_progress(self) -> None:
        """An info line per interval for operators (per-job lines are at debug level)."""
        last_done, last_t = self.jobs_done, time.monotonic()
        while True:
            await asyncio.sleep(self.config.progress_s)
            now = time.monotonic()
            done = self.jobs_done - last_done
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
