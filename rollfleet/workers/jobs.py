"""Running and answering one job: decode, check, run on the engine, store the answer, ack.

A job is acked only after its answer is stored on the client's results subject, so a worker
that dies mid-job loses nothing: the broker redelivers it. A redelivered job whose answer is
already stored is acked without running again; an ``at_most_once`` job whose holder died is
answered ``Interrupted`` instead of running twice.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import suppress
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollfleet.broker.publish import publish_retrying
from rollfleet.broker.pull import delivery_info
from rollfleet.runtime import faults
from rollfleet.schemas import Limits, Names, RolloutFailure, RolloutJob, RolloutResult, check_job, decode, encode
from rollfleet.schemas.errors import EngineFailure, Expired, Interrupted, InvalidRequest, RollfleetError
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID, check_token
from rollfleet.workers.engines import Engine
from rollfleet.workers.metrics import WorkerMetrics
from rollfleet.workers.serving import ServedVersion

_RESULT_PUBLISH_BUDGET_S = 20.0  # then the job stays unacked and is redelivered


class JobRunner:
    """Runs the jobs one worker pulled. ``handle(msg)`` is one job's whole life on this worker."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        engine: Engine,
        *,
        worker_id: str,
        limits: Limits,
        ack_wait_s: float,
        metrics: WorkerMetrics,
        log: Any,
        served: ServedVersion,
    ) -> None:
        self._js = js
        self._names = names
        self._engine = engine
        self._worker_id = worker_id
        self._limits = limits
        self._ack_wait_s = ack_wait_s
        self._metrics = metrics
        self._log = log
        self._served = served
        self._held: dict[int, tuple[Msg, float]] = {}  # running jobs' messages, for progress acks
        self._holding = asyncio.Event()  # set while _held is not empty: keep_alive sleeps otherwise
        self._ids = itertools.count()
        self.jobs_done = 0
        self.outcomes: dict[str, int] = {}

    async def handle(self, msg: Msg, delivery: tuple[int, float, int] | None = None) -> None:
        headers = msg.headers or {}
        client_id = headers.get(HDR_CLIENT_ID)
        key = headers.get(HDR_MSG_ID)
        if delivery is None:  # (the worker passes what it already read off the ack subject)
            delivery = delivery_info(msg.reply)
        attempt, stored_at = (delivery[0], delivery[1]) if delivery is not None else (1, time.time())
        log = self._log.bind(idempotency_key=key, attempt=attempt)
        try:
            job = decode(msg.data, RolloutJob, max_bytes=self._limits.max_job_bytes, what="rollout job")
            check_job(job, self._limits)
            subject = self._names.parse_job_subject(msg.subject)
            if subject != (job.constraint.kind, job.constraint.version):
                raise InvalidRequest(f"job constraint {job.constraint} does not match its subject {msg.subject}")
            client_id, key = job.client_id, job.idempotency_key
            check_token(client_id, "client_id")
        except InvalidRequest as exc:
            log.warning("invalid job", error=exc.message)
            await self.answer_failure(client_id, key, exc, attempt)
            await msg.term()
            return
        log = log.bind(job_id=job.job_id, idempotency_key=job.idempotency_key, version=self._served.version)
        if not self._served.allows(job.constraint):  # only after a version change raced the pull
            await msg.nak()
            return
        if time.time() > job.deadline:
            log.info("expired before it ran")
            err = Expired("deadline passed before a worker ran it")
            await self.answer_failure(client_id, key, err, attempt, job.job_id)
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
                await self.answer_failure(client_id, key, err, attempt, job.job_id)
                await msg.ack()
                return
        await self._run(msg, job, attempt, stored_at, log)

    async def _run(self, msg: Msg, job: RolloutJob, attempt: int, stored_at: float, log: Any) -> None:
        started = time.time()
        held_id = next(self._ids)
        self._held[held_id] = (msg, time.monotonic())
        self._holding.set()
        try:
            generation = await self._engine.generate(job.job_id, job.payload)
        except RollfleetError as exc:
            log.warning("generation refused", error=exc.message, code=exc.code)
            await self.answer_failure(job.client_id, job.idempotency_key, exc, attempt, job.job_id)
            await msg.ack()
            return
        except Exception as exc:
            log.exception("engine failed")
            err = EngineFailure(f"engine {self._engine.name} failed: {exc}")
            await self.answer_failure(job.client_id, job.idempotency_key, err, attempt, job.job_id)
            await msg.ack()
            return
        finally:
            self._held.pop(held_id, None)
            if not self._held:
                self._holding.clear()
        finished = time.time()
        result = RolloutResult(
            job_id=job.job_id,
            idempotency_key=job.idempotency_key,
            client_id=job.client_id,
            outputs=generation.outputs,
            version_start=generation.version_start,
            version_end=generation.version_end,
            worker_id=self._worker_id,
            engine=self._engine.name,
            queue_wait_s=max(0.0, started - min(stored_at, job.submitted_at if job.submitted_at > 0 else stored_at)),
            generation_s=finished - started,
            delivery_attempt=attempt,
            finished_at=finished,
            session_id=job.session_id,
            prompt_tokens=generation.prompt_tokens,
        )
        if not await self._publish_outcome(job.client_id, job.idempotency_key, result):
            return  # not stored: leave the job unacked so it is redelivered
        faults.point("worker:after-result-before-ack")
        await msg.ack()
        self.jobs_done += 1
        self._count("ok")
        self._metrics.queue_wait.observe(result.queue_wait_s)
        self._metrics.generation.observe(result.generation_s)
        log.debug(
            "job done",
            version_start=result.version_start,
            version_end=result.version_end,
            generation_s=round(result.generation_s, 4),
            queue_wait_s=round(result.queue_wait_s, 4),
        )

    async def keep_alive(self) -> None:
        """In-progress acks for jobs held longer than a third of ack_wait, so a long job is not
        redelivered meanwhile. One task for all jobs: short jobs cost nothing, and an idle worker
        does not wake at all. Runs until cancelled."""
        interval = max(self._ack_wait_s / 3.0, 0.2)
        while True:
            await self._holding.wait()
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            for msg, since in list(self._held.values()):
                if now - since >= interval:
                    with suppress(Exception):
                        await msg.in_progress()

    async def _result_exists(self, client_id: str, key: str) -> bool:
        try:
            await self._js.get_last_msg(self._names.results_stream, self._names.result_subject(client_id, key))
            return True
        except nats.js.errors.NotFoundError:
            return False

    async def _publish_outcome(self, client_id: str, key: str, outcome: RolloutResult | RolloutFailure) -> bool:
        until = time.time() + _RESULT_PUBLISH_BUDGET_S
        subject = self._names.result_subject(client_id, key)
        try:
            await publish_retrying(self._js, subject, encode(outcome), {HDR_MSG_ID: key}, until=until)
        except RollfleetError as exc:
            self._log.warning("result not stored", error=exc.message, code=exc.code)
            return False
        return True

    async def answer_failure(
        self,
        client_id: str | None,
        key: str | None,
        error: RollfleetError,
        attempt: int,
        job_id: str | None = None,
    ) -> None:
        """Store a typed failure as the job's answer (dropped, with a warning, if there is no
        reply address or key to store it under)."""
        self._count(error.code)
        try:
            check_token(client_id or "", "client_id")
        except InvalidRequest:
            self._log.warning("no reply address; dropping", error=error.message)
            return
        if not key:
            self._log.warning("no idempotency key; dropping", error=error.message)
            return
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
        )
        await self._publish_outcome(client_id, key, failure)  # type: ignore[arg-type]

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self._metrics.job(outcome)
