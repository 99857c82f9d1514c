"""RolloutClient: what a training loop imports to submit version-constrained rollouts.

``submit`` stores a job on ``jobs.min.<v>`` / ``jobs.exact.<v>`` (deduplicated by its
idempotency key) and returns a handle; results arrive on this client's durable results
consumer, so a restarted trainer with the same ``client_id`` still receives them.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from rollfleet.broker.buckets import KVBucket, open_bucket
from rollfleet.broker.connection import connect
from rollfleet.broker.errors import typed_errors
from rollfleet.broker.retry_call import call_retrying
from rollfleet.broker.startup import not_ready
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    TopologyConfig,
    TopologyKeeper,
    ensure_results_consumer,
    ensure_topology,
    given_up_seq,
    topology_streams,
)
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.runtime.aio import stop_tasks, wait_event
from rollfleet.runtime.logs import debug_enabled, get_logger
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Limits,
    Names,
    Outcome,
    ReplicaStatus,
    RetryPolicy,
    RolloutPayload,
    RolloutResult,
    VersionConstraint,
    VersionPolicy,
    VersionRecord,
    check_token,
    claim_key,
)
from rollfleet.schemas.asked import AskedConstraint
from rollfleet.schemas.errors import (
    BrokerError,
    Cancelled,
    ClientIdInUse,
    NoCompatibleReplica,
    RollfleetError,
    ServiceUnavailable,
)
from rollfleet.schemas.progress import TokenChunk
from rollfleet.schemas.replay_rules import ReplayOutcome
from rollfleet.trainer_client import answers, cancelling, replaying
from rollfleet.trainer_client.answer_settling import Settler, check_same_request, conflict
from rollfleet.trainer_client.bells import Bells
from rollfleet.trainer_client.cancelling import CancelOutcome
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.consumers import JobConsumers
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.inbox import ResultsInbox
from rollfleet.trainer_client.job_watch import JobWatch
from rollfleet.trainer_client.lease import ClientLease
from rollfleet.trainer_client.own_job_ids import JobIds
from rollfleet.trainer_client.placement import PUBLISH_BUDGET_S, JobPlacement
from rollfleet.trainer_client.refusals import RefusalNotes
from rollfleet.trainer_client.requests import asked_of, build_job
from rollfleet.trainer_client.restore import restore_namespace
from rollfleet.trainer_client.sessions import OpenSession, Session
from rollfleet.trainer_client.streaming import stream_tokens
from rollfleet.trainer_client.versions import adopt_version, commit_version

log = get_logger("rollfleet.client")
_DEBUG = debug_enabled(log)  # (fixed with the logger: the per-job debug line's fields are built only then)


class RolloutClient:
    def __init__(
        self,
        nc: NATS,
        names: Names,
        client_id: str,
        *,
        topology: TopologyConfig = DEFAULT_TOPOLOGY,
        limits: Limits = DEFAULT_LIMITS,
        default_timeout_s: float = 600.0,
        deadline_grace_s: float = 2.0,
        fail_fast: bool = True,
        shared: bool = False,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.names = names
        self.client_id = check_token(client_id, "client_id")
        self.topology = topology
        self.limits = limits
        self.default_timeout_s = default_timeout_s
        self.fleet = FleetView(self.js, names)
        self.metrics = ClientMetrics(self.client_id)
        self._lease = ClientLease(nc, self.js, names, self.client_id)
        # A shared client id (gateways behind one load balancer): every live process with the id
        # submits as it (one job id per key, so a key retried through any of them is one job) and
        # reads every answer through a results consumer of its own; no lease.
        self.shared = shared
        self._instance = self._lease.instance if shared else None
        self._handles: dict[str, RolloutHandle] = {}
        self._cancel_handle = self._cancel  # one bound method for every handle, not one each
        # Each handle's one cancel (``cancelling.next_cancel``), kept while the handle lives.
        self._cancels: weakref.WeakKeyDictionary[RolloutHandle, asyncio.Future[CancelOutcome]] = (
            weakref.WeakKeyDictionary()
        )
        self.settler = Settler(self.js, names, self.client_id, self._handles, self.metrics, lambda: self.latest_version)
        settle = self.settler.settle
        self.inbox = ResultsInbox(
            nc,
            self.js,
            names,
            self._handles,
            lambda h, o: settle(h, o, issued=True),
            shared=shared,
            noticed=lambda h: self._spawn(self._settle_noticed(h)),
        )
        self._started = False
        self._closed = False
        self._expiry_task: asyncio.Task[None] | None = None
        self._stall_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Until then, a key given explicitly is looked up among the stored answers before its job
        # is stored (see _answered_before).
        self._recheck_until = time.monotonic() + topology.duplicate_window_s
        self.bells = Bells(nc, names, self.fleet, self._spawn)
        self.refusals = RefusalNotes(nc, names)  # (what the fleet's control loop hears of refusals)
        self.consumers = JobConsumers(self.js, nc, names, topology, ring=lambda c: self.bells.ring(c, fresh=True))
        self._sessions_bucket: KVBucket | None = None
        self.keeper: TopologyKeeper | None = None  # declares again what the broker lost (restore.py)
        self.placement = self._job_placement()
        self.sessions: dict[str, OpenSession] = {}  # open sessions of this client, by id
        self.watch = self._job_watch(deadline_grace_s, fail_fast)

    def _job_placement(self) -> JobPlacement:
        """Where this client's jobs are stored, and stored again after a broker lost them."""
        return JobPlacement(
            self.client_id,
            self.js,
            self.nc,
            self.names,
            self.fleet,
            self.metrics,
            declare_shared=self.consumers.shared,
            declare_replica=self.consumers.replica_again,
            ring=lambda constraint: self.bells.ring(constraint, fresh=True),
            forget=lambda key: self._handles.pop(key, None) and None,
            settle_stored=self.settler.settle_stored,
            duplicate_window_s=self.topology.duplicate_window_s,
        )

    def _job_watch(self, deadline_grace_s: float, fail_fast: bool) -> JobWatch:
        """What watches this client's unanswered jobs: deadlines, stalls, replicas gone."""
        return JobWatch(
            self._handles,
            self.fleet,
            self.placement,
            self.js,
            self.names,
            deadline_grace_s=deadline_grace_s,
            fail_fast=fail_fast,
            sessions=lambda: self.sessions,
            spawn=self._spawn,
            withdraw=self._withdraw,
            settle_stored=self.settler.settle_stored,
            no_replica_message=self._no_replica_message,
            redeclare=self.consumers.shared_again,
            ring=self.bells.ring,
            note_demand=self.refusals.note,
        )

    @property
    def deadline_grace_s(self) -> float:
        """How long past a job's deadline its answer is still waited for before ``Expired``."""
        return self.watch.deadline_grace_s

    @deadline_grace_s.setter
    def deadline_grace_s(self, seconds: float) -> None:
        self.watch.deadline_grace_s = seconds

    @property
    def fail_fast(self) -> bool:
        """Whether an exact job no replica can serve any more is answered ``NoCompatibleReplica``."""
        return self.watch.fail_fast

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        namespace: str,
        client_id: str,
        topology: TopologyConfig = DEFAULT_TOPOLOGY,
        limits: Limits = DEFAULT_LIMITS,
        default_timeout_s: float = 600.0,
        fail_fast: bool = True,
        shared: bool = False,
        **connect_options: Any,
    ) -> RolloutClient:
        """Connect, declare the namespace if needed, and start receiving results.

        ``shared``: any number of live processes may use ``client_id`` at once (a gateway behind a
        load balancer): a key retried through any of them is the one job, answered once, and each
        receives every answer of the id (its own handles take theirs). Without it, one live client
        holds the id (``ClientIdInUse`` for a second)."""
        check_token(client_id, "client_id")
        hooks: list[Callable[[], None]] = []
        names = Names(namespace)
        nc = await connect(
            url,
            name=f"rollfleet-client-{client_id}",
            reconnect_hooks=hooks,
            inbox_prefix=names.inbox_prefix("trainer"),
            **connect_options,
        )
        client = cls(
            nc,
            names,
            client_id,
            topology=topology,
            limits=limits,
            default_timeout_s=default_timeout_s,
            fail_fast=fail_fast,
            shared=shared,
        )
        hooks.append(client._on_reconnect)
        try:
            await client._start()
        except BaseException as exc:
            await client._abandon()
            typed = not_ready(exc, "the client's start")
            if typed is not None:  # (a stalled broker: typed, retryable; the gateway tries again)
                raise typed from exc
            raise
        return client

    async def _abandon(self) -> None:
        """A start that failed part-way: stop what it started and close the connection. Its tasks
        would otherwise live on, on a closed connection, beside the next attempt's."""
        self._closed = True
        await self._stop_tasks()
        await self.fleet.close()
        with suppress(Exception):
            await self.nc.close()

    async def _stop_tasks(self) -> None:
        """Stop receiving answers and every task the start began (those it got to)."""
        await self.inbox.stop()
        watches = [t for t in (self._expiry_task, self._stall_task) if t is not None]
        await stop_tasks([*watches, *self._background])

    async def _start(self) -> None:
        await ensure_topology(self.js, self.names, self.topology)
        if not self.shared:
            await self._lease.acquire()  # one live client per client_id, or ClientIdInUse
        self._ids = self.settler.ids = await JobIds.load(await self.sessions_kv(), self.client_id)
        self._results_consumer = await ensure_results_consumer(
            self.js, self.names, self.client_id, self.topology, self._instance
        )
        await self.fleet.start()
        # A bell rung at a replica that is gone comes back as "no responders" on this inbox.
        await self.bells.start()
        self.placement.probe_reply = self.bells.probe_reply
        advisory = self.names.consumer_leader_advisory(self.names.results_stream)
        await self.nc.subscribe(advisory, cb=self._on_results_leader)
        await self.nc.subscribe(self.names.max_deliveries_advisory(self.names.jobs_stream), cb=self._on_given_up)
        self.inbox.start(self._results_consumer, self._ids)
        self._started = True
        self._expiry_task = asyncio.create_task(self.watch.deadlines(), name="deadlines")
        self._stall_task = asyncio.create_task(self.watch.stalls(), name="stalls")
        self._spawn(self.consumers.follow(self.fleet))
        self.keeper = TopologyKeeper(
            self.js, self.names, self.topology, on_declared=lambda created: restore_namespace(self, created)
        )
        self._spawn(self.keeper.run())
        for stream in topology_streams(self.names):  # (looked at again only when one is deleted)
            await self.nc.subscribe(self.names.stream_deleted_advisory(stream), cb=self._on_stream_deleted)

    async def _on_stream_deleted(self, _: Msg) -> None:
        if self.keeper is not None:
            self.keeper.poke()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            await self._stop_tasks()
        await self.fleet.close()
        if self.shared:
            with suppress(Exception):  # (else the broker removes it once idle)
                await self.js.delete_consumer(self.names.results_stream, self._results_consumer)
        else:
            await self._lease.release()
        for handle in self._handles.values():
            handle.set_error(ServiceUnavailable("client closed before the result arrived"))
        # flush + close rather than drain: drain waits on the watchers' push subscriptions.
        with suppress(Exception):
            await self.nc.flush(timeout=2)
        with suppress(Exception):
            await self.nc.close()

    # -- submitting -------------------------------------------------------------------------
    @property
    def latest_version(self) -> int | None:
        return self.fleet.latest_version

    async def submit(
        self,
        payload: RolloutPayload,
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_staleness: int | None = None,
        constraint: AskedConstraint | None = None,
        idempotency_key: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        retry_policy: RetryPolicy = "replayable",
        session_id: str | None = None,
        wait_for_replica: bool = False,
    ) -> RolloutHandle:
        """Queue one rollout job and return its handle.

        Exactly one of ``min_version``, ``exact_version`` or ``max_staleness`` (meaning
        ``min_version = latest - max_staleness``) says which policy versions may serve it, or
        ``constraint``, the same built once (``AskedConstraint``, as the HTTP endpoint does).
        Resubmitting an ``idempotency_key`` yields the same answer, from whichever process and
        whenever, while the results stream keeps it, and never runs it again (within the duplicate
        window it makes no second job; after it, the copy stored is found answered by the replica
        that pulls it); the same key for a different request is ``IdempotencyConflict``
        (a request is what the caller wrote: ``max_staleness=1`` is the same request after a
        commit moved ``latest``). Arguments of the wrong type or value are ``InvalidRequest``,
        raised here. A job no replica can serve is answered ``NoCompatibleReplica`` at once; with
        ``wait_for_replica`` it is queued instead and waits within its deadline for one to be
        started (the fleet's control loop hears it and starts a replica held at its version).
        """
        asked = asked_of(constraint, min_version, exact_version, max_staleness)
        return await self._submit(
            payload,
            asked.resolve(self.latest_version),
            written=asked.written,
            idempotency_key=idempotency_key,
            deadline=deadline,
            timeout=timeout,
            retry_policy=retry_policy,
            session_id=session_id,
            wait_for_replica=wait_for_replica,
        )

    async def _submit(
        self,
        payload: RolloutPayload,
        constraint: VersionConstraint,
        *,
        written: str,
        idempotency_key: str | None,
        deadline: float | None,
        timeout: float | None,
        retry_policy: RetryPolicy,
        session_id: str | None,
        replica: str | None = None,
        asked_at: float | None = None,
        wait_for_replica: bool = False,
    ) -> RolloutHandle:
        """``submit`` with the constraint resolved; ``replica``: store the job on that replica's own
        subject (a session's sticky turn) instead of the constraint's shared one; ``asked_at``: when
        the caller asked (its ``timeout`` counts from then)."""
        job, data = build_job(
            payload,
            client_id=self.client_id,
            constraint=constraint,
            written=written,
            idempotency_key=idempotency_key,
            deadline=deadline,
            timeout=timeout,
            default_timeout_s=self.default_timeout_s,
            retry_policy=retry_policy,
            session_id=session_id,
            trainer_version=self.latest_version,
            limits=self.limits,
            max_timeout_s=self.topology.claims_ttl_s,
            job_id=self._ids.issue(idempotency_key if isinstance(idempotency_key, str) else None),
            asked_at=asked_at,
        )
        key = job.idempotency_key
        existing = self._handles.get(key)
        if existing is not None:
            check_same_request(existing.job, job.fingerprint)
            existing.waits_for_replica = existing.waits_for_replica or wait_for_replica
            return existing
        if self.placement.withdrawn.conflicts(key, job.fingerprint, time.monotonic()):
            raise conflict(key)  # (its job was withdrawn; the key stays its request's)
        key_given = idempotency_key is not None
        handle = RolloutHandle(job, data, self._cancel_handle)
        # The caller's choice, whatever the fleet holds now: a replica at the version that could
        # serve the job at submit may move on before it does, and the job then waits all the same.
        handle.waits_for_replica = wait_for_replica
        if self._settle_unclaimed(handle):
            return handle  # the answer came before we asked again (trainer restart)
        if idempotency_key is not None and await self._answered_before(handle):
            return handle
        until = min(handle.job.deadline, time.time() + PUBLISH_BUDGET_S)  # (as storing it waits)
        if self.fail_fast and replica is None and await self._settled_unservable(handle, until, keyed=key_given):
            return handle
        self._handles[key] = handle
        # An answer that came while the look-ups above awaited went to the unclaimed ones.
        if self._settle_unclaimed(handle):
            self._handles.pop(key, None)
            return handle
        if replica is None:
            subject = self.names.job_subject(constraint.kind, constraint.version)
        else:
            subject = self.names.replica_job_subject(replica)
        try:
            fresh = await self._declare_consumer(constraint, replica, until)
            ack = await self.placement.store(handle, subject, key)
        except RollfleetError:
            self._handles.pop(key, None)
            raise
        except asyncio.CancelledError:
            self._left_while_storing(handle, subject, replica, keyed=key_given)
            raise
        await self._stored(handle, subject, replica, ack, fresh=fresh)
        return handle

    async def _stored(self, handle: RolloutHandle, subject: str, replica: str | None, ack: Any, *, fresh: bool) -> None:
        """The broker stored the handle's job (``ack``; a duplicate: another handle's, of this
        key, adopted unless it is settled): ring the replicas that may take it."""
        handle.stored = True
        if not ack.duplicate:
            handle.subject, handle.stream_seq, handle.replica = subject, ack.seq, replica
        elif not await self._adopt(handle, ack.seq):
            return  # settled: answered before, or the key answers another request
        if handle.replica is None:
            self.bells.ring(handle.job.constraint, fresh=replica is None and fresh)
        else:
            self.bells.ring_replica(handle.replica)
        if _DEBUG:
            log.debug(
                "submitted",
                idempotency_key=handle.idempotency_key,
                constraint=str(handle.job.constraint),
                duplicate=bool(ack.duplicate),
            )

    async def _settled_unservable(self, handle: RolloutHandle, until: float, *, keyed: bool) -> bool:
        """Whether a job no replica will serve is settled here rather than stored: an answer
        already stored for its key (resubmitting is always safe), or ``NoCompatibleReplica``
        unless it waits for a replica (then queued: JobWatch keeps it, and says its demand again)."""
        constraint = handle.job.constraint
        if self.fleet.will_serve(constraint):
            return False
        try:  # the view may lag a replica that just registered
            await call_retrying(self.fleet.refresh, until=until, what="read the fleet registry", nc=self.nc)
        except RollfleetError:
            raise
        except Exception as exc:  # (a forged record): a retryable error, never a raw one
            raise ServiceUnavailable(f"cannot read the fleet registry: {exc}") from exc
        if self.fleet.will_serve(constraint):
            return False
        if keyed and await self.settler.settle_stored(handle):
            handle.stored = True
            return True
        await self.refusals.note(constraint)
        if handle.waits_for_replica:
            return False
        handle.set_error(NoCompatibleReplica(self._no_replica_message(constraint)))
        return True

    async def _declare_consumer(self, constraint: VersionConstraint, replica: str | None, until: float) -> bool:
        """The consumer a job's subject needs, declared before it is stored; whether it is new."""
        if replica is not None:
            await self.consumers.replica(replica, until)
            return False
        # (Declared lately, as on almost every submit: known without a coroutine and a closure.)
        if self.consumers.known(str(constraint)):
            return False
        return await self.consumers.shared(constraint, until)

    def _left_while_storing(
        self, handle: RolloutHandle, subject: str | None, replica: str | None, *, keyed: bool
    ) -> None:
        """The caller was cancelled while its job was being stored: the broker may hold the job
        already, and nobody holds its handle. Under the caller's key it runs on (``on_leaving``): a
        resubmission with the key finds it, as any retry does. Without one nobody could ever ask
        for it, so it is stored again under the same message id (the broker's duplicate detection
        hands back the job it holds, or stores it if the first try never arrived) and cancelled."""
        key = handle.idempotency_key
        if subject is None or cancelling.on_leaving(key if keyed else None) == "run_on":
            self._handles.pop(key, None)  # (nothing was sent, or a retry under the key adopts the job)
            return
        self._spawn(self._cancel_left(handle, subject, replica))

    async def _cancel_left(self, handle: RolloutHandle, subject: str, replica: str | None) -> None:
        key = handle.idempotency_key
        try:
            ack = await self.placement.store(handle, subject, key)
            handle.stored = True
            if not ack.duplicate:
                handle.subject, handle.stream_seq, handle.replica = subject, ack.seq, replica
            elif not await self._adopt(handle, ack.seq):
                return  # settled: it was answered already
            outcome = await handle.cancel(timeout=10.0)
            log.info("caller left while its job was stored; cancelled", idempotency_key=key, outcome=outcome)
        except RollfleetError as exc:  # (the broker away: the job's deadline still ends it)
            log.warning("caller left; its job could not be cancelled", idempotency_key=key, code=exc.code)
        finally:
            self._handles.pop(key, None)

    def _settle_unclaimed(self, handle: RolloutHandle) -> bool:
        """Settle the handle with an answer for its key that arrived while no handle waited for it
        (before a restarted trainer asked again, or while ``_submit`` awaited a look-up)."""
        unclaimed = self.inbox.take(handle.idempotency_key)
        if unclaimed is None or not self.settler.settle(handle, unclaimed):
            return False
        handle.stored = True
        return True

    async def _answered_before(self, handle: RolloutHandle) -> bool:
        """Within a duplicate window of this client's start or of a reconnect, while the broker is
        away, or for a key this process already had answered, an explicit key is looked up among
        the stored answers before its job is stored (``answers.look_up_before_storing``): a broker
        that restarted meanwhile rebuilt its duplicate detection from the jobs it still stores, and
        a job that was answered and acked is no longer among them. The look-up waits for the
        broker (as storing would): a broker that does not answer is never taken for "nothing
        stored". It is a shortcut, not the guarantee: any key whose job is stored again (past the
        window, by any process) is the same job, and the replica that pulls it looks up its
        stored answers first, runs nothing if one is there and says so (``AnsweredNotice``), and
        this client settles the request from the stored answer (``_settle_noticed``). A key still
        pending elsewhere is stored as the same job, which its claim keeps from running twice
        where it is claimed: ``JobIds``."""
        answered_here = self.inbox.answered_here(handle.idempotency_key, handle.job_id)
        if not answers.look_up_before_storing(
            time.monotonic(), self._recheck_until, self.nc.is_connected, answered_here
        ):
            return False
        found = await self._stored_answer(handle)
        if found is None:
            return False
        self._handles.pop(handle.idempotency_key, None)
        handle.stored = True
        return self.settler.settle(handle, found)

    async def _settle_noticed(self, handle: RolloutHandle) -> None:
        """A replica found the handle's job answered already and ran nothing (``AnsweredNotice``:
        the key was asked again past the broker's duplicate window, and its job stored again): the
        answer stored for the request settles it, judged as any answer (``Settler.settle``)."""
        key = handle.idempotency_key
        try:
            found = await self._stored_answer(handle)
        except RollfleetError as exc:  # (the broker away past the publish budget: its deadline ends it)
            log.warning("a replica found the job answered; its answer not read", idempotency_key=key, code=exc.code)
            return
        if found is None:
            log.warning("a replica found the job answered; no answer is stored", idempotency_key=key)
            return
        if handle.done() or not self.settler.settle(handle, found):
            return
        if self._handles.get(key) is handle:
            del self._handles[key]
        self.inbox.remember((key, found.job_id))  # (asked again here: looked up before storing)

    async def _stored_answer(self, handle: RolloutHandle) -> Outcome | None:
        """The oldest stored answer to the handle's request, asked until the broker answers (as
        storing the job would be); ServiceUnavailable once that has taken the publish budget."""
        key = handle.idempotency_key
        accepts = self.settler.accepts(handle)
        found = await call_retrying(
            lambda: answers.first_answer(
                self.js, self.names, self.client_id, key, handle.job.fingerprint, accepts, strict=True
            ),
            until=min(handle.job.deadline, time.time() + PUBLISH_BUDGET_S),
            what=f"look up the stored answers of {key!r}",
            nc=self.nc,
        )
        return None if found is None else found[1]

    async def _adopt(self, handle: RolloutHandle, seq: int) -> bool:
        """A resubmission within the duplicate window stored nothing: the key's job is the one
        stored earlier (by this process or one before a restart). Follow that job where it is,
        so it can still be withdrawn, moved or watched; if it is gone, take its stored answer,
        or (withdrawn unanswered) store this request again. False once the handle is settled."""
        key = handle.idempotency_key
        found = await self.placement.job_at(seq)
        if found is None:  # gone: an answer stored first, or withdrawn (expired, moved)
            if await self.settler.settle_stored(handle):
                return False
            moved = f"{key}#1"  # where a moved turn of an earlier process went
            subject = self.names.job_subject(handle.job.constraint.kind, handle.job.constraint.version)
            await self.consumers.shared(handle.job.constraint)
            stored = await self.placement.store_where_it_lies(
                handle, subject, moved, answered=lambda: self.settler.settle_stored(handle)
            )
            if stored is None:
                return False
            ack, found = stored
            seq = ack.seq  # (a copy found there is followed where it lies)
            if found is None:
                handle.subject, handle.stream_seq, handle.replica = subject, ack.seq, None
                handle.moves = 1
                return True
        job, data, subject = found
        if job.fingerprint != handle.job.fingerprint:
            self._handles.pop(key, None)
            handle.set_error(conflict(key))
            return False
        handle.adopt(job, data, subject, seq, self.names.parse_replica_job_subject(subject))
        return True

    async def sessions_kv(self) -> KVBucket:
        """The sessions bucket, looked up once per client."""
        if self._sessions_bucket is None:
            self._sessions_bucket = await open_bucket(self.js, self.names.sessions_bucket)
        return self._sessions_bucket

    async def submit_turn(
        self,
        payload: RolloutPayload,
        constraint: VersionConstraint,
        *,
        written: str,
        key: str,
        timeout: float | None,
        retry_policy: RetryPolicy,
        session_id: str,
        replica: str | None,
        asked_at: float,
    ) -> RolloutHandle:
        """A session's turn: a job under the turn's key, on ``replica``'s own subject if given."""
        return await self._submit(
            payload,
            constraint,
            written=written,
            idempotency_key=key,
            deadline=None,
            timeout=timeout,
            retry_policy=retry_policy,
            session_id=session_id,
            replica=replica,
            asked_at=asked_at,
        )

    async def end_session(self, replica: str, session_id: str) -> None:
        await self.nc.publish(self.names.bell_subject(replica), self.names.end_session_payload(session_id))

    def session(
        self,
        session_id: str | None = None,
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_staleness: int | None = None,
        version_policy: VersionPolicy = "monotonic",
        ttl: float = 600.0,
        retry_policy: RetryPolicy = "replayable",
        affinity_wait_s: float = 2.0,
    ) -> Session:
        """A multi-turn session (``async with client.session(...) as s: await s.generate(...)``):
        its turns stick to the replica that served the previous one, follow ``version_policy``
        (``pinned``: every turn at the first turn's version; ``monotonic``: never an older
        version than the previous turn; ``free``: each turn by the constraint alone), and are
        answered once each. Opening an existing id resumes it, with the same settings or
        ``SessionConflict``. Without a constraint: ``max_staleness=0`` at each turn."""
        if min_version is None and exact_version is None and max_staleness is None:
            max_staleness = 0
        return Session(
            self,
            session_id=session_id,
            min_version=min_version,
            exact_version=exact_version,
            max_staleness=max_staleness,
            version_policy=version_policy,
            ttl=ttl,
            retry_policy=retry_policy,
            affinity_wait_s=affinity_wait_s,
        )

    async def resume_session(self, session_id: str, *, affinity_wait_s: float = 2.0) -> Session:
        """Reopen a session from its record (after a trainer restart); ``UnknownSession`` if it
        was never opened, was closed, or expired."""
        return await Session.resume(self, session_id, affinity_wait_s=affinity_wait_s)

    def _no_replica_message(self, constraint: VersionConstraint) -> str:
        live = {r.worker_id: f"{r.state}@{r.active_version}" for r in self.fleet.replicas()}
        return f"no live replica is at, or preparing, a version allowed by {constraint}; fleet: {live or 'empty'}"

    # -- withdrawing and cancelling -----------------------------------------------------------
    async def _withdraw(self, handle: RolloutHandle) -> bool:
        self._handles.pop(handle.idempotency_key, None)
        return await self.placement.delete(handle)

    async def _cancel(self, handle: RolloutHandle, timeout: float) -> CancelOutcome:
        """``RolloutHandle.cancel``: withdrawn if nobody took it, else stopped where it runs and
        answered from there (``cancelling``). The first cancel of a handle decides; any other
        joins it (``cancelling.next_cancel``), waiting as long as the first one waits."""
        earlier = self._cancels.get(handle)
        step = cancelling.next_cancel(_earlier_cancel(earlier), handle.done())
        if step == "answered":
            return "answered"
        if step == "cancel" or earlier is None:
            # A task, not the caller's own await: a first caller that is itself cancelled leaves
            # the decision running for those who joined it.
            earlier = asyncio.ensure_future(self._cancel_once(handle, timeout))
            self._cancels[handle] = earlier
        return await asyncio.shield(earlier)

    async def _cancel_once(self, handle: RolloutHandle, timeout: float) -> CancelOutcome:
        key = handle.idempotency_key
        async with handle.placing:  # (a move or requeue under way ends first; none comes after)
            handle.cancelled = True
            removed = await self.placement.delete(handle)  # (queued or running: never delivered again)
            # Asked after the removal, not before: a delivery between the two looks (campaign 10,
            # seed 6803: "withdrawn", yet the replica it reached ran and answered it) is seen, and
            # none can follow a removal (the consumer counts a delivery as it sends it).
            delivered = await self.placement.delivered(handle)
        if not cancelling.must_stop(delivered, removed):
            self._handles.pop(key, None)
            handle.set_error(Cancelled(f"{key!r} withdrawn before a replica took it"))
            self.metrics.cancelled.labels(client_id=self.client_id, outcome="withdrawn").inc()
            return "withdrawn"
        with suppress(BrokerError), typed_errors():
            await self.nc.publish(self.names.cancel_subject(), claim_key(handle.job_id).encode())
        answer: RolloutResult | RollfleetError | None = None
        try:
            answer = await handle.result(timeout)
        except RollfleetError as exc:
            answer = exc
        except TimeoutError:
            self._handles.pop(key, None)
            handle.set_error(Cancelled(f"{key!r} cancelled; no answer came in {timeout:g} s"))
        outcome = cancelling.outcome_of(answer)
        self.metrics.cancelled.labels(client_id=self.client_id, outcome=outcome).inc()
        log.info("cancelled", idempotency_key=key, outcome=outcome)
        return outcome

    # -- policy versions --------------------------------------------------------------------
    async def publish_policy(self, publisher: Any, named_tensors: Any) -> VersionRecord:
        """Write the next version with a ``PolicyPublisher`` (in a thread) and commit it.

        The first call records the base checkpoint as version 0 and commits that.
        """
        record = await asyncio.to_thread(publisher.publish, named_tensors)
        return await self.commit_version(record)

    async def commit_version(self, record: VersionRecord) -> VersionRecord:
        """Make a written version visible to the fleet (create ``v.<N>``, CAS ``latest``, announce)."""
        await self.declare_version_consumers(record.version)  # before replicas hear of it
        record = await commit_version(self.js, self.names, record)
        self.fleet.note_committed(record.version)
        return record

    async def adopt_version(self, store_dir: str | Path, version_dir: str | Path) -> VersionRecord:
        """Verify and commit a version directory written by another publisher, without re-encoding."""
        record = await adopt_version(self.js, self.names, Path(store_dir), Path(version_dir))
        self.fleet.note_committed(record.version)
        await self.declare_version_consumers(record.version)  # (adopt verifies, then commits)
        return record

    # -- what restoring a lost namespace needs (``restore.RestoreHost``) ----------------------------
    def forget_consumers(self) -> None:
        self.consumers.forget()

    async def restore_results_consumer(self) -> None:
        await ensure_results_consumer(self.js, self.names, self.client_id, self.topology, self._instance)
        self.inbox.renew()

    async def restore_job_ids(self) -> None:
        await self._ids.restore(await self.sessions_kv())

    async def restore_lease(self) -> None:
        await self._lease.restore()

    async def declare_version_consumers(self, version: int) -> None:
        await self.consumers.version(version)

    async def wait_for_version(
        self, version: int, *, replicas: int | None = None, fraction: float | None = None, timeout: float = 120.0
    ) -> list[ReplicaStatus]:
        """Wait until ``replicas`` (or ``fraction``, default all live) replicas serve ``version``+."""
        return await self.fleet.wait_for_version(version, replicas=replicas, fraction=fraction, timeout=timeout)

    # -- results ----------------------------------------------------------------------------
    def stream(self, handle: RolloutHandle) -> AsyncIterator[TokenChunk]:
        """A job's tokens as its worker checkpoints them (``resume`` jobs; other jobs: at the end),
        then the rest from its answer: ``async for chunk in client.stream(handle)``. The chunks put
        together are the result's tokens, in order, each once, across resumes; the job's error,
        if it fails, is raised. ``await handle`` still returns the same result."""
        return stream_tokens(self.js, self.names, handle)

    async def replay(self, target: Any, payload: RolloutPayload, **options: Any) -> ReplayOutcome:
        """Generate sample ``index`` of ``target`` (a result, or a coordinate and the ``original``
        sample) again, deterministic and at its version, and say whether every token and log-prob
        matched, or where it diverged and which part of the coordinate differs
        (``replaying.replay``, whose keyword options it takes)."""
        return await replaying.replay(self, target, payload, **options)

    async def result(self, idempotency_key: str, timeout: float | None = None) -> RolloutResult:
        """The result for a key, whether submitted by this process or before a restart; waits up
        to ``timeout`` (by default the client's ``default_timeout_s``), then ``TimeoutError``."""
        handle = self._handles.get(idempotency_key)
        if handle is not None:
            return await handle.result(timeout)
        unclaimed = self.inbox.unclaimed
        if idempotency_key not in unclaimed:
            # Delivered to an earlier process that died before using it: read it back.
            mine = self.settler.issued(idempotency_key)
            found = await answers.first_answer(self.js, self.names, self.client_id, idempotency_key, None, mine)
            if found is not None:
                unclaimed.setdefault(idempotency_key, found[1])
        wait = self.default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        while idempotency_key not in unclaimed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no result for {idempotency_key!r} within {wait:g} s")
            await wait_event(self.inbox.arrived, remaining)
        return self.settler.deliver(idempotency_key, unclaimed.pop(idempotency_key))

    def unclaimed(self) -> dict[str, Outcome]:
        """Results that arrived for keys this process did not submit (e.g. before a restart)."""
        return dict(self.inbox.unclaimed)

    def take_unclaimed(self, idempotency_key: str) -> Outcome | None:
        """The unclaimed answer under ``idempotency_key``, removed (a caller that will never ask
        for the key counts it instead: ``RolloutLoop``'s answers of a predecessor); None if none."""
        return self.inbox.take(idempotency_key)

    def _on_reconnect(self) -> None:
        self._recheck_until = time.monotonic() + self.topology.duplicate_window_s  # (see _answered_before)
        self.inbox.renew()  # re-request at once instead of waiting out the old one
        self.fleet.note_reconnected()
        self.placement.note_reconnected()  # (a holder is judged only once it could be back: HolderWatch)
        if self.keeper is not None:  # (the broker may be back on an empty or older store)
            self.keeper.poke()
        self._spawn(self._check_lease())

    async def _check_lease(self) -> None:
        """After a partition another client may have taken the id over: then stop taking results."""
        if self.shared:
            return
        try:
            held = await self._lease.held()
        except Exception:  # the broker went away again; the next reconnect checks again
            return
        if held or not self.inbox.receiving:
            return
        log.error("client_id taken over by another client while disconnected; no longer receiving results")
        await self.inbox.stop()
        for handle in list(self._handles.values()):
            handle.set_error(ClientIdInUse(f"client_id {self.client_id!r} was taken over by another client"))
        self._handles.clear()

    async def _on_results_leader(self, msg: Msg) -> None:
        """The results consumer has a new leader (a cluster fail-over): our request is gone."""
        self.inbox.on_leader_change(msg.subject.rpartition(".")[2])

    async def _on_given_up(self, msg: Msg) -> None:
        """The broker gave up on a job: delivered ``max_deliver`` times (its holders died, or handed
        it back), it is never delivered again. A resumable job is stored again, the same job, so
        the next replica resumes it from its checkpoints: outliving its holders is what it is for.
        (Other jobs keep the broker's bound on a job that kills its workers: their deadline.)"""
        seq = given_up_seq(msg.data or b"")
        for handle in list(self._handles.values()):
            if seq is None or handle.stream_seq != seq or handle.done() or not handle.job.behaviour.checkpoints:
                continue
            place = self.placement
            stored = await (place.requeue(handle) if handle.replica is None else place.move_to_shared(handle))
            log.info("resumable job given up on by the broker; stored again", key=handle.idempotency_key, stored=stored)

    # Called with every answer message received, before deduplication (for audits and tests).
    @property
    def observe(self) -> Callable[[Outcome, int | None], None] | None:
        return self.inbox.observe

    @observe.setter
    def observe(self, fn: Callable[[Outcome, int | None], None] | None) -> None:
        self.inbox.observe = fn


def _earlier_cancel(task: asyncio.Future[CancelOutcome] | None) -> cancelling.EarlierCancel:
    """The facts ``cancelling.next_cancel`` reads about a handle's earlier cancel."""
    if task is None:
        return "none"
    if not task.done():
        return "deciding"
    return "failed" if task.cancelled() or task.exception() is not None else "decided"
