"""How one run of a job ends on this worker, other than by generating: its answer stored and
acked, an error stored as its answer, the job found answered by another run, or the job handed
back unanswered.

The order of each ending is what keeps a job's promise: an answer (or an error) is stored before
the delivery is acked, and the claim is released last, so an answer is never lost to a crash
between them and the claim keeps a second run away until the answer is there. A run releases
only the claim it still holds.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import Any

from rollfleet.runtime import faults
from rollfleet.schemas import RolloutResult
from rollfleet.schemas.errors import Interrupted, ResultUnstorable, RollfleetError
from rollfleet.workers.job_claim import ClaimKeeper
from rollfleet.workers.result_store import ResultStore
from rollfleet.workers.running_job import RunningJob

# A job handed back waits this long before redelivery, so a pull request this worker still has
# open on its subject does not take it straight back again and again.
HAND_BACK_DELAY_S = 0.2
_HAND_BACK_CHECKPOINT_S = 2.0  # a job handed back stores its tokens so far, briefly


class RunEndings:
    """The endings of a run, between the job's answers (``ResultStore``) and its claim
    (``ClaimKeeper``); ``count`` tallies each outcome."""

    def __init__(self, results: ResultStore, claims: ClaimKeeper, count: Callable[[str], None]) -> None:
        self._results = results
        self._claims = claims
        self._count = count

    async def store_answer(self, run: RunningJob, result: RolloutResult, attempt: int, log: Any) -> bool:
        """Store the run's answer and ack its job; False where this run's answer is not the job's.

        Why no second answer can follow, whatever the duplicate window: the claim is checked
        here (refreshed by revision), yet it can still be taken between this check and the
        store (this process frozen or cut off past the claim's staleness, another replica
        judging it gone). The store itself is the fence: the broker stores the answer only
        where no answer to the job is stored (``ResultStore.store``), so of the two runs the
        first to store is the job's answer and the other is refused, in either order. The check
        stays: it stops a run that lost its claim before it spends a store. The claim is then
        released only where it is still this run's (``ClaimKeeper.release``): a taker that runs
        the job on keeps its claim until its own store is refused."""
        job = run.job
        if not await self._claims.still_holds(run):
            return False  # (said when the claim was found lost)
        faults.point("worker:before-result-store")
        try:
            stored = await self._results.store(job.client_id, job.idempotency_key, job.job_id, result)
        except ResultUnstorable as exc:
            log.error("result cannot be stored", error=exc.message)
            await self.answer_and_close(run, exc, attempt)
            return False
        if stored == "unstored":  # broker away: leave the job unacked (and claimed) so it is redelivered
            log.warning("answer not stored (the broker did not take it); the job is left to be redelivered")
            return False
        if stored == "answered":  # another run's answer came first: the job is answered, not by this run
            log.warning("another run's answer to this job is stored; this run's is not")
            await self.answered_elsewhere(run)
            self._count("answered_elsewhere")
            return False
        faults.point("worker:after-result-before-ack")
        await run.msg.ack()
        if run.progress is not None:
            await run.progress.done()
        await self._claims.release(job, run.claim_revision)
        return True

    async def answer_and_close(self, run: RunningJob, err: RollfleetError, attempt: int) -> None:
        """A job that ends here with an error: the error stored as its answer (unless another
        answer to it is stored already), the delivery acked, the claim this run holds released (in
        that order: an answer is never lost to a crash between them, and the claim keeps a second
        run away until the answer is there)."""
        job = run.job
        stored = await self._results.store_failure(job.client_id, job.idempotency_key, err, attempt, job)
        if stored == "answered":  # (another run's answer came first: that one is the job's)
            await self.answered_elsewhere(run)
            return
        await run.msg.ack()
        await self._claims.release(job, run.claim_revision)

    async def answered_elsewhere(self, run: RunningJob) -> None:
        """The job's answer is stored, and not by this run: its asker is told where it is (it may
        have asked again past the duplicate window, and its results consumer hears nothing new),
        then the delivery is acked and the claim this run holds released. A notice the broker
        did not take leaves the delivery (and the claim) to its redelivery, which finds the
        answer and tells again."""
        if not await self._results.tell_asker(run.job):
            return
        await run.msg.ack()
        await self._claims.release(run.job, run.claim_revision)

    async def hand_back(self, run: RunningJob, log: Any) -> None:
        """Return a job unanswered, as if never run: its claim is released, the broker redelivers it."""
        log.info("handed back", constraint=str(run.job.constraint))
        self._count("handed_back")
        if run.claim_lost:
            return  # the claim and the job are another replica's now
        if run.progress is not None:  # what it made so far is kept for the next run
            with suppress(RollfleetError):
                await run.progress.checkpoint(_HAND_BACK_CHECKPOINT_S)
        await self._claims.release(run.job, run.claim_revision)
        with suppress(Exception):
            await run.msg.nak(delay=HAND_BACK_DELAY_S)

    async def engine_went_down(self, run: RunningJob, detail: str, attempt: int, log: Any) -> None:
        """The engine went down under the run (``detail``: why): the job goes elsewhere instead of
        being answered with this replica's failure: handed back (replayable), or answered
        ``Interrupted`` (``at_most_once``: it had started)."""
        if run.job.behaviour.holder_gone == "interrupted":
            err = Interrupted(f"the engine of the replica running this at_most_once job went down: {detail}")
            await self.answer_and_close(run, err, attempt)
        else:
            await self.hand_back(run, log)
