"""Storing a request's job: ``RolloutClient.submit`` with its constraint resolved.

A request becomes a job (``requests.build_job``) and is settled here when it can be without
storing anything: the same key's handle is still waiting (returned as is), an answer for the key
came or is stored already (``EarlierAnswers``), or no replica will serve it (``NoCompatibleReplica``,
unless it waits for one). Otherwise the job's consumer is declared, the job stored
(``JobPlacement.store``) and the replicas that may take it rung. A resubmission the broker took
for a duplicate follows the job stored earlier under its key (``adopt``). A caller cancelled
while its job was stored leaves it running under its key, or cancelled without one
(``cancelling.on_leaving``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from rollfleet.broker.retry_call import call_retrying
from rollfleet.broker.topology import TopologyConfig
from rollfleet.broker.types import NATS
from rollfleet.runtime.logs import debug_enabled, get_logger
from rollfleet.schemas import Limits, Names, RetryPolicy, RolloutPayload, VersionConstraint
from rollfleet.schemas.errors import NoCompatibleReplica, RollfleetError, ServiceUnavailable
from rollfleet.trainer_client import cancelling
from rollfleet.trainer_client.answer_settling import Settler, check_same_request, conflict
from rollfleet.trainer_client.bells import Bells
from rollfleet.trainer_client.consumers import JobConsumers
from rollfleet.trainer_client.earlier_answers import EarlierAnswers
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.own_job_ids import JobIds
from rollfleet.trainer_client.placement import PUBLISH_BUDGET_S, JobPlacement
from rollfleet.trainer_client.refusals import RefusalNotes
from rollfleet.trainer_client.requests import build_job

log = get_logger("rollfleet.client")
_DEBUG = debug_enabled(log)  # (fixed with the logger: the per-job debug line's fields are built only then)


class SubmitHost(Protocol):
    """What storing a job needs of its client (``RolloutClient`` is one)."""

    nc: NATS
    names: Names
    client_id: str
    topology: TopologyConfig
    limits: Limits
    default_timeout_s: float
    fleet: FleetView
    settler: Settler
    bells: Bells
    refusals: RefusalNotes
    consumers: JobConsumers
    placement: JobPlacement

    @property
    def latest_version(self) -> int | None: ...

    @property
    def fail_fast(self) -> bool: ...


def no_replica_message(fleet: FleetView, constraint: VersionConstraint) -> str:
    """What ``NoCompatibleReplica`` says: the constraint, and the live fleet as this client sees it."""
    live = {r.worker_id: f"{r.state}@{r.active_version}" for r in fleet.replicas()}
    return f"no live replica is at, or preparing, a version allowed by {constraint}; fleet: {live or 'empty'}"


class Submitter:
    """The client's submit path, from a resolved constraint to a stored (or settled) handle."""

    ids: JobIds  # (loaded as the client starts)

    def __init__(
        self,
        host: SubmitHost,
        handles: dict[str, RolloutHandle],
        earlier: EarlierAnswers,
        cancel: Callable[[RolloutHandle, float], Any],
        spawn: Callable[[Any], None],
    ) -> None:
        self._host = host
        self._handles = handles
        self._earlier = earlier
        self._cancel = cancel  # one bound method for every handle, not one each
        self._spawn = spawn

    async def submit(
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
        host = self._host
        job, data = build_job(
            payload,
            client_id=host.client_id,
            constraint=constraint,
            written=written,
            idempotency_key=idempotency_key,
            deadline=deadline,
            timeout=timeout,
            default_timeout_s=host.default_timeout_s,
            retry_policy=retry_policy,
            session_id=session_id,
            trainer_version=host.latest_version,
            limits=host.limits,
            max_timeout_s=host.topology.claims_ttl_s,
            job_id=self.ids.issue(idempotency_key if isinstance(idempotency_key, str) else None),
            asked_at=asked_at,
        )
        key = job.idempotency_key
        existing = self._handles.get(key)
        if existing is not None:
            check_same_request(existing.job, job.fingerprint)
            existing.waits_for_replica = existing.waits_for_replica or wait_for_replica
            return existing
        if host.placement.withdrawn.conflicts(key, job.fingerprint, time.monotonic()):
            raise conflict(key)  # (its job was withdrawn; the key stays its request's)
        key_given = idempotency_key is not None
        handle = RolloutHandle(job, data, self._cancel)
        # The caller's choice, whatever the fleet holds now: a replica at the version that could
        # serve the job at submit may move on before it does, and the job then waits all the same.
        handle.waits_for_replica = wait_for_replica
        until = min(handle.job.deadline, time.time() + PUBLISH_BUDGET_S)  # (as storing it waits)
        if not await self._settled_unstored(handle, replica, until, keyed=key_given):
            await self._store(handle, constraint, replica, until, keyed=key_given)
        return handle

    async def _settled_unstored(self, handle: RolloutHandle, replica: str | None, until: float, *, keyed: bool) -> bool:
        """Whether ``handle`` is settled with no job stored: by an answer that came before it was
        asked (a trainer restart), one stored before under its key, or as unservable (no replica
        can serve it, ``fail_fast``). Else it is registered, to wait for the job about to be stored."""
        if self._earlier.settle_unclaimed(handle):
            return True  # the answer came before we asked again (trainer restart)
        if keyed and await self._earlier.answered_before(handle):
            return True
        if self._host.fail_fast and replica is None and await self._settled_unservable(handle, until, keyed=keyed):
            return True
        key = handle.idempotency_key
        self._handles[key] = handle
        # An answer that came while the look-ups above awaited went to the unclaimed ones.
        if self._earlier.settle_unclaimed(handle):
            self._handles.pop(key, None)
            return True
        return False

    async def _store(
        self, handle: RolloutHandle, constraint: VersionConstraint, replica: str | None, until: float, *, keyed: bool
    ) -> None:
        """Store the handle's job on the constraint's shared subject, or ``replica``'s own, its
        consumer declared first; ``keyed``: under a key of the caller's."""
        host = self._host
        key = handle.idempotency_key
        if replica is None:
            subject = host.names.job_subject(constraint.kind, constraint.version)
        else:
            subject = host.names.replica_job_subject(replica)
        try:
            fresh = await self._declare_consumer(constraint, replica, until)
            ack = await host.placement.store(handle, subject, key)
        except RollfleetError:
            self._handles.pop(key, None)
            raise
        except asyncio.CancelledError:
            self._left_while_storing(handle, subject, replica, keyed=keyed)
            raise
        await self._stored(handle, subject, replica, ack, fresh=fresh)

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
        return await self.submit(
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

    async def _stored(self, handle: RolloutHandle, subject: str, replica: str | None, ack: Any, *, fresh: bool) -> None:
        """The broker stored the handle's job (``ack``; a duplicate: another handle's, of this
        key, adopted unless it is settled): ring the replicas that may take it."""
        handle.stored = True
        if not ack.duplicate:
            handle.subject, handle.stream_seq, handle.replica = subject, ack.seq, replica
        elif not await self.adopt(handle, ack.seq):
            return  # settled: answered before, or the key answers another request
        if handle.replica is None:
            self._host.bells.ring(handle.job.constraint, fresh=replica is None and fresh)
        else:
            self._host.bells.ring_replica(handle.replica)
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
        host = self._host
        constraint = handle.job.constraint
        if host.fleet.will_serve(constraint):
            return False
        try:  # the view may lag a replica that just registered
            await call_retrying(host.fleet.refresh, until=until, what="read the fleet registry", nc=host.nc)
        except RollfleetError:
            raise
        except Exception as exc:  # (a forged record): a retryable error, never a raw one
            raise ServiceUnavailable(f"cannot read the fleet registry: {exc}") from exc
        if host.fleet.will_serve(constraint):
            return False
        if keyed and await host.settler.settle_stored(handle):
            handle.stored = True
            return True
        await host.refusals.note(constraint)
        if handle.waits_for_replica:
            return False
        handle.set_error(NoCompatibleReplica(no_replica_message(host.fleet, constraint)))
        return True

    async def _declare_consumer(self, constraint: VersionConstraint, replica: str | None, until: float) -> bool:
        """The consumer a job's subject needs, declared before it is stored; whether it is new."""
        consumers = self._host.consumers
        if replica is not None:
            await consumers.replica(replica, until)
            return False
        # (Declared lately, as on almost every submit: known without a coroutine and a closure.)
        if consumers.known(str(constraint)):
            return False
        return await consumers.shared(constraint, until)

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
            ack = await self._host.placement.store(handle, subject, key)
            handle.stored = True
            if not ack.duplicate:
                handle.subject, handle.stream_seq, handle.replica = subject, ack.seq, replica
            elif not await self.adopt(handle, ack.seq):
                return  # settled: it was answered already
            outcome = await handle.cancel(timeout=10.0)
            log.info("caller left while its job was stored; cancelled", idempotency_key=key, outcome=outcome)
        except RollfleetError as exc:  # (the broker away: the job's deadline still ends it)
            log.warning("caller left; its job could not be cancelled", idempotency_key=key, code=exc.code)
        finally:
            self._handles.pop(key, None)

    async def adopt(self, handle: RolloutHandle, seq: int) -> bool:
        """A resubmission within the duplicate window stored nothing: the key's job is the one
        stored earlier (by this process or one before a restart). Follow that job where it is,
        so it can still be withdrawn, moved or watched; if it is gone, take its stored answer,
        or (withdrawn unanswered) store this request again. False once the handle is settled."""
        host = self._host
        key = handle.idempotency_key
        found = await host.placement.job_at(seq)
        if found is None:  # gone: an answer stored first, or withdrawn (expired, moved)
            if await host.settler.settle_stored(handle):
                return False
            moved = f"{key}#1"  # where a moved turn of an earlier process went
            subject = host.names.job_subject(handle.job.constraint.kind, handle.job.constraint.version)
            await host.consumers.shared(handle.job.constraint)
            stored = await host.placement.store_where_it_lies(
                handle, subject, moved, answered=lambda: host.settler.settle_stored(handle)
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
        handle.adopt(job, data, subject, seq, host.names.parse_replica_job_subject(subject))
        return True
