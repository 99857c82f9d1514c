"""Whether a delivered job runs here at all, looked at before its engine is asked for anything:
past its deadline (answered ``Expired``), answered already (its asker told where), claimed by a
live holder (handed back to wait for its answer), or started by a holder that stopped (an
``at_most_once`` job is answered ``Interrupted``; a replayable one runs again, once).

A redelivery, a job that may have been moved (the same job, a new message), and a keyed job
(asked again past the broker's duplicate window: the same job stored again) may be answered
already: never run it again (``result_store.looked_up_first``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from rollfleet.schemas.errors import Expired, Interrupted
from rollfleet.workers.job_claim import ClaimKeeper
from rollfleet.workers.result_store import ResultStore, looked_up_first
from rollfleet.workers.resumable_run import ResumableGenerator
from rollfleet.workers.run_endings import RunEndings
from rollfleet.workers.running_job import RunningJob


class RunGate:
    """The looks a delivery passes before it runs; each that stops it ends the delivery."""

    def __init__(
        self,
        results: ResultStore,
        claims: ClaimKeeper,
        endings: RunEndings,
        resumable: ResumableGenerator,
        count: Callable[[str], None],
        *,
        ack_wait_s: float,
    ) -> None:
        self._results = results
        self._claims = claims
        self._endings = endings
        self._resumable = resumable
        self._count = count
        # A job held elsewhere is handed back with this delay: a few hand-backs span a claim going
        # stale, well inside max_deliver.
        self._held_delay_s = max(ack_wait_s / 2.0, 0.5)

    async def admits(self, run: RunningJob, attempt: int, log: Any) -> bool:
        """True where the run may go on (its claim taken, where the job is claimed)."""
        msg, job = run.msg, run.job
        if time.time() > job.deadline:
            log.info("expired before it ran")
            err = Expired("deadline passed before a worker ran it")
            stored = await self._results.store_failure(job.client_id, job.idempotency_key, err, attempt, job)
            if stored != "answered" or await self._results.tell_asker(job):
                await msg.ack()
            return False
        guarded = job.claimed
        # A redelivery, a job that may have been moved (the same job, a new message), and a keyed
        # job (asked again past the broker's duplicate window: the same job stored again) may be
        # answered already: never run it again, and tell its asker where the answer is.
        if looked_up_first(attempt, guarded, job.idempotency_key != job.job_id) and await self._results.answered(job):
            log.info("job already answered; acking", attempt=attempt)
            if not await self._results.tell_asker(job):
                return False  # (left to be redelivered: its redelivery finds the answer and tells again)
            await msg.ack()
            # Its holder may have died between storing the answer and acking: what it would have
            # cleaned up then (the checkpoints, the claim) is cleaned up here, not left for 24 h.
            if job.behaviour.checkpoints:
                await self._resumable.progress_log(job, log).roll_up_answered()
            await self._claims.release(job, only_own=False)
            return False
        return not guarded or await self._claimed(run, attempt, log)

    async def _claimed(self, run: RunningJob, attempt: int, log: Any) -> bool:
        """Take the job's claim: True where this run holds it and may run the job."""
        job = run.job
        verdict = await self._claims.claim(run)
        if verdict != "held" and await self._results.answered(job):
            # Its holder stored the answer and released the claim between the look above and
            # this claim (a redelivery racing the run it duplicates, on this replica or
            # another): the claim is ours, the job is done; never run it again.
            log.info("job answered before its claim was taken; acking", attempt=attempt)
            await self._endings.answered_elsewhere(run)
            return False
        if verdict == "held" and job.behaviour.checkpoints:
            verdict = await self._claims.await_claim(run)
            if verdict != "held" and await self._results.answered(job):  # its holder finished meanwhile
                log.info("job answered while its claim was awaited; acking")
                await self._endings.answered_elsewhere(run)
                return False
        if verdict == "held":
            log.info("job held by a live replica; handed back to wait for its answer")
            self._count("held_elsewhere")
            with suppress(Exception):
                await run.msg.nak(delay=self._held_delay_s)
            return False
        if verdict == "stopped" and job.behaviour.holder_gone == "interrupted":
            log.info("at_most_once job redelivered after its holder started it")
            err = Interrupted("the worker that started this at_most_once job stopped; it was not run again")
            await self._endings.answer_and_close(run, err, attempt)
            return False
        return True
