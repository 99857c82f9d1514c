"""RolloutClient: what a training loop imports to submit version-constrained rollouts.

``submit`` stores a job on ``jobs.min.<v>`` / ``jobs.exact.<v>`` (deduplicated by its
idempotency key) and returns a handle; results arrive on this client's durable results
consumer, so a restarted trainer with the same ``client_id`` still receives them.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import xxhash
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollfleet.broker.connection import connect
from rollfleet.broker.publish import publish_retrying
from rollfleet.broker.pull import PullConsumer
from rollfleet.broker.topology import DEFAULT_TOPOLOGY, TopologyConfig, ensure_results_consumer, ensure_topology
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    ChunkedOutcome,
    Limits,
    Names,
    Outcome,
    ReplicaStatus,
    RetryPolicy,
    RolloutFailure,
    RolloutJob,
    RolloutPayload,
    RolloutResult,
    StoredOutcome,
    VersionConstraint,
    VersionRecord,
    check_token,
    decode_outcome,
    error_from_code,
    served_within,
)
from rollfleet.schemas.errors import (
    ClientIdInUse,
    ContractViolation,
    Expired,
    IdempotencyConflict,
    InvalidRequest,
    NoCompatibleReplica,
    RollfleetError,
    ServiceUnavailable,
)
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.lease import ClientLease
from rollfleet.trainer_client.metrics import ClientMetrics
from rollfleet.trainer_client.requests import build_job, constraint_from
from rollfleet.trainer_client.versions import adopt_version, commit_version

log = get_logger("rollfleet.client")

_DELIVERED_MEMORY = 100_000  # keys whose result was already handed out (drop late duplicates)
_RESULTS_BATCH = 512
_RESULTS_WAIT_S = 5.0
_BELL_INTERVAL_S = 0.05
_PUBLISH_BUDGET_S = 30.0  # how long submit keeps trying to store a job while the broker recovers


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
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.names = names
        self.client_id = check_token(client_id, "client_id")
        self.topology = topology
        self.limits = limits
        self.default_timeout_s = default_timeout_s
        self.deadline_grace_s = deadline_grace_s
        self.fail_fast = fail_fast
        self.fleet = FleetView(self.js, names)
        self.metrics = ClientMetrics(self.client_id)
        self._lease = ClientLease(nc, self.js, names, self.client_id)
        self._handles: dict[str, RolloutHandle] = {}
        self._unclaimed: dict[str, Outcome] = {}  # results with no handle (e.g. from before a restart)
        self._unclaimed_event = asyncio.Event()
        self._delivered: OrderedDict[tuple[str, str | None], None] = OrderedDict()  # (key, job id)
        self._results_task: asyncio.Task[None] | None = None
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()
        self._bells: dict[str, float] = {}
        self._results_puller: PullConsumer | None = None

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
        **connect_options: Any,
    ) -> RolloutClient:
        """Connect, declare the namespace if needed, and start receiving results."""
        check_token(client_id, "client_id")
        hooks: list[Callable[[], None]] = []
        nc = await connect(url, name=f"rollfleet-client-{client_id}", reconnect_hooks=hooks, **connect_options)
        client = cls(
            nc,
            Names(namespace),
            client_id,
            topology=topology,
            limits=limits,
            default_timeout_s=default_timeout_s,
            fail_fast=fail_fast,
        )
        hooks.append(client._on_reconnect)
        try:
            await client._start()
        except BaseException:
            await nc.close()
            raise
        return client

    async def _start(self) -> None:
        await ensure_topology(self.js, self.names, self.topology)
        await self._lease.acquire()  # one live client per client_id, or ClientIdInUse
        self._results_consumer = await ensure_results_consumer(self.js, self.names, self.client_id, self.topology)
        await self.fleet.start()
        self._results_task = asyncio.create_task(self._receive_results(), name="results")
        self._expiry_task = asyncio.create_task(self._expire_handles(), name="deadlines")

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._results_task is not None:
            await stop_tasks([self._results_task, self._expiry_task])
        await self.fleet.close()
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
        idempotency_key: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        retry_policy: RetryPolicy = "replayable",
        session_id: str | None = None,
    ) -> RolloutHandle:
        """Queue one rollout job and return its handle.

        Exactly one of ``min_version``, ``exact_version`` or ``max_staleness`` (meaning
        ``min_version = latest - max_staleness``) says which policy versions may serve it.
        Resubmitting an ``idempotency_key`` within the duplicate window makes no second job and
        yields the same answer; the same key for a different request is ``IdempotencyConflict``.
        Arguments of the wrong type or value are ``InvalidRequest``, raised here.
        """
        constraint = constraint_from(min_version, exact_version, max_staleness, self.latest_version)
        job, data = build_job(
            payload,
            client_id=self.client_id,
            constraint=constraint,
            idempotency_key=idempotency_key,
            deadline=deadline,
            timeout=timeout,
            default_timeout_s=self.default_timeout_s,
            retry_policy=retry_policy,
            session_id=session_id,
            trainer_version=self.latest_version,
            limits=self.limits,
        )
        key = job.idempotency_key
        existing = self._handles.get(key)
        if existing is not None:
            self._check_same_request(existing.job, job.fingerprint)
            return existing
        handle = RolloutHandle(job, self._withdraw)
        unclaimed = self._unclaimed.pop(key, None)
        if unclaimed is not None:  # the answer came before we asked again (trainer restart)
            self._settle(handle, unclaimed)
            return handle
        if self.fail_fast and not self.fleet.compatible(constraint):
            try:
                await self.fleet.refresh()  # the view may lag a replica that just registered
            except Exception as exc:  # broker unreachable: a retryable error, never a raw one
                raise ServiceUnavailable(f"cannot read the fleet registry: {exc}") from exc
            if not self.fleet.compatible(constraint):
                # An answer already stored for this key wins: resubmitting is always safe.
                stored = await self._stored_outcome(key) if idempotency_key is not None else None
                if stored is not None:
                    self._settle(handle, stored)
                else:
                    handle.set_error(NoCompatibleReplica(self._no_replica_message(constraint)))
                return handle
        self._handles[key] = handle
        headers = {HDR_MSG_ID: key, HDR_CLIENT_ID: self.client_id}
        subject = self.names.job_subject(constraint.kind, constraint.version)
        try:
            until = min(job.deadline, time.time() + _PUBLISH_BUDGET_S)
            ack = await publish_retrying(self.js, subject, data, headers, until=until)
        except RollfleetError:
            self._handles.pop(key, None)
            raise
        handle.stream_seq = None if ack.duplicate else ack.seq
        self._ring(constraint)
        if ack.duplicate and (stored := await self._stored_outcome(key)) is not None:
            self._handles.pop(key, None)
            self._settle(handle, stored)  # a duplicate submit whose result was delivered earlier
        log.debug("submitted", idempotency_key=key, constraint=str(constraint), duplicate=bool(ack.duplicate))
        return handle

    @staticmethod
    def _check_same_request(job: RolloutJob, fingerprint: str) -> None:
        if job.fingerprint and fingerprint and job.fingerprint != fingerprint:
            raise IdempotencyConflict(
                f"idempotency key {job.idempotency_key!r} is already used for a different request "
                f"(constraint {job.constraint}); give this request its own key"
            )

    async def _expire_handles(self) -> None:
        """Fail pending handles whose deadline (plus grace) passed without a result: one sweep
        over what is in flight, four times a second, instead of a timer per job."""
        while True:
            await asyncio.sleep(0.25)
            cutoff = time.time() - self.deadline_grace_s
            for handle in [h for h in self._handles.values() if h.job.deadline <= cutoff]:
                if handle.set_error(Expired(f"no result for {handle.idempotency_key!r} by its deadline")):
                    self._spawn(self._withdraw(handle))

    def _ring(self, constraint: VersionConstraint) -> None:
        """Wake idle workers that have no request waiting on this subject. It carries nothing
        and may be lost (workers also poll); one per subject per interval is enough, since a
        woken worker pulls everything there."""
        now = time.monotonic()
        subject = self.names.bell_subject(constraint.kind, constraint.version)
        if now - self._bells.get(subject, 0.0) >= _BELL_INTERVAL_S:
            self._bells[subject] = now
            self._spawn(self.nc.publish(subject, b""))

    def _no_replica_message(self, constraint: VersionConstraint) -> str:
        live = {r.worker_id: f"{r.state}@{r.active_version}" for r in self.fleet.replicas()}
        return f"no live replica is at, or preparing, a version allowed by {constraint}; fleet: {live or 'empty'}"

    def _settle(self, handle: RolloutHandle, outcome: Outcome) -> None:
        """Hand ``outcome`` to the caller, unless it answers another request or breaks its constraint."""
        if outcome.fingerprint and handle.job.fingerprint and outcome.fingerprint != handle.job.fingerprint:
            handle.set_error(
                IdempotencyConflict(
                    f"idempotency key {handle.idempotency_key!r} was answered for a different request; "
                    "give this request its own key"
                )
            )
            return
        if isinstance(outcome, RolloutFailure):
            handle.set_error(error_from_code(outcome.code, outcome.message, outcome.retryable))
            return
        if not self._within_constraint(outcome, handle.job.constraint):
            handle.set_error(
                ContractViolation(
                    f"result for {handle.idempotency_key!r} was served at versions {outcome.version_start}.."
                    f"{outcome.version_end}, outside {handle.job.constraint}; it was not used"
                )
            )
            return
        self._attach_staleness(outcome)
        handle.set_result(outcome)

    def _within_constraint(self, result: RolloutResult, constraint: VersionConstraint | None) -> bool:
        """Defence in depth: every result is checked against the constraint it was asked for."""
        constraint = constraint or result.constraint
        if constraint is None or served_within(constraint, result):
            return True
        self.metrics.contract_violations.inc()
        log.error(
            "contract violation: result outside its constraint, not handed to the caller",
            idempotency_key=result.idempotency_key,
            constraint=str(constraint),
            version_start=result.version_start,
            version_end=result.version_end,
            worker_id=result.worker_id,
        )
        return False

    def _attach_staleness(self, result: RolloutResult) -> None:
        latest = self.latest_version
        if latest is not None:
            # Measured from the oldest policy that produced any of its tokens.
            result.staleness = max(0, latest - result.version_start)

    async def _stored_outcome(self, key: str) -> Outcome | None:
        """The outcome stored for ``key`` on the results stream, if any (e.g. one an earlier
        process received and acked). None too when the broker is away: then the result, if
        any, still arrives through the consumer."""
        subject = self.names.result_subject(self.client_id, key)
        try:
            raw = await self.js.get_last_msg(self.names.results_stream, subject)
            return await self._whole(decode_outcome(raw.data or b""))
        except (nats.errors.Error, nats.js.errors.Error, InvalidRequest):
            return None

    async def _whole(self, outcome: StoredOutcome) -> Outcome:
        """An outcome stored in chunks, read back and checked; any other outcome as it is."""
        if not isinstance(outcome, ChunkedOutcome):
            return outcome
        parts = []
        for i in range(outcome.chunks):
            subject = self.names.result_chunk_subject(self.client_id, outcome.idempotency_key, i)
            parts.append((await self.js.get_last_msg(self.names.results_stream, subject)).data or b"")
        data = b"".join(parts)
        if len(data) != outcome.size or xxhash.xxh3_128_hexdigest(data) != outcome.digest:
            raise InvalidRequest(f"the chunks of {outcome.idempotency_key!r} do not add up to the stored answer")
        whole = decode_outcome(data)
        if isinstance(whole, ChunkedOutcome):
            raise InvalidRequest("a chunked answer cannot contain another")
        return whole

    async def _withdraw(self, handle: RolloutHandle) -> bool:
        self._handles.pop(handle.idempotency_key, None)
        if handle.stream_seq is None:
            return False
        try:
            return bool(await self.js.delete_msg(self.names.jobs_stream, handle.stream_seq))
        except Exception:  # already taken (acked and removed) or broker away
            return False

    # -- policy versions --------------------------------------------------------------------
    async def publish_policy(self, publisher: Any, named_tensors: Any) -> VersionRecord:
        """Write the next version with a ``PolicyPublisher`` (in a thread) and commit it.

        The first call records the base checkpoint as version 0 and commits that.
        """
        record = await asyncio.to_thread(publisher.publish, named_tensors)
        await self.commit_version(record)
        return record

    async def commit_version(self, record: VersionRecord) -> None:
        """Make a written version visible to the fleet (create ``v.<N>``, CAS ``latest``, announce)."""
        await commit_version(self.js, self.names, record)
        self.fleet.note_committed(record.version)

    async def adopt_version(self, store_dir: str | Path, version_dir: str | Path) -> VersionRecord:
        """Verify and commit a version directory written by another publisher, without re-encoding."""
        record = await adopt_version(self.js, self.names, Path(store_dir), Path(version_dir))
        self.fleet.note_committed(record.version)
        return record

    async def wait_for_version(
        self, version: int, *, replicas: int | None = None, fraction: float | None = None, timeout: float = 120.0
    ) -> list[ReplicaStatus]:
        """Wait until ``replicas`` (or ``fraction``, default all live) replicas serve ``version``+."""
        return await self.fleet.wait_for_version(version, replicas=replicas, fraction=fraction, timeout=timeout)

    # -- results ----------------------------------------------------------------------------
    async def result(self, idempotency_key: str, timeout: float | None = None) -> RolloutResult:
        """The result for a key, whether submitted by this process or before a restart."""
        handle = self._handles.get(idempotency_key)
        if handle is not None:
            return await handle.result(timeout)
        if idempotency_key not in self._unclaimed:
            # Delivered to an earlier process that died before using it: read it back.
            stored = await self._stored_outcome(idempotency_key)
            if stored is not None:
                self._unclaimed.setdefault(idempotency_key, stored)
        deadline = None if timeout is None else time.monotonic() + timeout
        while idempotency_key not in self._unclaimed:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no result for {idempotency_key!r}")
            event = self._unclaimed_event
            with suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)
        outcome = self._unclaimed.pop(idempotency_key)
        if isinstance(outcome, RolloutFailure):
            raise error_from_code(outcome.code, outcome.message, outcome.retryable)
        if not self._within_constraint(outcome, None):  # checked against the constraint it carries
            raise ContractViolation(f"result for {idempotency_key!r} was served outside {outcome.constraint}")
        self._attach_staleness(outcome)
        return outcome

    def unclaimed(self) -> dict[str, Outcome]:
        """Results that arrived for keys this process did not submit (e.g. before a restart)."""
        return dict(self._unclaimed)

    def _on_reconnect(self) -> None:
        if self._results_puller is not None:
            self._results_puller.reset()  # re-request at once instead of waiting out the old one
        self._spawn(self._check_lease())

    async def _check_lease(self) -> None:
        """After a partition another client may have taken the id over: then stop taking results."""
        try:
            held = await self._lease.held()
        except Exception:  # the broker went away again; the next reconnect checks again
            return
        if held or self._results_task is None:
            return
        log.error("client_id taken over by another client while disconnected; no longer receiving results")
        await stop_tasks([self._results_task])
        for handle in list(self._handles.values()):
            handle.set_error(ClientIdInUse(f"client_id {self.client_id!r} was taken over by another client"))
        self._handles.clear()

    async def _receive_results(self) -> None:
        """Keep a pull request open on this client's results consumer; each result is handled
        the moment it is stored (no batch to fill, no poll interval)."""
        puller = await PullConsumer(self.nc, self.names.results_stream, self._results_consumer, self._on_result).start()
        self._results_puller = puller
        try:
            while True:
                try:
                    if not puller.busy:
                        await puller.request(_RESULTS_BATCH, wait_s=_RESULTS_WAIT_S)
                    await puller.wait_idle(timeout=1.0)  # wakes to notice a request lost in a fail-over
                except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:  # reconnecting
                    log.debug("results pull failed", error=str(exc))
                    await asyncio.sleep(0.5)
        finally:
            await puller.close()

    async def _on_result(self, msg: Msg) -> None:
        if self.names.is_result_chunk(msg.subject):
            with suppress(Exception):  # read with its head, by subject
                await msg.ack()
            return
        try:
            outcome = await self._whole(decode_outcome(msg.data))
        except RollfleetError as exc:
            log.warning("undecodable result dropped", error=exc.message, subject=msg.subject)
        except (nats.errors.Error, nats.js.errors.Error) as exc:  # chunks unreadable now: redelivered later
            log.warning("result chunks not readable yet", error=str(exc), subject=msg.subject)
            with suppress(Exception):
                await msg.nak(delay=1.0)
            return
        else:
            self._deliver(outcome)
        with suppress(Exception):
            await msg.ack()

    def _deliver(self, outcome: Outcome) -> None:
        key = outcome.idempotency_key
        answer = (key, outcome.job_id)
        if answer in self._delivered:
            return  # one answer per job: a late duplicate is dropped
        self._delivered[answer] = None
        if len(self._delivered) > _DELIVERED_MEMORY:
            self._delivered.popitem(last=False)
        handle = self._handles.pop(key, None)
        if handle is not None:
            self._settle(handle, outcome)
            return
        self._unclaimed[key] = outcome
        if len(self._unclaimed) > _DELIVERED_MEMORY:  # nobody is asking: keep the newest only
            self._unclaimed.pop(next(iter(self._unclaimed)))
        event, self._unclaimed_event = self._unclaimed_event, asyncio.Event()
        event.set()
