"""The rollout worker process: its lifecycle, and deciding which jobs to pull.

It connects, registers, catches up with the published policy (``version_sync``), then pulls
only jobs its live version can serve, never more than its free slots (``scheduler`` orders
the subjects). Each pulled job runs as its own task in ``jobs.JobRunner``. SIGTERM drains:
no new pulls, running jobs finish, the registry entry is removed.

Pulling costs the broker nothing while nothing happens. The worker keeps pull requests
waiting at the broker on the subjects work comes from: its version's window
(``names.listened_subjects``: ``exact-w`` and the newest ``min`` subjects up to ``w``; one slot
on each of the first ``capacity`` of them, which clients compute too, the other slots where
work came from last, moving back after ``rebalance_s`` of quiet) and subjects it served in the
last ``hot_s``, with long expiries
(``wait_pull_s``) and no server heartbeats, so a job stored there is delivered to it at once,
with no wake-up at all. Every delivery says how many jobs its consumer still holds
(``num_pending``): more behind it makes that subject known backlog, pulled at once
(``no_wait``), by priority and age. Work on a subject outside every replica's window arrives
as a bell: a core message to this replica alone (``rf.<ns>.bell.<worker_id>``), rung by a
client that chose this replica because its version can serve the subject. There is no
periodic scan: queue depths are read once at start and after a reconnect.

A subject this worker may no longer take (``served.accepts`` says no: its version moved on)
stops being pulled at once: ``release_unaccepted`` cancels its open requests (the inbox is
drained, so a job the broker sent before the cancel is still handled, and handed back if it
is not allowed). The same cancel ends requests the broker may have dropped: after a
reconnect, after a consumer leader change (a cluster fail-over), or when a client's bell says
the broker has no request of ours waiting where we think one is.
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

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollfleet.broker.connection import connect
from rollfleet.broker.pull import PullConsumer, delivery_info
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    TopologyConfig,
    bind_job_consumer,
    bind_replica_consumer,
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
    VersionPublished,
    decode,
)
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.names import check_token, listened_subjects
from rollfleet.workers.engines import Engine
from rollfleet.workers.jobs import JobRunner
from rollfleet.workers.registry import Registration
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.serving import ServedVersion, Subject
from rollfleet.workers.version_sync import VersionSync, announce_start
from rollfleet.workers.worker_metrics import WorkerMetrics


@dataclass
class WorkerConfig:
    nats_url: str
    namespace: str
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    version: int = 0
    capacity: int = 4  # jobs run at once; never more are pulled
    heartbeat_s: float = 20.0  # registry refresh; silent for 3 of these, a replica counts as gone
    aging_s: float = 5.0
    wait_pull_s: float = 240.0  # a waiting pull request's expiry at the broker (renewed when it ends)
    hot_s: float = 30.0  # a subject stays "hot" (gets waiting pulls) this long after its last job
    max_waiting_pulls: int = 6  # subjects with waiting requests at once (the version's window first)
    rebalance_s: float = 1.0  # slots idle this long on one subject may be taken back for backlog elsewhere
    standby_s: float = 240.0  # a subject whose request was refused (max_waiting reached) waits this long
    progress_s: float = 30.0  # period of the info-level progress line
    health_s: float = 2.0  # the engine's health is checked this often (locally: no broker traffic)
    drain_timeout_s: float = 120.0
    # Before an activation, exact jobs of the old version may run this long to finish; then they
    # are aborted and handed back unanswered (another replica at that version may serve them).
    exact_drain_s: float = 30.0
    # Weights: follow published versions from a store (store_dir + local_dir), or serve a
    # fixed checkpoint (model_dir) at ``version``. Neither: a model-free engine such as echo,
    # which follows committed versions only with ``follow_versions``.
    store_dir: Path | str | None = None  # a directory or an object store URL (s3://, gs://, az://)
    store_endpoint: str | None = None  # an S3-compatible endpoint for an s3:// store
    local_dir: Path | None = None
    model_dir: Path | None = None
    follow_versions: bool = False
    catch_up_wait_s: float = 0.0  # how long to wait for a first commit before serving the base
    resync_s: float = 120.0  # re-read the latest version this often (announcements can be missed)
    pre_read_hook: str | None = None
    prepare_timeout_s: float = 1800.0  # a prepare past this marks the replica degraded
    verify_live: bool = False  # announce a digest of the live weights after each activation
    # A resumable job's generation is checkpointed every this many tokens or seconds, whichever first.
    checkpoint_tokens: int = 64
    checkpoint_s: float = 2.0
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
        self._pullers: dict[Subject, PullConsumer] = {}
        self._no_consumer: dict[Subject, float] = {}  # subject -> when to look for its consumer again
        self._own: PullConsumer | None = None  # this replica's own subject (sessions' sticky turns)
        self._own_pending = False  # a bell said a job waits there
        self._hot: dict[Subject, float] = {}  # subject -> when work last came from it
        self._expired_seen: dict[Subject, int] = {}  # each puller's expiry count at the last look
        self._expired_total = 0
        self._standby: dict[Subject, float] = {}  # subject -> until when it is left to other replicas
        self._rebalance_at: float | None = None  # when parked slots may move (see _fill)
        self._refusals_seen: dict[Subject, float] = {}
        self._listen: list[Subject] = []  # _listen_subjects' last answer, and what it depended on
        self._listen_key: tuple[int, int | None, int] | None = None
        self._listen_at = 0.0
        self._tidied: list[Subject] | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.metrics = WorkerMetrics(config.worker_id, engine.name)
        self.jobs: JobRunner | None = None

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.nc = await connect(
            cfg.nats_url,
            name=f"rollfleet-worker-{cfg.worker_id}",
            reconnect_hooks=[self._on_reconnect],
            inbox_prefix=self.names.inbox_prefix("worker", cfg.worker_id),  # its deliveries are its own
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
            on_engine_down=self.engine_down,
            max_message_bytes=min(self.nc.max_payload, cfg.topology.max_msg_bytes),
            checkpoint_tokens=cfg.checkpoint_tokens,
            checkpoint_s=cfg.checkpoint_s,
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
        self.registration = Registration(self.js, self.names, status, refresh=self._refresh_status, nc=self.nc)
        await self.registration.start()
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
            caught_up = await self.sync.catch_up(cfg.catch_up_wait_s, self.registration)
            self.served.version = caught_up.version
            await self.engine.start(self.sync.local_dir if cfg.store_dir is not None else None, self.served.version)
            if cfg.verify_live:
                await announce_start(self.sync, self.served.version)
        else:
            await self.engine.start(cfg.model_dir, self.served.version)
        await self.nc.subscribe(self.names.bell_subject(cfg.worker_id), cb=self._on_bell)
        await self.nc.subscribe(self.names.cancel_subject(), cb=self._on_cancel)
        await self.nc.subscribe(self.names.consumers_declared, cb=self._on_declared)
        await self.nc.subscribe(self.names.consumer_leader_advisory(self.names.jobs_stream), cb=self._on_leader)
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
        await self._scan_once()  # backlog stored before this replica existed
        self._tasks = [
            asyncio.create_task(self._pull_loop(), name="pull-loop"),
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
        self._standby.clear()
        self.served_changed()

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
        self.served_changed()

    async def _engine_up(self) -> None:
        self.served.down = False
        self.metrics.engine_down.set(0)
        self.log.info("engine back; taking jobs again", engine=self.engine.name)
        if self.registration is not None:
            await self.registration.write(state="ready", degraded_reason=None)
        self.served_changed()

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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_reconnect(self) -> None:
        """The broker may have dropped our pull requests, bells and announcements meanwhile."""
        for puller in self._pullers.values():
            puller.reset()
        if self.sync is not None:
            self.sync.notice(None)
        if self.registration is not None:
            self._spawn(self.registration.refresh())
        self._standby.clear()
        self._no_consumer.clear()
        self._spawn(self._scan_once())
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
        # End every open request; a job the broker sent before that still runs, so nothing is
        # left unacked (an at_most_once job must not be bounced).
        for puller in self._pullers.values():
            with suppress(Exception):
                await puller.cancel()
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
        for puller in [*self._pullers.values(), *([self._own] if self._own is not None else [])]:
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
        if self.jobs is not None:
            status.resumed = self.jobs.resumed
            status.tokens_kept = self.jobs.tokens_kept
            status.tokens_regenerated = self.jobs.tokens_regenerated
        stats = self.engine.session_cache_stats()
        status.sessions = stats.entries if stats is not None else 0
        self.metrics.sessions.set(status.sessions)
        self.metrics.session_cache_bytes.set(stats.bytes if stats is not None else 0)

    # -- hearing about work -----------------------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        """A trainer cancelled a job: if it runs here, it stops and is answered with what it made."""
        self.jobs.cancel(msg.data.decode(errors="replace")[:64])

    async def _on_bell(self, msg: Msg) -> None:
        if msg.data == Names.REPLICA_BELL:  # a session's turn waits on this replica's own subject
            self._own_pending = True
            self._wake.set()
            return
        ended = Names.parse_end_session(msg.data)
        if ended is not None:
            self._spawn(self.engine.end_session(ended))
            return
        parsed = self.names.parse_bell_payload(msg.data)
        if parsed is None:
            return  # (a client's liveness probe, or noise)
        subject, stalled = parsed
        if not self.served.accepts(subject):
            return
        self._standby.pop(subject, None)  # called in: wait there again
        self._no_consumer.pop(subject, None)  # a job was stored there: its consumer exists now
        puller = self._pullers.get(subject)
        if puller is not None and puller.busy:
            if not (stalled and puller.waiting):
                return  # a request is waiting there: the job is (being) delivered to it already
            # The client saw jobs there and no request waiting at the broker: ours was lost.
            # Renewed, and the subject is known backlog from now on (not left to the next bell).
            self._spawn(self._renew(puller))
        if self.scheduler.note_pending(subject, time.monotonic()):
            self._wake.set()

    async def _on_declared(self, _: Msg) -> None:
        """The trainer declared job consumers: those found missing are looked up again."""
        if self._no_consumer:
            self._no_consumer.clear()
            self._wake.set()

    async def _on_leader(self, msg: Msg) -> None:
        """A jobs consumer has a new leader: requests held by the old one are gone."""
        consumer = msg.subject.rpartition(".")[2]
        for puller in list(self._pullers.values()):
            if puller.consumer == consumer and puller.busy:
                self._spawn(self._renew(puller))

    async def _on_published(self, msg: Msg) -> None:
        if self.sync is None:
            return
        try:
            announced = decode(msg.data, VersionPublished, what="version announcement")
        except InvalidRequest:
            self.sync.notice(None)  # unreadable: read the version from the policy KV instead
            return
        self.sync.notice(announced.record.version)

    async def _renew(self, puller: PullConsumer) -> None:
        await puller.cancel()
        self._wake.set()

    async def _scan_once(self) -> None:
        """One look at the queue depths (a JetStream API request): at start and after a
        reconnect only, never periodically."""
        assert self.js is not None
        try:
            depths = await queue_depths(self.js, self.names)
        except Exception as exc:  # broker away; bells and deliveries will tell
            self.log.debug("queue scan failed", error=str(exc))
            return
        now = time.monotonic()
        if any([self.scheduler.note_pending(subject, now) for subject in depths]):
            self._wake.set()

    # -- deciding what to pull --------------------------------------------------------------
    async def _puller(self, subject: Subject) -> PullConsumer | None:
        """The pull consumer of a subject; None while its shared consumer does not exist: the
        trainer creates it (with a commit, or with the first job there), workers only bind (see
        broker_config/auth). A missing one is looked up again after a bell for the subject, an
        activation, a reconnect or ``standby_s``: an idle replica asks the broker nothing."""
        puller = self._pullers.get(subject)
        if puller is not None and not puller.missing:
            return puller
        if time.monotonic() < self._no_consumer.get(subject, 0.0):
            return None
        assert self.js is not None and self.nc is not None
        consumer = await bind_job_consumer(self.js, self.names, *subject)
        if consumer is None:
            self._no_consumer[subject] = time.monotonic() + self.config.standby_s
            return None
        self._no_consumer.pop(subject, None)
        if puller is None:
            puller = await PullConsumer(self.nc, self.names.jobs_stream, consumer, self._dispatch).start()
            puller.on_end = self._wake.set
            self._pullers[subject] = puller
        puller.missing = False  # (set again when a request finds no consumer, 503)
        return puller

    def _free(self) -> int:
        """Slots neither running a job nor promised to an open pull request."""
        return self.config.capacity - len(self._inflight) - sum(p.outstanding for p in self._pullers.values())

    def _listen_subjects(self, now: float) -> list[Subject]:
        """Where work is likely to arrive, best first: this version's window (``exact-w`` and
        the newest ``min`` subjects, see ``listened_subjects``), then subjects that delivered
        within ``hot_s``, most recent first. Recomputed only when the version, the set of hot
        subjects or a second has passed (it runs after every finished job)."""
        cfg = self.config
        key = (self.version, self.served.activating, len(self._hot))
        if self._listen_key == key and now - self._listen_at < 1.0:
            return self._listen
        for subject in [s for s, t in self._hot.items() if now - t > cfg.hot_s or not self.served.accepts(s)]:
            del self._hot[subject]
        own = [s for s in listened_subjects(self.version) if self.served.accepts(s)]
        recent = sorted(self._hot, key=self._hot.__getitem__, reverse=True)
        self._listen = list(dict.fromkeys([*own, *recent]))[: max(cfg.max_waiting_pulls, len(own))]
        self._listen_key, self._listen_at = key, now
        return self._listen

    def served_changed(self) -> None:
        """Call after ``served`` changed what it accepts (a version moved, or ``exact-<old>``
        closed during an activation): the pull loop's next pass, at once, cancels the open
        requests of every subject it no longer accepts (``release_unaccepted``) and pulls the
        newly accepted ones (whose consumers the commit declared: looked up again)."""
        self._no_consumer.clear()
        self._wake.set()

    async def release_unaccepted(self) -> None:
        """End, now, the open requests of every subject ``served.accepts`` no longer allows (a
        job the broker sent before that is still handled: run if allowed, else handed back)."""
        for subject in [s for s in self._pullers if not self.served.accepts(s)]:
            puller = self._pullers.pop(subject)
            await puller.cancel()
            await puller.close()
            self._expired_seen.pop(subject, None)

    async def _pull_loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                await self._fill(time.monotonic())
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                self.log.warning("pull failed", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            # Event-driven; the timer only lets hot subjects cool down and overdue requests be
            # noticed, with no broker traffic. (A timer, not wait_for: this runs after every
            # finished job.)
            timeout = self.config.hot_s
            if self._rebalance_at is not None:
                timeout = max(0.0, min(timeout, self._rebalance_at - time.monotonic()))
            timer = asyncio.get_running_loop().call_later(timeout, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    def _standing_by(self, subject: Subject, puller: PullConsumer, now: float) -> bool:
        """A subject whose last waiting request the broker refused (``max_waiting`` requests of
        other replicas wait there already) is left to them until a bell for it, an activation,
        a reconnect or ``standby_s``: the broker's work per job stays bounded by ``max_waiting``,
        whatever the size of the fleet."""
        if puller.refused_at > self._refusals_seen.get(subject, -1.0):
            self._refusals_seen[subject] = puller.refused_at
            self._standby[subject] = now + self.config.standby_s
        until = self._standby.get(subject)
        if until is None:
            return False
        if now < until:
            return True
        del self._standby[subject]
        return False

    async def _fill(self, now: float) -> None:
        """Put every free slot to use: known backlog first (``no_wait`` pulls by priority and
        age), then requests that wait on the subjects work comes from."""
        cfg = self.config
        await self.release_unaccepted()
        listen = self._listen_subjects(now)
        expired = sum(p.expired for p in self._pullers.values())
        if expired != self._expired_total or listen is not self._tidied:
            self._expired_total, self._tidied = expired, listen
            await self._tidy(listen)
        self._rebalance_at = None
        # Sessions' turns for this replica come first, except before work that has waited
        # aging_s or longer elsewhere: a steady stream of turns must not starve it (the turns
        # then wait, and move to the shared subjects after their affinity wait).
        starving = self._own_pending and self.scheduler.starving(now)
        if self._own_pending and not starving:
            await self._pull_own(now)
        free = self._free()
        if self.scheduler.has_candidates():
            self._forget_drained_backlog(now)
        if self.scheduler.has_candidates():
            if free <= 0:
                free += await self._reclaim(now)
            free = await self._pull_backlog(free, now, listen)
        if starving and self._own_pending:
            await self._pull_own(now)
        if self.scheduler.has_candidates():
            return  # backlog left and no slot free: the next finished job pulls it
        if free <= 0 and not any(p.waiting for p in self._pullers.values()):
            return
        # (A subject whose last request was refused, other replicas waiting there, is left to them.)
        pullers = []
        for subject in listen:
            puller = self._pullers.get(subject)
            if puller is None or puller.missing:
                puller = await self._puller(subject)
            if puller is not None and not self._standing_by(subject, puller, now):
                pullers.append(puller)
        if not pullers:
            return
        share = self._placement(pullers, cfg.capacity, now)
        # Slots parked on a subject beyond its share come back once it has been quiet for
        # rebalance_s (a cancel: protocol only), so they wait where work is expected. (Shares
        # are of the whole capacity: a running job never moves another subject's slot.)
        for puller in list(self._pullers.values()):
            if puller.waiting and puller.outstanding > share.get(puller, 0):
                if self._quiet(puller, now):
                    await puller.cancel()
        free = self._free()
        for puller in pullers:
            want = min(share[puller] - puller.outstanding, free)
            if want > 0 and (puller.waiting or not puller.busy):
                await puller.request(want, wait_s=cfg.wait_pull_s)
                free -= want

    async def _pull_own(self, now: float) -> None:
        """Fetch what waits on this replica's own subject into free slots (taking back slots
        parked on quiet subjects if none is free). If no slot frees up, the turns wait there
        and their clients move them to the shared subjects after a bounded wait."""
        free = self._free()
        if free <= 0:
            free += await self._reclaim(now)
        if free <= 0 or self.served.down:
            return
        assert self.js is not None and self.nc is not None
        if self._own is None or self._own.missing:  # (gone after consumer_inactive_s idle: look again)
            consumer = await bind_replica_consumer(self.js, self.names, self.config.worker_id)
            if consumer is None:
                self._own_pending = False  # (the trainer creates it with the first turn)
                return
            if self._own is None:
                self._own = await PullConsumer(self.nc, self.names.jobs_stream, consumer, self._dispatch).start()
                self._own.on_end = self._wake.set
            self._own.missing = False
        if self._own.busy:
            return
        got = await self._own.fetch_now(free)
        if got < free:
            self._own_pending = False  # drained (more turns ring again)
        else:
            self._wake.set()

    def _quiet(self, puller: PullConsumer, now: float) -> bool:
        """Nothing delivered for ``rebalance_s`` (nor asked for: a new request gets its chance);
        if not yet, the pull loop wakes when it will be."""
        quiet_at = max(puller.last_delivery, puller.requested_at) + self.config.rebalance_s
        if now >= quiet_at:
            return True
        if self._rebalance_at is None or quiet_at < self._rebalance_at:
            self._rebalance_at = quiet_at
        return False

    def _forget_drained_backlog(self, now: float) -> None:
        """A subject known to have backlog whose waiting request got nothing for rebalance_s has
        none left (others took it): stop treating it as backlog."""
        for subject in self.scheduler.order(now):
            puller = self._pullers.get(subject)
            if puller is not None and puller.waiting and self._quiet(puller, now):
                self.scheduler.note_empty(subject)

    def _placement(self, pullers: list[PullConsumer], slots: int, now: float) -> dict[PullConsumer, int]:
        """Where this worker's slots should wait: one on each subject in order (the version's
        window first), the rest on the subject that delivered within ``rebalance_s``, else on
        the newest ``min`` subject (where most work comes)."""
        share = dict.fromkeys(pullers, 0)
        for puller in pullers[: max(slots, 0)]:
            share[puller] = 1
        rest = slots - min(max(slots, 0), len(pullers))
        if rest > 0:
            recent = max(pullers, key=lambda p: p.last_delivery)
            if now - recent.last_delivery > self.config.rebalance_s:
                recent = next((p for p in pullers if p.consumer.startswith("min-")), pullers[0])
            share[recent] += rest
        return share

    async def _pull_backlog(self, free: int, now: float, listen: list[Subject]) -> int:
        """Pull known backlog, best subject first; returns the slots still free."""
        cfg = self.config
        for subject in self.scheduler.order(now):
            if free <= 0 or self._stopping.is_set():
                break
            if not self.served.accepts(subject):
                continue
            puller = await self._puller(subject)
            if puller is None:  # no job was ever submitted there
                self.scheduler.note_empty(subject)
                continue
            if puller.waiting or (subject in listen and not puller.busy):
                # A waiting request takes what is queued at once, and what comes next; deliveries
                # say when the queue is empty again (num_pending 0).
                await puller.request(free, wait_s=cfg.wait_pull_s)
                self.scheduler.note_served(subject, now)
            elif not puller.busy:
                if await puller.fetch_now(free):
                    self.scheduler.note_served(subject, time.monotonic())
                elif not puller.missing:  # (a missing consumer is looked up on the next pass)
                    self.scheduler.note_empty(subject)
            free = self._free()
        return free

    async def _reclaim(self, now: float) -> int:
        """No slot free while backlog is known: take back slots promised to waiting requests on
        subjects that delivered nothing for ``rebalance_s``. Returns how many came back."""
        candidates = set(self.scheduler.order(now))
        freed = 0
        for subject, puller in list(self._pullers.items()):
            held = puller.outstanding
            if held and subject not in candidates and now - puller.last_delivery > self.config.rebalance_s:
                await puller.cancel()
                freed += held
        return freed

    async def _tidy(self, listen: list[Subject]) -> None:
        """Cancel what should not wait on: requests of subjects that cooled down (their slots
        go back to the hot ones), and overlapping requests of a subject whose older request
        just expired (renewed as one)."""
        keep = set(listen) | set(self.scheduler.order(time.monotonic()))
        for subject, puller in list(self._pullers.items()):
            expired, seen = puller.expired, self._expired_seen.get(subject, 0)
            self._expired_seen[subject] = expired
            if not puller.waiting:
                continue
            if subject not in keep or (expired != seen and puller.outstanding):
                await puller.cancel()

    def _dispatch(self, msg: Msg) -> None:
        subject = self.names.parse_job_subject(msg.subject)
        info = delivery_info(msg.reply)
        if subject is not None:
            now = time.monotonic()
            self._hot[subject] = now
            if info is not None and info[2] > 0:  # more queued behind it: backlog to pull now
                if self.scheduler.note_pending(subject, now):
                    self._wake.set()
            elif info is not None:
                self.scheduler.note_empty(subject)
        assert self.jobs is not None
        task = asyncio.create_task(self.jobs.handle(msg, info))
        self._inflight.add(task)
        task.add_done_callback(self._job_done)
        if len(self._inflight) == 1 and self.registration is not None:
            self.registration.note_busy_changed()  # turned busy: `status` shows it within a second

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._wake.set()
        if not self._inflight and self.registration is not None:
            self.registration.note_busy_changed()  # idle again

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
