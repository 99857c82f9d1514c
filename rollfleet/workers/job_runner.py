"""Running and answering one job: decode, check, run on the engine, store the answer, ack.

A job is acked only after its answer is stored on the client's results subject, so a worker
that dies mid-job loses nothing: the broker redelivers it. A delivery that may be a copy of an
answered job (a redelivery, a claimed job that may have been moved, any job under its caller's
key: asked again past the broker's duplicate window it is stored again, the same job;
``result_store.looked_up_first``) is looked up among the job's stored answers first; one found
answered runs nothing, stores no answer, tells its asker where the answer is
(``ResultStore.tell_asker``: the asker's results consumer would hear nothing new) and is acked.
So does a run whose answer is refused because another run's came first.

``at_most_once`` jobs, sessions' turns and exact jobs are claimed (``Names.claims_bucket``, key
``claim_key(job_id)``, value: the holder and when it last said it still runs the job) before
they start, and the claim is refreshed by revision while the job runs (so it never outlives a
long job) and removed once the answer is stored and the job acked. A delivery that finds the job
claimed:

- by a holder that refreshed the claim within twice ``ack_wait`` (it still runs the job, e.g. a
  turn the client moved off a busy replica, or a holder cut off from the broker for a moment):
  handed back with a delay, never run a second time;
- by a holder that stopped (died, or restarted under the same id), as the claim shows once it
  has also stood unchanged for a while with the broker answering (``judge_claim``: a paused
  broker stops every refresh): ``at_most_once`` is answered ``Interrupted`` (it may have
  started); a replayable job is run again, once.

A holder whose claim changed under it (this process was paused or cut off while another replica
took the job over or answered it) aborts the run and stores nothing; the claim is checked once
more, by revision, just before the answer is stored, and the store itself is refused where an
answer to the job is stored already (``ResultStore.store``), so no second answer follows even
past the broker's duplicate window, whenever the claim is lost. A run releases only the claim
it still holds.

A job handed back unrun (a version change raced its pull, or an activation's drain ran out) has
its claim removed and is served normally elsewhere.

Claims are ``claims.ClaimKeeper``'s, answers ``result_store.ResultStore``'s (one stored answer
per job however many replicas ran it), a resumable job's tokens ``resumable_run.ResumableGenerator``'s;
this module is the order of a job's life between them.

A job is admitted (registered as running) in the same step that checks its constraint against
the served version, so an activation that drains exact jobs sees every job that passed the
check. A result whose tokens fall outside the job's constraint is never stored.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from rollfleet.broker.pull_consumer import delivery_info
from rollfleet.broker.types import JetStreamContext, KeyValue, Msg
from rollfleet.runtime import faults
from rollfleet.runtime.aio import wait_event
from rollfleet.runtime.logs import debug_enabled
from rollfleet.schemas import (
    JobAddress,
    Limits,
    Names,
    RolloutResult,
    check_job,
    claim_key,
    decode_job,
    job_address,
    served_within,
)
from rollfleet.schemas.errors import (
    Cancelled,
    EngineFailure,
    Expired,
    Interrupted,
    InvalidRequest,
    ResultUnstorable,
    RollfleetError,
    Superseded,
)
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID, check_token
from rollfleet.workers.engines import Engine, Generation
from rollfleet.workers.job_claim import ClaimKeeper
from rollfleet.workers.replay_stamp import stamp
from rollfleet.workers.result_store import ResultStore, looked_up_first
from rollfleet.workers.resumable_run import ResumableGenerator
from rollfleet.workers.running_job import RunningJob
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.worker_metrics import WorkerMetrics

_HEADROOM = 16 * 1024  # message size left for headers and protocol overhead
# A job handed back waits this long before redelivery, so a pull request this worker still has
# open on its subject does not take it straight back again and again.
_HAND_BACK_DELAY_S = 0.2
_HAND_BACK_CHECKPOINT_S = 2.0  # a job handed back stores its tokens so far, briefly


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
        max_message_bytes: int,
        metrics: WorkerMetrics,
        log: Any,
        served: ServedVersion,
        claims: KeyValue,
        on_engine_down: Callable[[str], None] | None = None,
        checkpoint_tokens: int = 64,
        checkpoint_s: float = 2.0,
    ) -> None:
        self._js = js
        self._names = names
        self._engine = engine
        self._worker_id = worker_id
        self._own_subject = names.replica_job_subject(worker_id)  # sessions' turns for this replica
        self._limits = limits
        self._ack_wait_s = ack_wait_s
        self._chunk_bytes = max(1024, max_message_bytes - _HEADROOM)
        self._metrics = metrics
        self._log = log
        self._debug = debug_enabled(log)  # per-job debug lines' fields are worked out only then
        self._served = served
        self._on_engine_down = on_engine_down  # tells the worker to stop taking jobs
        # A job held elsewhere is handed back with this delay: a few hand-backs span a claim going
        # stale, well inside max_deliver.
        self._held_delay_s = max(ack_wait_s / 2.0, 0.5)
        self._running: dict[int, RunningJob] = {}
        self.claims = ClaimKeeper(
            claims,
            worker_id=worker_id,
            ack_wait_s=ack_wait_s,
            log=log,
            running=lambda: self._running.values(),
            abort=self._spawn_abort,
        )
        self.results = ResultStore(
            js, names, worker_id=worker_id, chunk_bytes=self._chunk_bytes, log=log, on_failure=self._count
        )
        self.resumable = ResumableGenerator(
            js,
            names,
            engine,
            worker_id=worker_id,
            holder=self.claims.holder,
            served=served,
            metrics=metrics,
            max_record_bytes=self._chunk_bytes + _HEADROOM,
            hand_back=self._hand_back,
            checkpoint_tokens=checkpoint_tokens,
            checkpoint_s=checkpoint_s,
        )
        self._aborts: set[asyncio.Future[None]] = set()  # engine aborts of runs that lost their claim
        self._changed = asyncio.Event()  # set whenever a running job ends
        self._holding = asyncio.Event()  # set while a job runs: keep_alive sleeps otherwise
        self._ids = itertools.count()
        self.jobs_done = 0
        self.outcomes: dict[str, int] = {}

    @property
    def running(self) -> list[RunningJob]:
        return list(self._running.values())

    def cancel(self, claim_digest: str) -> None:
        """Stop the run of the job whose ``claim_key`` is ``claim_digest``, if it runs here: its
        engine requests are aborted, and it is answered with the tokens made so far (finish
        reason "abort"), or ``Cancelled`` if it had not started generating."""
        for run in self._running.values():
            if not run.cancelled and claim_key(run.job.job_id) == claim_digest:
                run.cancelled = True
                self._log.info("job cancelled by its trainer", idempotency_key=run.job.idempotency_key)
                self._spawn_abort(run)

    async def handle(self, msg: Msg, delivery: tuple[int, float, int] | None = None) -> None:
        """Run one delivered job to its answer (or hand it back). An error nothing here expected
        (a defect, a broker error no step caught) is logged and the job handed back at once: left
        unacknowledged, it would come back only after ``ack_wait``, past most deadlines."""
        try:
            await self._handle(msg, delivery)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._log.exception("handling a job failed; handed back", subject=msg.subject, error=repr(exc))
            self._count("failed")
            with suppress(Exception):
                await msg.nak(delay=_HAND_BACK_DELAY_S)

    async def _handle(self, msg: Msg, delivery: tuple[int, float, int] | None = None) -> None:
        faults.point("worker:job-delivered")
        headers = msg.headers or {}
        client_id = headers.get(HDR_CLIENT_ID)
        key = headers.get(HDR_MSG_ID)
        if delivery is None:  # (the worker passes what it already read off the ack subject)
            delivery = delivery_info(msg.reply)
        attempt, stored_at = (delivery[0], delivery[1]) if delivery is not None else (1, time.time())
        try:
            job = decode_job(msg.data, max_bytes=self._limits.max_job_bytes)
            check_job(job, self._limits)
            subject = self._names.parse_job_subject(msg.subject)
            if msg.subject != self._own_subject and subject != (job.constraint.kind, job.constraint.version):
                raise InvalidRequest(f"job constraint {job.constraint} does not match its subject {msg.subject}")
            check_token(job.client_id, "client_id")
        except InvalidRequest as exc:
            log = self._log.bind(idempotency_key=key, attempt=attempt)
            log.warning("invalid job", error=exc.message, code=exc.code)
            # Answered under the job's own id and fingerprint wherever they can be read (a job of
            # a newer schema, a value this worker does not know): its caller accepts nothing else.
            address = job_address(msg.data) or JobAddress()
            if address.client_id and address.idempotency_key:
                client_id, key = address.client_id, address.idempotency_key
            await self.results.store_failure(
                client_id, key, exc, attempt, job_id=address.job_id, fingerprint=address.fingerprint
            )
            await msg.term()
            return
        # One logger per job, bound once (the same fields, in the same order, as binding the
        # delivery's key and attempt first, then the job's key, id and version).
        log = self._log.bind(
            idempotency_key=job.idempotency_key, attempt=attempt, job_id=job.job_id, version=self._served.version
        )
        # Check and admit in one step (no await between): a draining activation sees this job.
        if not self._served.allows(job.constraint):
            log.debug("handed back unrun", constraint=str(job.constraint))
            self._count("handed_back")
            await msg.nak(delay=_HAND_BACK_DELAY_S)
            return
        run_id = next(self._ids)
        run = self._running[run_id] = RunningJob(msg, job)
        self._holding.set()
        try:
            await self._serve(run, attempt, stored_at, log)
        finally:
            del self._running[run_id]
            if not self._running:
                self._holding.clear()
            self._changed.set()

    async def _serve(self, run: RunningJob, attempt: int, stored_at: float, log: Any) -> None:
        msg, job = run.msg, run.job
        if time.time() > job.deadline:
            log.info("expired before it ran")
            err = Expired("deadline passed before a worker ran it")
            stored = await self.results.store_failure(job.client_id, job.idempotency_key, err, attempt, job)
            if stored != "answered" or await self.results.tell_asker(job):
                await msg.ack()
            return
        guarded = job.claimed
        # A redelivery, a job that may have been moved (the same job, a new message), and a keyed
        # job (asked again past the broker's duplicate window: the same job stored again) may be
        # answered already: never run it again, and tell its asker where the answer is.
        if looked_up_first(attempt, guarded, job.idempotency_key != job.job_id) and await self.results.answered(job):
            log.info("job already answered; acking", attempt=attempt)
            if not await self.results.tell_asker(job):
                return  # (left to be redelivered: its redelivery finds the answer and tells again)
            await msg.ack()
            # Its holder may have died between storing the answer and acking: what it would have
            # cleaned up then (the checkpoints, the claim) is cleaned up here, not left for 24 h.
            if job.behaviour.checkpoints:
                await self.resumable.progress_log(job, log).roll_up_answered()
            await self.claims.release(job, only_own=False)
            return
        if guarded:
            verdict = await self.claims.claim(run)
            if verdict != "held" and await self.results.answered(job):
                # Its holder stored the answer and released the claim between the look above and
                # this claim (a redelivery racing the run it duplicates, on this replica or
                # another): the claim is ours, the job is done; never run it again.
                log.info("job answered before its claim was taken; acking", attempt=attempt)
                await self._answered_elsewhere(run)
                return
            if verdict == "held" and job.behaviour.checkpoints:
                verdict = await self.claims.await_claim(run)
                if verdict != "held" and await self.results.answered(job):  # its holder finished meanwhile
                    log.info("job answered while its claim was awaited; acking")
                    await self._answered_elsewhere(run)
                    return
            if verdict == "held":
                log.info("job held by a live replica; handed back to wait for its answer")
                self._count("held_elsewhere")
                with suppress(Exception):
                    await msg.nak(delay=self._held_delay_s)
                return
            if verdict == "stopped" and job.behaviour.holder_gone == "interrupted":
                log.info("at_most_once job redelivered after its holder started it")
                err = Interrupted("the worker that started this at_most_once job stopped; it was not run again")
                await self._answer_and_close(run, err, attempt)
                return
        if run.handed_back:  # the drain gave up on it while we were claiming
            await self._hand_back(run, log)
            return
        if run.cancelled:  # while it was being claimed: nothing generated yet
            self._count("cancelled")
            await self._answer_and_close(run, Cancelled("cancelled by its trainer before it ran"), attempt)
            return
        await self._run(run, attempt, stored_at, log)

    async def _run(self, run: RunningJob, attempt: int, stored_at: float, log: Any) -> None:
        """Generate, check and store one run's answer: each step may end the run (the claim lost,
        handed back, a checkpoint superseded), and says so in its log line."""
        job = run.job
        started = time.time()
        generation = await self._generate(run, attempt, log)
        if generation is None or run.claim_lost:
            return  # (failed and answered, or another replica has the job: nothing of this run is stored)
        if run.handed_back and not run.cancelled:  # (a cancelled run is answered, not run again)
            await self._hand_back(run, log)
            return
        result = self._result_of(run, generation, attempt, started, stored_at)
        if job.session_id is not None:
            self._metrics.session_turns.inc()
            self._metrics.prefix_tokens_reused.inc(generation.cached_tokens)
            if generation.cache_rebuilt:
                self._metrics.session_rebuilds.inc()
        if not served_within(job.constraint, result):
            # Admission and the activation drain make this impossible; never store it if it happens.
            log.error(
                "contract violation: result outside its constraint; handing the job back",
                constraint=str(job.constraint),
                version_start=result.version_start,
                version_end=result.version_end,
            )
            self._metrics.contract_violations.inc()
            await self._hand_back(run, log)
            return
        if run.progress is not None:
            # The last checkpoint comes before the answer: a run that lost the job cannot store one.
            try:
                await run.progress.checkpoint()
            except Superseded:
                log.warning("job taken over by another run; its answer is not stored")
                return
            except RollfleetError as exc:
                log.warning("last checkpoint not stored; leaving the job to be redelivered", error=exc.message)
                return
        if await self._store_answer(run, result, attempt, log):
            self._done(run, result, log)

    async def _generate(self, run: RunningJob, attempt: int, log: Any) -> Generation | None:
        """The engine's generation of the run's job; None where there is none to answer with (a
        failure already answered or left to a redelivery, or another run has the job)."""
        job = run.job
        try:
            if job.behaviour.checkpoints:
                return await self.resumable.generate(run, log)  # (None: another run has the job now)
            return await self._engine.generate(job.job_id, job.payload, job.session_id)
        except Exception as exc:
            if run.claim_lost:  # (its requests were aborted for that)
                return None
            if await self._engine_died(run, exc, attempt, log):
                return None
            if isinstance(exc, RollfleetError):
                log.warning("generation refused", error=exc.message, code=exc.code)
                err: RollfleetError = exc
            else:
                log.exception("engine failed")
                err = EngineFailure(f"engine {self._engine.name} failed: {exc}")
            if await self.claims.still_holds(run):
                await self._answer_and_close(run, err, attempt)
            return None

    def _result_of(
        self, run: RunningJob, generation: Generation, attempt: int, started: float, stored_at: float
    ) -> RolloutResult:
        """The run's answer, with its timings and its replay coordinate."""
        job = run.job
        finished = time.time()
        asked = min(stored_at, job.submitted_at if job.submitted_at > 0 else stored_at)
        return RolloutResult(
            job_id=job.job_id,
            idempotency_key=job.idempotency_key,
            client_id=job.client_id,
            outputs=generation.outputs,
            version_start=generation.version_start,
            version_end=generation.version_end,
            worker_id=self._worker_id,
            engine=self._engine.name,
            queue_wait_s=max(0.0, started - asked),
            generation_s=finished - started,
            delivery_attempt=attempt,
            finished_at=finished,
            session_id=job.session_id,
            prompt_tokens=generation.prompt_tokens,
            fingerprint=job.fingerprint,
            cached_tokens=generation.cached_tokens,
            cache_rebuilt=generation.cache_rebuilt,
            constraint=job.constraint,
            kept_tokens=run.progress.kept_tokens if run.progress is not None else 0,
            resumes=run.progress.resumes if run.progress is not None else 0,
            replay=stamp(job.payload, generation, self._engine, self._served.content_digests, self._worker_id),
        )

    async def _store_answer(self, run: RunningJob, result: RolloutResult, attempt: int, log: Any) -> bool:
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
        if not await self.claims.still_holds(run):
            return False  # (said when the claim was found lost)
        faults.point("worker:before-result-store")
        try:
            stored = await self.results.store(job.client_id, job.idempotency_key, job.job_id, result)
        except ResultUnstorable as exc:
            log.error("result cannot be stored", error=exc.message)
            await self._answer_and_close(run, exc, attempt)
            return False
        if stored == "unstored":  # broker away: leave the job unacked (and claimed) so it is redelivered
            log.warning("answer not stored (the broker did not take it); the job is left to be redelivered")
            return False
        if stored == "answered":  # another run's answer came first: the job is answered, not by this run
            log.warning("another run's answer to this job is stored; this run's is not")
            await self._answered_elsewhere(run)
            self._count("answered_elsewhere")
            return False
        faults.point("worker:after-result-before-ack")
        await run.msg.ack()
        if run.progress is not None:
            await run.progress.done()
        await self.claims.release(job, run.claim_revision)
        return True

    def _done(self, run: RunningJob, result: RolloutResult, log: Any) -> None:
        self.jobs_done += 1
        self._count("cancelled" if run.cancelled else "ok")
        self._metrics.queue_wait.observe(result.queue_wait_s)
        self._metrics.generation.observe(result.generation_s)
        if self._debug:
            log.debug(
                "job done",
                version_start=result.version_start,
                version_end=result.version_end,
                generation_s=round(result.generation_s, 4),
                queue_wait_s=round(result.queue_wait_s, 4),
            )

    async def _engine_died(self, run: RunningJob, exc: BaseException, attempt: int, log: Any) -> bool:
        """A generation failed because the engine is down (its server died or hangs), not because of
        the job: the replica stops taking jobs, and the job goes elsewhere instead of being
        answered with this replica's failure: handed back (replayable), or answered
        ``Interrupted`` (``at_most_once``: it had started). True when handled so."""
        try:
            health = await asyncio.wait_for(self._engine.health(), 10.0)
            ok, detail = health.ok, health.detail
        except Exception as probe:
            ok, detail = False, f"health check failed: {probe}"
        if ok:
            return False
        log.warning("engine down under a running job; not answering it here", error=str(exc), engine=detail)
        if self._on_engine_down is not None:
            self._on_engine_down(detail)
        job = run.job
        if job.behaviour.holder_gone == "interrupted":
            err = Interrupted(f"the engine of the replica running this at_most_once job went down: {detail}")
            await self._answer_and_close(run, err, attempt)
        else:
            await self._hand_back(run, log)
        return True

    # -- activations: draining exact jobs -------------------------------------------------------

    async def drain_exact(self, version: int, bound_s: float) -> tuple[float, int]:
        """Wait until no admitted ``exact-<version>`` job is running; past ``bound_s``, abort
        them and hand them back unanswered (another replica at that version may serve them).
        Returns (seconds waited, jobs handed back)."""
        t0 = time.monotonic()

        def pinned() -> list[RunningJob]:
            return [
                r
                for r in self._running.values()
                if r.job.constraint.kind == "exact" and r.job.constraint.version == version and not r.handed_back
            ]

        deadline = t0 + bound_s
        while pinned() and time.monotonic() < deadline:
            self._changed.clear()
            await wait_event(self._changed, max(0.0, deadline - time.monotonic()))
        late = pinned()
        for run in late:
            run.handed_back = True
            await run.abort(self._engine)
        while any(r.handed_back for r in self._running.values()):  # until they have unwound (nak)
            self._changed.clear()
            await wait_event(self._changed, 1.0)
        return time.monotonic() - t0, len(late)

    async def _answer_and_close(self, run: RunningJob, err: RollfleetError, attempt: int) -> None:
        """A job that ends here with an error: the error stored as its answer (unless another
        answer to it is stored already), the delivery acked, the claim this run holds released (in
        that order: an answer is never lost to a crash between them, and the claim keeps a second
        run away until the answer is there)."""
        job = run.job
        stored = await self.results.store_failure(job.client_id, job.idempotency_key, err, attempt, job)
        if stored == "answered":  # (another run's answer came first: that one is the job's)
            await self._answered_elsewhere(run)
            return
        await run.msg.ack()
        await self.claims.release(job, run.claim_revision)

    async def _answered_elsewhere(self, run: RunningJob) -> None:
        """The job's answer is stored, and not by this run: its asker is told where it is (it may
        have asked again past the duplicate window, and its results consumer hears nothing new),
        then the delivery is acked and the claim this run holds released. A notice the broker
        did not take leaves the delivery (and the claim) to its redelivery, which finds the
        answer and tells again."""
        if not await self.results.tell_asker(run.job):
            return
        await run.msg.ack()
        await self.claims.release(run.job, run.claim_revision)

    def _spawn_abort(self, run: RunningJob) -> None:
        task = asyncio.ensure_future(run.abort(self._engine))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _hand_back(self, run: RunningJob, log: Any) -> None:
        """Return a job unanswered, as if never run: its claim is released, the broker redelivers it."""
        log.info("handed back", constraint=str(run.job.constraint))
        self._count("handed_back")
        if run.claim_lost:
            return  # the claim and the job are another replica's now
        if run.progress is not None:  # what it made so far is kept for the next run
            with suppress(RollfleetError):
                await run.progress.checkpoint(_HAND_BACK_CHECKPOINT_S)
        await self.claims.release(run.job, run.claim_revision)
        with suppress(Exception):
            await run.msg.nak(delay=_HAND_BACK_DELAY_S)

    # -- answers ---------------------------------------------------------------------------------

    async def keep_alive(self) -> None:
        """In-progress acks for jobs held longer than a third of ack_wait, so a long job is not
        redelivered meanwhile. One task for all jobs: short jobs cost nothing, and an idle worker
        does not wake at all. Runs until cancelled."""
        interval = max(self._ack_wait_s / 3.0, 0.2)
        while True:
            await self._holding.wait()
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            for run in list(self._running.values()):
                if now - run.since >= interval:
                    with suppress(Exception):
                        await run.msg.in_progress()
            await self.claims.refresh(now)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self._metrics.job(outcome)
