"""The rollout worker: pulls the jobs its active version can serve, runs them, answers.

One asyncio task schedules pulls (``scheduler``), one task per running job generates,
publishes the result to the client's results subject, then acks the job. A job is acked
only after its result is stored, so a worker that dies mid-job loses nothing.
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

from rollfleet import faults
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    TopologyConfig,
    ensure_job_consumer,
    ensure_topology,
    queue_depths,
)
from rollfleet.connection import connect
from rollfleet.logs import get_logger
from rollfleet.pull import PullConsumer
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Limits,
    Names,
    ReplicaStatus,
    RolloutFailure,
    RolloutJob,
    RolloutResult,
    check_job,
    decode,
    encode,
)
from rollfleet.schemas.errors import EngineFailure, Expired, Interrupted, InvalidRequest, RollfleetError
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID, check_token
from rollfleet.tasks import stop_tasks
from rollfleet.workers.engines import Engine
from rollfleet.workers.metrics import WorkerMetrics
from rollfleet.workers.registry import Registration
from rollfleet.workers.scheduler import Subject, SubjectScheduler, compatible
from rollfleet.workers.version_sync import VersionSync


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
    # Weights: follow published versions from a store (store_dir + local_dir), or serve a
    # fixed checkpoint (model_dir) at ``version``. Neither: a model-free engine such as echo.
    store_dir: Path | None = None
    local_dir: Path | None = None
    model_dir: Path | None = None
    catch_up_wait_s: float = 0.0  # how long to wait for a first commit before serving the base
    resync_s: float = 5.0
    pre_read_hook: str | None = None
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
        self.version = config.version
        self.scheduler = SubjectScheduler(config.version, aging_s=config.aging_s)
        self.log = get_logger("rollfleet.worker", worker_id=config.worker_id, namespace=config.namespace)
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.registration: Registration | None = None
        self.sync: VersionSync | None = None
        self._pullers: dict[Subject, PullConsumer] = {}
        self._hot: dict[Subject, float] = {}  # subject -> when work last came from it
        self._held: dict[int, tuple[Msg, float]] = {}  # running jobs' messages, for progress acks
        self._keepalive_task: asyncio.Task[None] | None = None
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._task_ids = itertools.count()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.jobs_done = 0
        self.outcomes: dict[str, int] = {}
        self.metrics = WorkerMetrics(config.worker_id, engine.name)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.nc = await connect(
            cfg.nats_url,
            name=f"rollfleet-worker-{cfg.worker_id}",
            reconnect_hooks=[self._on_reconnect],
            **cfg.connect_options,
        )
        self.js = self.nc.jetstream()
        await ensure_topology(self.js, self.names, cfg.topology)
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
                cfg.store_dir,
                cfg.local_dir or Path(f".rollfleet/replicas/{cfg.worker_id}"),
                worker_id=cfg.worker_id,
                on_activated=self._activated,
                resync_s=cfg.resync_s,
                pre_read_hook=cfg.pre_read_hook,
                metrics=self.metrics,
                verify_live=cfg.verify_live,
            )
            caught_up = await self.sync.catch_up(cfg.catch_up_wait_s, self.registration)
            self.version = caught_up.version
            self.scheduler.set_version(self.version)
            await self.engine.start(self.sync.local_dir, self.version)
        else:
            await self.engine.start(cfg.model_dir, self.version)
        await self.nc.subscribe(self.names.bell_wildcard, cb=self._on_bell)
        await self.registration.write(state="ready", active_version=self.version, preparing_version=None)
        if self.sync is not None:
            self.sync.start(self.registration)
        self._tasks = [
            asyncio.create_task(self._pull_loop(), name="pull-loop"),
            asyncio.create_task(self._poll_loop(), name="poll-loop"),
            asyncio.create_task(self._report_progress(), name="progress"),
        ]
        self._keepalive_task = asyncio.create_task(self._keep_alive(), name="keep-alive")
        self.log.info("worker ready", version=self.version, engine=self.engine.name, capacity=cfg.capacity)

    async def _activated(self, version: int) -> None:
        """The engine serves ``version`` now: pull its subjects from here on."""
        self.metrics.active_version.set(version)
        self.version = version
        self.scheduler.set_version(version)
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
        await self.start()
        try:
            await self._stopping.wait()
        finally:
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
        status.active_version = self.version

    # -- deciding what to pull --------------------------------------------------------------
    async def _on_bell(self, msg: Msg) -> None:
        parsed = self.names.parse_job_subject(msg.subject.replace(".bell.", ".jobs.", 1))
        if parsed is None:
            return
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

    async def _puller(self, subject: Subject) -> PullConsumer:
        puller = self._pullers.get(subject)
        if puller is None:
            assert self.js is not None and self.nc is not None
            consumer = await ensure_job_consumer(self.js, self.names, *subject, self.config.topology)
            puller = await PullConsumer(self.nc, self.names.jobs_stream, consumer, self._dispatch).start()
            puller.on_idle = self._wake.set
            self._pullers[subject] = puller
        return puller

    def _reserved(self) -> int:
        """Slots promised to open pull requests: with those running, never above capacity."""
        return sum(p.outstanding for p in self._pullers.values())

    def _hot_subjects(self, now: float) -> list[Subject]:
        """Where work is likely to arrive: this version's own subjects and recently busy ones."""
        for subject in [
            s for s, t in self._hot.items() if now - t > self.config.hot_s or not compatible(self.version, s)
        ]:
            del self._hot[subject]
        recent = sorted(self._hot, key=self._hot.__getitem__, reverse=True)[: self.config.max_waiting_pulls]
        own: list[Subject] = [("min", self.version), ("exact", self.version)]
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
                    idle = [s for s in self._hot_subjects(now) if not (await self._puller(s)).busy]
                    for i, subject in enumerate(idle[:free]):
                        batch = free // len(idle[:free]) + (1 if i < free % len(idle[:free]) else 0)
                        await (await self._puller(subject)).request(batch, wait_s=cfg.wait_pull_s)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                self.log.warning("pull failed", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), cfg.poll_s)

    async def _pull_backlog(self, free: int, now: float) -> bool:
        """Pull from the best subject with known backlog; True if that changed anything."""
        for subject in self.scheduler.order(now):
            if self._stopping.is_set() or not compatible(self.version, subject):
                return False
            puller = await self._puller(subject)
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
        task = asyncio.create_task(self._handle(msg), name=f"job-{task_id}")
        self._inflight[task_id] = task

        def done(_: asyncio.Task[None]) -> None:
            self._inflight.pop(task_id, None)
            self._wake.set()

        task.add_done_callback(done)

    # -- running one job --------------------------------------------------------------------
    async def _handle(self, msg: Msg) -> None:
        headers = msg.headers or {}
        client_id = headers.get(HDR_CLIENT_ID)
        key = headers.get(HDR_MSG_ID)
        try:
            attempt = msg.metadata.num_delivered
            stored_at = msg.metadata.timestamp.timestamp()
        except Exception:
            attempt, stored_at = 1, time.time()
        log = self.log.bind(idempotency_key=key, attempt=attempt)
        try:
            job = decode(msg.data, RolloutJob, max_bytes=self.config.limits.max_job_bytes, what="rollout job")
            check_job(job, self.config.limits)
            subject = self.names.parse_job_subject(msg.subject)
            if subject != (job.constraint.kind, job.constraint.version):
                raise InvalidRequest(f"job constraint {job.constraint} does not match its subject {msg.subject}")
            client_id, key = job.client_id, job.idempotency_key
            check_token(client_id, "client_id")
        except InvalidRequest as exc:
            log.warning("invalid job", error=exc.message)
            await self._answer_failure(msg, client_id, key, exc, attempt)
            await msg.term()
            return
        log = log.bind(job_id=job.job_id, idempotency_key=job.idempotency_key, version=self.version)
        if not job.constraint.allows(self.version):  # only after a version change raced the pull
            await msg.nak()
            return
        if time.time() > job.deadline:
            log.info("expired before it ran")
            await self._answer_failure(
                msg, client_id, key, Expired("deadline passed before a worker ran it"), attempt, job.job_id
            )
            await msg.ack()
            return
        if attempt > 1:
            if await self._result_exists(client_id, key):
                log.info("redelivered job already answered; acking")
                await msg.ack()
                return
            if job.retry_policy == "at_most_once":
                log.info("at_most_once job redelivered after its holder died")
                err = Interrupted("the worker holding this at_most_once job stopped; it was not run again")
                await self._answer_failure(msg, client_id, key, err, attempt, job.job_id)
                await msg.ack()
                return
        await self._run(msg, job, attempt, stored_at, log)

    async def _run(self, msg: Msg, job: RolloutJob, attempt: int, stored_at: float, log: Any) -> None:
        started = time.time()
        held_id = next(self._task_ids)
        self._held[held_id] = (msg, time.monotonic())
        try:
            generation = await self.engine.generate(job.job_id, job.payload)
        except RollfleetError as exc:
            log.warning("generation refused", error=exc.message, code=exc.code)
            await self._answer_failure(msg, job.client_id, job.idempotency_key, exc, attempt, job.job_id)
            await msg.ack()
            return
        except Exception as exc:
            log.exception("engine failed")
            err = EngineFailure(f"engine {self.engine.name} failed: {exc}")
            await self._answer_failure(msg, job.client_id, job.idempotency_key, err, attempt, job.job_id)
            await msg.ack()
            return
        finally:
            self._held.pop(held_id, None)
        finished = time.time()
        result = RolloutResult(
            job_id=job.job_id,
            idempotency_key=job.idempotency_key,
            client_id=job.client_id,
            outputs=generation.outputs,
            version_start=generation.version_start,
            version_end=generation.version_end,
            worker_id=self.config.worker_id,
            engine=self.engine.name,
            queue_wait_s=max(0.0, started - min(stored_at, job.submitted_at if job.submitted_at > 0 else stored_at)),
            generation_s=finished - started,
            delivery_attempt=attempt,
            finished_at=finished,
            session_id=job.session_id,
            prompt_tokens=generation.prompt_tokens,
        )
        if not await self._publish_outcome(job.client_id, job.idempotency_key, result):
            return  # not stored: leave the job unacked so it is redelivered
        faults.point("after-result-before-ack")
        await msg.ack()
        self.jobs_done += 1
        self._count("ok")
        self.metrics.queue_wait.observe(result.queue_wait_s)
        self.metrics.generation.observe(result.generation_s)
        log.debug(
            "job done",
            version_start=result.version_start,
            version_end=result.version_end,
            generation_s=round(result.generation_s, 4),
            queue_wait_s=round(result.queue_wait_s, 4),
        )

    async def _keep_alive(self) -> None:
        """In-progress acks for jobs held longer than a third of ack_wait, so a long job is not
        redelivered meanwhile. One task for all jobs: short jobs cost nothing."""
        interval = max(self.config.topology.ack_wait_s / 3.0, 0.2)
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            for msg, since in list(self._held.values()):
                if now - since >= interval:
                    with suppress(Exception):
                        await msg.in_progress()

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
                outcomes=dict(self.outcomes),
            )
            last_done, last_t = self.jobs_done, now

    async def _result_exists(self, client_id: str, key: str) -> bool:
        assert self.js is not None
        try:
            await self.js.get_last_msg(self.names.results_stream, self.names.result_subject(client_id, key))
            return True
        except nats.js.errors.NotFoundError:
            return False

    async def _publish_outcome(self, client_id: str, key: str, outcome: RolloutResult | RolloutFailure) -> bool:
        assert self.js is not None
        subject = self.names.result_subject(client_id, key)
        data = encode(outcome)
        # Short attempts, many of them: a publish sent to a stream leader that just died is never
        # answered, and the retry (deduplicated by the key) reaches the new leader sooner.
        for attempt in range(12):
            try:
                await self.js.publish(subject, data, headers={HDR_MSG_ID: key}, timeout=1.5)
                return True
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                self.log.warning("result publish failed", attempt=attempt, error=str(exc))
                await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
        return False

    async def _answer_failure(
        self,
        msg: Msg,
        client_id: str | None,
        key: str | None,
        error: RollfleetError,
        attempt: int,
        job_id: str | None = None,
    ) -> None:
        self._count(error.code)
        try:
            check_token(client_id or "", "client_id")
        except InvalidRequest:
            self.log.warning("no reply address; dropping", error=error.message)
            return
        if not key:
            self.log.warning("no idempotency key; dropping", error=error.message)
            return
        failure = RolloutFailure(
            idempotency_key=key,
            client_id=client_id,  # type: ignore[arg-type]
            code=error.code,
            message=error.message,
            retryable=error.retryable,
            job_id=job_id,
            worker_id=self.config.worker_id,
            delivery_attempt=attempt,
            finished_at=time.time(),
        )
        await self._publish_outcome(client_id, key, failure)  # type: ignore[arg-type]

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.metrics.job(outcome)


def default_worker_id() -> str:
    return f"{os.uname().nodename.split('.')[0][:40]}-{os.getpid()}".replace("_", "-")
