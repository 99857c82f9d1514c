"""A job's answer on the results stream: whether one is stored (by any replica), storing one
(in chunks when it is too large for a message), and storing a typed failure as the answer.

Answers are stored on a subject that names the job and this worker (``Names.result_subject``;
the broker lets a worker publish only under its own id) with the message id ``h:<job>``, so a
job has one stored answer however many replicas ran it.

The message id only hides a second answer within the broker's duplicate window. An answer's head
is therefore stored on a condition the broker checks as it stores it: that nothing is stored yet
on any of the job's answer subjects (``Nats-Expected-Last-Subject-Sequence: 0`` over
``Names.results_of_job``, a wildcard naming every replica's). The first answer stored is the
job's one answer, however late a second comes: a run paused between its last claim check and its
store, while another replica took the job and answered it, is refused (``answered``, decided from
what is stored by ``after_refusal``), not stored beside it.

The broker's duplicate window also ends: a key asked again after it (a trainer restarted, a
gateway that does not remember the answer) is stored again as the same job, under the key's one
job id. Such a copy is never run: a delivery that may be one (``looked_up_first``: every keyed
job, and any redelivery or claimed job) is looked up among the job's stored answers first, and one
found answered runs nothing and stores no answer. Its asker, whose results consumer would hear
nothing new, is told instead (``tell_asker``: an ``AnsweredNotice`` below this replica's own
answer subject), and reads the stored answer itself, judged as any answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Literal

import xxhash

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.retry_publish import publish_retrying
from rollfleet.broker.stream_reads import next_stored
from rollfleet.broker.types import JetStreamContext
from rollfleet.runtime import faults
from rollfleet.schemas import (
    AnsweredNotice,
    ChunkedOutcome,
    Names,
    RolloutFailure,
    RolloutJob,
    RolloutResult,
    encode,
    job_token,
)
from rollfleet.schemas.errors import BrokerError, Fenced, InvalidRequest, ResultUnstorable, RollfleetError
from rollfleet.schemas.names import HDR_MSG_ID, check_token

RESULT_PUBLISH_BUDGET_S = 20.0  # then the job stays unacked and is redelivered
# A store on the condition that the subjects named by the second header hold nothing yet.
_EXPECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
_EXPECT_ON = "Nats-Expected-Last-Subject-Sequence-Subject"

# "stored": this answer is the job's; "answered": another answer to the job is stored and this
# one is not (nor will it ever be); "unstored": the broker stayed away (the job is left to be
# redelivered, and its redelivery finds whatever answer is stored).
StoreOutcome = Literal["stored", "answered", "unstored"]


def looked_up_first(attempt: int, claimed: bool, keyed: bool) -> bool:
    """Whether a delivered job is looked up among its stored answers before it runs: a redelivery
    (its holder may have stored the answer and died before acking), a claimed job (it may have
    been moved: the same job, a new message), and any job under its caller's own key (asked again
    past the broker's duplicate window, or after a restart of the broker, it is stored again as the
    same job). A keyless job's key is its random job id, stored once by the process that made it:
    its first delivery is never answered, and costs no look-up."""
    return attempt > 1 or claimed or keyed


def after_refusal(stored_head: bytes | None, ours: bytes) -> StoreOutcome:
    """What a conditional store the broker refused means: the job's first stored answer head is
    this very one (``ours``: an earlier attempt of the same store, stored though its acknowledgement
    was lost), another answer, or nothing readable (None: aged out, or the broker did not say)."""
    if stored_head is None:
        return "unstored"
    return "stored" if stored_head == ours else "answered"


class ResultStore:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        *,
        worker_id: str,
        chunk_bytes: int,
        log: Any,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self._js = js
        self._on_failure = on_failure  # counts each failure stored, by its code
        self._names = names
        self._worker_id = worker_id
        self._chunk_bytes = chunk_bytes
        self._log = log

    async def answered(self, job: RolloutJob) -> bool:
        """Whether an answer to this job is stored (by any replica)."""
        subject = self._names.results_of_job(job.client_id, job.idempotency_key, job.job_id)
        return await next_stored(self._js, self._names.results_stream, subject) is not None

    async def tell_asker(self, job: RolloutJob) -> bool:
        """Tell the job's asker that its answer is stored already and this delivery ran nothing
        (``AnsweredNotice``); False if the broker did not take it (the delivery is then left to be
        redelivered, which finds the answer and tells again)."""
        head = self._names.result_subject(job.client_id, job.idempotency_key, job.job_id, self._worker_id)
        notice = AnsweredNotice(idempotency_key=job.idempotency_key, client_id=job.client_id, job_id=job.job_id)
        headers = {HDR_MSG_ID: f"n:{uuid.uuid4().hex}"}  # (one per notice: a retried publish is stored once)
        try:
            await publish_retrying(
                self._js,
                self._names.answered_notice_subject(head),
                encode(notice),
                headers,
                until=time.time() + RESULT_PUBLISH_BUDGET_S,
            )
        except RollfleetError as exc:
            self._log.warning("the asker of an answered job not told", error=exc.message, code=exc.code)
            return False
        return True

    async def store(
        self, client_id: str, key: str, job_id: str | None, outcome: RolloutResult | RolloutFailure
    ) -> StoreOutcome:
        """Store an answer, unless one to the job is stored already; one too large for a message
        goes in chunks, then a ChunkedOutcome head. ResultUnstorable if the broker refuses the
        answer for good."""
        until = time.time() + RESULT_PUBLISH_BUDGET_S
        data = encode(outcome)
        head_subject = self._names.result_subject(client_id, key, job_id, self._worker_id)
        # One answer per job: the head's message id names the job (an undecodable job: its key),
        # and the head is stored only where no answer to the job is (an undecodable job has no id
        # to gather its answers by: the message id alone).
        headers = {HDR_MSG_ID: f"h:{job_token(job_id)}" if job_id is not None else f"h:{key}:{self._worker_id}"}
        answers_of_job = None if job_id is None else self._names.results_of_job(client_id, key, job_id)
        if answers_of_job is not None:
            headers[_EXPECT_SEQ], headers[_EXPECT_ON] = "0", answers_of_job
        try:
            if len(data) > self._chunk_bytes:
                nonce = uuid.uuid4().hex
                parts = [data[i : i + self._chunk_bytes] for i in range(0, len(data), self._chunk_bytes)]
                for i, part in enumerate(parts):
                    subject = self._names.result_chunk_subject(head_subject, nonce, i)
                    await publish_retrying(self._js, subject, part, {HDR_MSG_ID: f"c:{nonce}:{i}"}, until=until)
                    faults.point("worker:mid-chunks")
                head = ChunkedOutcome(
                    idempotency_key=key,
                    client_id=client_id,
                    job_id=outcome.job_id,
                    chunks=len(parts),
                    size=len(data),
                    digest=xxhash.xxh3_128_hexdigest(data),
                    nonce=nonce,
                )
                data = encode(head)
            await publish_retrying(self._js, head_subject, data, headers, until=until)
        except Fenced:
            assert answers_of_job is not None  # (only a conditional store is fenced)
            try:
                with typed_errors():
                    first = await next_stored(self._js, self._names.results_stream, answers_of_job)
            except (BrokerError, TimeoutError) as exc:  # the broker did not say
                self._log.warning("answer refused; the stored one not read", error=str(exc))
                return "unstored"
            return after_refusal(None if first is None else first.data, data)
        except InvalidRequest as exc:
            raise ResultUnstorable(f"the broker refuses an answer of {len(data)} bytes: {exc.message}") from exc
        except RollfleetError as exc:
            self._log.warning("result not stored", error=exc.message, code=exc.code)
            return "unstored"
        return "stored"

    async def store_failure(
        self,
        client_id: str | None,
        key: str | None,
        error: RollfleetError,
        attempt: int,
        job: RolloutJob | None = None,
        job_id: str | None = None,
        fingerprint: str = "",
    ) -> StoreOutcome:
        """Store a typed failure as the job's answer (dropped, with a warning, if there is no
        reply address or key to store it under: "unstored"). Without ``job``: the ``job_id`` and
        ``fingerprint`` read from a job that did not decode, if any."""
        job_id = job.job_id if job is not None else job_id
        if self._on_failure is not None:
            self._on_failure(error.code)
        try:
            check_token(client_id or "", "client_id")
        except InvalidRequest:
            self._log.warning("no reply address; dropping", error=error.message)
            return "unstored"
        if not key:
            self._log.warning("no idempotency key; dropping", error=error.message)
            return "unstored"
        failure = RolloutFailure(
            idempotency_key=key,
            client_id=client_id,  # type: ignore[arg-type]
            code=error.code,
            message=error.message,
            retryable=error.retryable,
            job_id=job_id,
            worker_id=self._worker_id,
            delivery_attempt=attempt,
            finished_at=time.time(),
            fingerprint=job.fingerprint if job else fingerprint,
        )
        with suppress(ResultUnstorable):  # a failure is small; nothing more to say if it is refused
            return await self.store(client_id, key, job_id, failure)  # type: ignore[arg-type]
        return "unstored"
