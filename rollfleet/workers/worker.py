"""The rollout worker process: its lifecycle.

It connects, registers, catches up with the published policy (``version_sync``), then pulls
only jobs its live version can serve, never more than its free slots (``pulling.JobPuller``
decides where its pull requests wait and what it fetches; ``scheduler`` orders the subjects).
Each pulled job runs as its own task in ``jobs.JobRunner``. SIGTERM drains: no new pulls,
running jobs finish, the registry entry is removed. The engine's health is watched locally: a
dead or hung engine makes the replica ``down`` (taking no jobs) until it is back.

Its settings are ``worker_config.WorkerConfig``'s; its parts are built from them in
``worker_parts``; the jobs it runs now are ``jobs_in_flight``'s, the engine's health
``engine_watch``'s, the core subjects that steer it ``control_subjects``'s, its registry entry's
contents ``worker_status``'s and its progress lines ``progress_report``'s. This module is the
order in which they start and stop.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import suppress
from typing import Any

from rollfleet.broker.startup import until_ready
from rollfleet.broker.types import NATS, JetStreamContext
from rollfleet.runtime.aio import cancel_until_done, stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, ReplicaStatus
from rollfleet.schemas.names import check_token
from rollfleet.workers import worker_parts as parts
from rollfleet.workers.control_subjects import ControlSubjects
from rollfleet.workers.engine_watch import EngineWatch
from rollfleet.workers.engines import Engine
from rollfleet.workers.job_puller import JobPuller
from rollfleet.workers.job_runner import JobRunner
from rollfleet.workers.jobs_in_flight import JobsInFlight
from rollfleet.workers.progress_report import Progress, report_progress
from rollfleet.workers.registry import Registration
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.version_sync import VersionSync
from rollfleet.workers.weight_swap import announce_start
from rollfleet.workers.worker_config import WorkerConfig
from rollfleet.workers.worker_metrics import WorkerMetrics
from rollfleet.workers.worker_status import refresh


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
        self._inflight = JobsInFlight(
            config.capacity,
            handle=lambda msg, info: self._runner.handle(msg, info),
            registration=lambda: self.registration,
            on_done=self._wake_puller,
        )
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.metrics = WorkerMetrics(config.worker_id, engine.name)
        self.jobs: JobRunner | None = None
        self.health = EngineWatch(
            engine,
            self.served,
            self.metrics,
            self.log,
            health_s=config.health_s,
            registration=lambda: self.registration,
            served_changed=self._served_changed,
            spawn=self._spawn,
        )

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
        self.nc, self.js = await parts.connection(self.config, self.names, on_reconnect=self._on_reconnect)

    async def _open_job_runner(self) -> None:
        """The ``JobRunner`` that runs each pulled job (it needs the claims bucket)."""
        cfg = self.config
        self.jobs = parts.job_runner(
            cfg,
            self.js,
            self.names,
            self.engine,
            self.served,
            claims=await until_ready(lambda: self.js.key_value(self.names.claims_bucket), what="claims", typed=False),
            max_payload=self.nc.max_payload,
            metrics=self.metrics,
            log=self.log,
            on_engine_down=self.engine_down,
        )

    def _open_puller(self) -> None:
        """The ``JobPuller`` that decides which jobs to pull and pulls them (not started yet)."""
        cfg = self.config
        self.pulling = parts.job_puller(
            cfg,
            self.nc,
            self.js,
            self.names,
            self.served,
            self.scheduler,
            log=self.log,
            in_flight=lambda: len(self._inflight),
            run_job=self._inflight.run,
            stopping=self._stopping,
        )

    async def _register_starting(self) -> None:
        """The registry entry, ``starting`` (the metrics endpoint served first, so it names it)."""
        cfg = self.config
        status = parts.first_status(cfg, self.engine, self.version)
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
            self.sync = parts.version_sync(
                cfg,
                self.js,
                self.names,
                self.engine,
                self.served,
                on_activated=self._activated,
                drain_exact=self._runner.drain_exact,
                metrics=self.metrics,
            )
            await self.nc.subscribe(self.names.versions_published, cb=self.sync.on_published)
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
        assert self.pulling is not None and self.nc is not None
        control = ControlSubjects(
            self.names,
            self.config.worker_id,
            pulling=self.pulling,
            jobs=self._runner,
            engine=self.engine,
            spawn=self._spawn,
        )
        await control.subscribe(self.nc)

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
            asyncio.create_task(report_progress(self.log, cfg.progress_s, self._progress), name="progress"),
            asyncio.create_task(self.health.watch(), name="engine-health"),
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
        """The engine is dead or hung: the replica takes no jobs until it is back (``EngineWatch``)."""
        self.health.down(detail)

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
        await self._inflight.drain(self.config.drain_timeout_s)
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

    def _progress(self) -> Progress:
        return Progress(self.version, self.jobs_done, len(self._inflight), self.outcomes)

    def _refresh_status(self, status: ReplicaStatus) -> None:
        self.metrics.in_flight.set(len(self._inflight))
        self.metrics.active_version.set(self.version)
        stats = self.engine.session_cache_stats()
        resumable = self.jobs.resumable if self.jobs is not None else None
        refresh(status, in_flight=len(self._inflight), jobs_done=self.jobs_done, resumable=resumable, sessions=stats)
        self.metrics.sessions.set(status.sessions)
        self.metrics.session_cache_bytes.set(stats.bytes if stats is not None else 0)

    # -- hearing about work -----------------------------------------------------------------

    @property
    def _runner(self) -> JobRunner:
        assert self.jobs is not None
        return self.jobs

    def _wake_puller(self) -> None:
        """A job ended: its slot is free again."""
        if self.pulling is not None:
            self.pulling.wake()


def default_worker_id() -> str:
    return f"{os.uname().nodename.split('.')[0][:40]}-{os.getpid()}".replace("_", "-")
