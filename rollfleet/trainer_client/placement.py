"""Where a job lies in the jobs stream, and how it is moved: the client's job mechanics.

A handle knows its job's subject and stream sequence (``RolloutHandle``). ``JobPlacement``
stores a job there, reads a stored one back, withdraws it, tells whether a worker was ever
delivered it, moves it off a replica's own subject or stores it again, and reads and marks the
job's claim (who holds it). Sessions decide *when* a turn moves (``sessions.sticky``); this
says *how*. It implements ``sessions.host.TurnPlacement``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from rollfleet.broker.buckets import open_bucket
from rollfleet.broker.claims_bucket import ClaimsBucket
from rollfleet.broker.errors import typed_errors
from rollfleet.broker.requests import ask
from rollfleet.broker.retry_publish import publish_retrying
from rollfleet.broker.stream_reads import consumer_state, delivered_through, message_at, remove_message
from rollfleet.broker.types import NATS, JetStreamContext
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Claim, Names, RolloutJob, VersionConstraint, decode
from rollfleet.schemas.errors import BrokerError, BrokerTimeout, Fenced, NoResponders, NotFound, RollfleetError
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.placement_rules import Withdrawal, after_withdrawal
from rollfleet.trainer_client.withdrawn import WithdrawnKeys

log = get_logger("rollfleet.client")


PUBLISH_BUDGET_S = 30.0  # how long storing a job keeps trying while the broker recovers
_LISTENING_S = 0.25  # a live replica lets a probe go unanswered this long


class JobPlacement:
    def __init__(
        self,
        client_id: str,
        js: JetStreamContext,
        nc: NATS,
        names: Names,
        fleet: FleetView,
        metrics: ClientMetrics,
        *,
        declare_shared: Callable[[VersionConstraint], Awaitable[bool]],
        declare_replica: Callable[[str], Awaitable[bool]],
        ring: Callable[[VersionConstraint], None],
        forget: Callable[[str], None],
        settle_stored: Callable[[RolloutHandle], Awaitable[bool]] | None = None,
        duplicate_window_s: float = 600.0,
    ) -> None:
        self.client_id = client_id
        self.fleet = fleet
        self.metrics = metrics
        self._js, self._nc, self._names = js, nc, names
        self._declare_shared = declare_shared  # a shared subject's consumer exists (created if not)
        self._declare_replica = declare_replica  # a replica's own consumer, declared again
        self._ring = ring  # a replica rung for a job just stored on a shared subject
        self._forget = forget  # the client stops waiting for a key (its handle failed here)
        self._settle_stored = settle_stored  # the handle settled with its stored answer, if one is stored
        self._claims_bucket: ClaimsBucket | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.probe_reply = ""  # where "no responders" to a probe comes back (set by the client)
        self.withdrawn = WithdrawnKeys(duplicate_window_s)  # keys still bound to a withdrawn request
        self._connected_at = time.time()  # when the connection last came up (``note_reconnected``)

    # -- storing, reading, withdrawing ----------------------------------------------------------
    async def store(self, handle: RolloutHandle, subject: str, msg_id: str) -> Any:
        """Store the handle's job bytes on ``subject`` under the message id ``msg_id``; the ack."""
        headers = {HDR_MSG_ID: msg_id, HDR_CLIENT_ID: self.client_id}
        until = min(handle.job.deadline, time.time() + PUBLISH_BUDGET_S)
        return await publish_retrying(self._js, subject, handle.data, headers, until=until)

    async def _read_job(self, seq: int) -> tuple[RolloutJob, bytes, str]:
        """The job stored at ``seq`` of the jobs stream; raises ``NotFound`` if nothing lies there,
        another ``BrokerError`` if it did not answer, ``RollfleetError`` if the bytes are no job."""
        raw = await message_at(self._js, self._names.jobs_stream, seq)
        return decode(raw.data or b"", RolloutJob, what="stored job"), raw.data or b"", raw.subject or ""

    async def job_at(self, seq: int) -> tuple[RolloutJob, bytes, str] | None:
        """The job stored at ``seq`` of the jobs stream, if it is still there."""
        try:
            return await self._read_job(seq)
        except RollfleetError:  # (the broker's errors are ones)
            return None

    async def store_where_it_lies(
        self,
        handle: RolloutHandle,
        subject: str,
        msg_id: str,
        answered: Callable[[], Awaitable[bool]] | None = None,
    ) -> tuple[Any, tuple[RolloutJob, bytes, str] | None] | None:
        """Store the job under ``msg_id`` so that it lies somewhere: (the broker's ack, the copy
        already stored under that id if the broker took this for its duplicate and it still lies
        there). An earlier process (a trainer before its restart) may have stored a copy under the
        same id within the duplicate window that is gone since (answered, withdrawn, moved): the
        broker stores nothing then, so the job is stored under an id of its own, unless
        ``answered`` finds the request answered meanwhile (None: the handle is settled)."""
        ack = await self.store(handle, subject, msg_id)
        if not ack.duplicate:
            return ack, None
        found = await self.job_at(ack.seq)
        if found is not None:
            return ack, found
        if answered is not None and await answered():
            return None
        return await self.store(handle, subject, f"{msg_id}-{uuid.uuid4().hex[:12]}"), None

    async def withdraw(self, handle: RolloutHandle) -> Withdrawal:
        """Remove the stored job (queued, or held by a worker that will find it gone when it acks):
        ``removed``; ``gone`` if its own job no longer lies where it was stored (taken and
        acknowledged, so answered, or lost with the broker's store); ``unknown`` if the broker did
        not answer (or the handle was never stored)."""
        if handle.stream_seq is None:
            return "unknown"
        # A sequence names this job only until the broker goes back to an older copy of its store,
        # which hands the sequences after the copy's end to new jobs: what lies there is removed
        # only if it is this job (a withdrawal after a rollback must not take another's job).
        try:
            if (await self._read_job(handle.stream_seq))[0].job_id != handle.job_id:
                return "gone"
        except NotFound:  # nothing there
            return "gone"
        except BrokerError:
            return "unknown"
        except RollfleetError:  # not a job
            return "gone"
        try:
            return "removed" if await remove_message(self._js, self._names.jobs_stream, handle.stream_seq) else "gone"
        except NotFound:  # taken (acknowledged and removed) just now
            return "gone"
        except BrokerError:
            return "unknown"

    async def delete(self, handle: RolloutHandle) -> bool:
        """``withdraw``: whether this call removed the job. A key whose job is withdrawn stays
        bound to its request for the duplicate window (``WithdrawnKeys``)."""
        removed = await self.withdraw(handle) == "removed"
        if removed:
            self.withdrawn.note(handle.idempotency_key, handle.job.fingerprint, time.monotonic())
        return removed

    async def _free_to_store_again(self, handle: RolloutHandle) -> bool:
        """Whether the job may be stored again elsewhere: this call withdrew it, or it is gone
        unanswered (lost with the broker's store: a turn that waits for it would wait out its
        deadline). Gone because a worker answered it (a worker stores its answer before it
        acknowledges), the stored answer settles the handle here instead."""
        decision = after_withdrawal(await self.withdraw(handle), handle.done(), self._settle_stored is not None)
        if decision != "ask_if_answered":
            return decision == "store_again"
        assert self._settle_stored is not None
        try:
            with typed_errors():  # (the client's reads of stored answers)
                return not await self._settle_stored(handle)
        except RollfleetError:
            return False  # the broker did not answer: the next look decides

    async def taken(self, handle: RolloutHandle) -> bool:
        """Whether a worker was ever delivered the job where it is stored now (False while the
        broker does not answer: the next look decides)."""
        return bool(await self.delivered(handle))

    async def delivered(self, handle: RolloutHandle) -> bool | None:
        """Whether a worker was ever delivered the job where it is stored now: its subject's
        consumer delivers in stream order, so a job stored after the last delivered one was never
        delivered. None if the broker did not answer. A replica consumer found missing is
        declared again (then nothing was taken)."""
        if handle.stream_seq is None:
            return True  # nowhere we know of: leave it be
        names = self._names
        consumer = (
            names.replica_consumer(handle.replica)
            if handle.replica is not None
            else names.job_consumer(handle.job.constraint.kind, handle.job.constraint.version)
        )
        try:
            info = await consumer_state(self._js, names.jobs_stream, consumer)
        except NotFound:
            if handle.replica is None:
                return None  # a shared consumer deleted: what it delivered before is unknown
            with suppress(RollfleetError):
                await self._declare_replica(handle.replica)
            return False
        except BrokerError:
            return None  # the broker is away
        return delivered_through(info) >= handle.stream_seq

    # -- moving --------------------------------------------------------------------------------
    async def move_to_shared(self, handle: RolloutHandle) -> bool:
        """Withdraw a turn from its replica's own subject and store the same job (the same bytes,
        so the same job id: one answer wherever it runs) on the shared subject of its constraint;
        False if it could not be withdrawn (already answered, or the broker did not answer). A job
        lost with the broker's store is stored again all the same. If it cannot be stored again,
        the handle fails with that (retryable) error. A job its caller cancelled stays put."""
        async with handle.placing:  # (one change of where it lies at a time, a cancel's included)
            if handle.replica is None or handle.done() or handle.cancelled:
                return False
            constraint = handle.job.constraint
            try:
                await self._declare_shared(constraint)  # before the withdrawal: nothing to lose yet
            except RollfleetError:
                return False  # left where it is; the watch tries again
            if not await self._free_to_store_again(handle):
                return False
            handle.replica = None
            return await self._store_again(handle, self._names.job_subject(constraint.kind, constraint.version))

    async def requeue(self, handle: RolloutHandle) -> bool:
        """Store the job (the same bytes) again on the shared subject it lies on, withdrawing the
        copy a dead holder was delivered (or none, if the broker's store lost it); False if it
        could not be withdrawn (it was answered, or the broker did not answer). A job its caller
        cancelled stays put."""
        async with handle.placing:  # (one change of where it lies at a time, a cancel's included)
            if handle.replica is not None or handle.done() or handle.subject is None or handle.cancelled:
                return False
            if not await self._free_to_store_again(handle):
                return False
            return await self._store_again(handle, handle.subject)

    async def _store_again(self, handle: RolloutHandle, subject: str) -> bool:
        handle.moves += 1
        key = handle.idempotency_key
        try:
            stored = await self.store_where_it_lies(handle, subject, f"{key}#{handle.moves}")
            assert stored is not None  # (no ``answered`` to say otherwise)
            ack = stored[0]
        except RollfleetError as exc:
            self._forget(key)
            handle.set_error(exc)
            return True
        handle.subject, handle.stream_seq = subject, ack.seq
        self._ring(handle.job.constraint)
        log.info("job stored again", idempotency_key=key, moves=handle.moves, subject=subject)
        return True

    # -- who holds it --------------------------------------------------------------------------
    def note_reconnected(self) -> None:
        """The client's connection came up again (its reconnect hook)."""
        self._connected_at = time.time()

    def connected_since(self) -> float | None:
        """When this client's connection to the broker last came up (its wall clock); None while it
        is down (``placement_rules.HolderWatch`` judges nothing then)."""
        return self._connected_at if self._nc.is_connected else None

    def probe(self, worker_id: str) -> None:
        """Ask whether the replica's connection is alive (no responders: it is marked gone)."""
        task = asyncio.ensure_future(
            self._nc.publish(self._names.bell_subject(worker_id), Names.PROBE_BELL, reply=self.probe_reply)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _claims(self) -> ClaimsBucket:
        if self._claims_bucket is None:
            self._claims_bucket = ClaimsBucket((await open_bucket(self._js, self._names.claims_bucket)).kv)
        return self._claims_bucket

    async def holder(self, handle: RolloutHandle, *, strict: bool = False) -> Claim | None:
        """The job's claim, naming the process holding it; None if unclaimed or marked stopped
        (``strict``: a broker error is raised, not taken for "unclaimed")."""
        try:
            entry = await (await self._claims()).get(handle.job_id)
        except BrokerError:
            if strict:
                raise
            return None
        if entry is None:
            return None
        claim = Claim.decode(entry.value)
        return None if claim.stopped else claim

    async def holder_stopped(self, handle: RolloutHandle, worker_id: str | None = None) -> bool:
        """Mark the claim of a job whose holder is gone as stopped (refreshed at time 0), so the
        replica that takes it over acts at once; the claim itself stays (an ``at_most_once`` job
        is then answered ``Interrupted``, never run twice). Marked only if the holder's connection
        is gone now, and only over the claim as read before asking."""
        try:
            claims = await self._claims()
            entry = await claims.get(handle.job_id)
            if entry is None:
                return False  # no claim: it never started
            claim = Claim.decode(entry.value)
            if claim.stopped or (worker_id is not None and claim.worker_id != worker_id):
                return False
            if await self.listening(claim.worker_id) is not False:
                return False  # a process of that replica is connected (perhaps a new one), or no answer
            await claims.mark_stopped(handle.job_id, claim, entry.revision)
            return True
        except (Fenced, BrokerError):
            return False  # it changed since (one verdict wins), or the broker did not say: nothing to say

    async def listening(self, worker_id: str) -> bool | None:
        """Whether some process listens on the replica's bell now (the broker answers "no
        responders" at once when none does; a live one lets the probe time out); None if the
        request could not be made (the connection down)."""
        try:
            await ask(self._nc, self._names.bell_subject(worker_id), Names.PROBE_BELL, timeout=_LISTENING_S)
        except NoResponders:
            return False
        except (BrokerTimeout, TimeoutError):
            return True
        except BrokerError:
            return None
        return True
