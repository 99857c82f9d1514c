"""RolloutClient: what a training loop imports to submit version-constrained rollouts.

``submit`` stores a job on ``jobs.min.<v>`` / ``jobs.exact.<v>`` (deduplicated by its
idempotency key) and returns a handle; results arrive on this client's durable results
consumer, so a restarted trainer with the same ``client_id`` still receives them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from typing import Any

from rollfleet.broker.buckets import KVBucket
from rollfleet.broker.connection import connect
from rollfleet.broker.startup import not_ready
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    TopologyConfig,
    declare_results_consumer,
    ensure_results_consumer,
    ensure_topology,
)
from rollfleet.broker.types import NATS, JetStreamContext
from rollfleet.runtime.aio import stop_tasks
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Limits,
    Names,
    RetryPolicy,
    RolloutPayload,
    check_token,
)
from rollfleet.schemas.asked import AskedConstraint
from rollfleet.schemas.errors import ServiceUnavailable
from rollfleet.trainer_client.answer_settling import Settler
from rollfleet.trainer_client.bells import Bells
from rollfleet.trainer_client.canceller import Canceller
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.client_results import ClientResults
from rollfleet.trainer_client.client_sessions import ClientSessions
from rollfleet.trainer_client.client_versions import ClientVersions
from rollfleet.trainer_client.consumers import JobConsumers
from rollfleet.trainer_client.earlier_answers import EarlierAnswers
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.inbox import ResultsInbox
from rollfleet.trainer_client.job_watch import JobWatch
from rollfleet.trainer_client.lease import ClientLease
from rollfleet.trainer_client.own_job_ids import JobIds
from rollfleet.trainer_client.placement import JobPlacement
from rollfleet.trainer_client.reconnects import Reconnects
from rollfleet.trainer_client.refusals import RefusalNotes
from rollfleet.trainer_client.requests import asked_of
from rollfleet.trainer_client.restore import restore_namespace
from rollfleet.trainer_client.sessions import OpenSession
from rollfleet.trainer_client.submitting import Submitter, no_replica_message
from rollfleet.trainer_client.versions import VersionCommits


class RolloutClient(ClientSessions, ClientResults, ClientVersions):
    """The trainer's side of the fleet: submitting jobs (here), sessions (``ClientSessions``),
    results beyond a handle (``ClientResults``) and policy versions (``ClientVersions``)."""

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
        self.settler = Settler(self.js, names, self.client_id, self._handles, self.metrics, lambda: self.latest_version)
        settle = self.settler.settle
        self.inbox = ResultsInbox(
            nc,
            self.js,
            names,
            self._handles,
            lambda h, o: settle(h, o, issued=True),
            shared=shared,
            noticed=lambda h: self._spawn(self.earlier.settle_noticed(h)),
        )
        self._started = False
        self._closed = False
        self._expiry_task: asyncio.Task[None] | None = None
        self._stall_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.bells = Bells(nc, names, self.fleet, self._spawn)
        self.refusals = RefusalNotes(nc, names)  # (what the fleet's control loop hears of refusals)
        self.consumers = JobConsumers(self.js, nc, names, topology, ring=lambda c: self.bells.ring(c, fresh=True))
        self._sessions_bucket: KVBucket | None = None
        self.placement = self._job_placement()
        self.sessions: dict[str, OpenSession] = {}  # open sessions of this client, by id
        self.watch = self._job_watch(deadline_grace_s, fail_fast)
        self.earlier = EarlierAnswers(self, self._handles)  # answers that came before they were asked for
        self.canceller = Canceller(nc, names, self.client_id, self._handles, self.placement, self.metrics)
        self.submitter = Submitter(self, self._handles, self.earlier, self.canceller.cancel, self._spawn)
        self.versions = VersionCommits(self.js, names, self.fleet, self.declare_version_consumers)
        self.reconnects = Reconnects(self, None if shared else self._lease, self._handles, self._spawn)

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
            no_replica_message=partial(no_replica_message, self.fleet),
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
        hooks.append(client.reconnects.on_reconnect)
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
        self._ids = self.settler.ids = self.submitter.ids = await JobIds.load(await self.sessions_kv(), self.client_id)
        self._results_consumer = await ensure_results_consumer(
            self.js, self.names, self.client_id, self.topology, self._instance
        )
        await self.fleet.start()
        # A bell rung at a replica that is gone comes back as "no responders" on this inbox.
        await self.bells.start()
        self.placement.probe_reply = self.bells.probe_reply
        await self.reconnects.listen_leader()
        await self.nc.subscribe(self.names.max_deliveries_advisory(self.names.jobs_stream), cb=self.watch.given_up)
        self.inbox.start(self._results_consumer, self._ids)
        self._started = True
        self._expiry_task = asyncio.create_task(self.watch.deadlines(), name="deadlines")
        self._stall_task = asyncio.create_task(self.watch.stalls(), name="stalls")
        self._spawn(self.consumers.follow(self.fleet))
        await self.reconnects.keep_topology(self.topology, lambda created: restore_namespace(self, created))

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
        return await self.submitter.submit(
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

    # -- withdrawing -----------------------------------------------------------------------------
    async def _withdraw(self, handle: RolloutHandle) -> bool:
        self._handles.pop(handle.idempotency_key, None)
        return await self.placement.delete(handle)

    # -- what restoring a lost namespace needs (``restore.RestoreHost``) ----------------------------
    def forget_consumers(self) -> None:
        self.consumers.forget()

    async def restore_results_consumer(self) -> None:
        created = await declare_results_consumer(self.js, self.names, self.client_id, self.topology, self._instance)
        self.inbox.renew()
        if created and self.shared:
            # This instance's consumer starts at new answers: one stored while it was missing (a
            # replica answering into the stream declared again before it) reaches no handle by it.
            self._spawn(self.earlier.settle_waiting())

    async def restore_job_ids(self) -> None:
        await self._ids.restore(await self.sessions_kv())

    async def restore_lease(self) -> None:
        await self._lease.restore()

    async def declare_version_consumers(self, version: int) -> None:
        await self.consumers.version(version)
