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
what a delivery must be is ``delivery_check``'s, whether it runs at all ``run_gate.RunGate``'s, how a
run ends other than by generating ``run_endings.RunEndings``', its answer ``job_result.result_of``,
an activation's drain ``exact_drain``'s; this module is the order of a job's life between them.

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
from rollfleet.runtime.logs import debug_enabled
from rollfleet.schemas import Limits, Names, RolloutResult, claim_key, served_within
from rollfleet.schemas.errors import (
    Cancelled,
    EngineFailure,
    InvalidRequest,
    RollfleetError,
    Superseded,
)
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID
from rollfleet.workers.delivery_check import checked_job, refusal_address
from rollfleet.workers.engines import Engine, Generation
from rollfleet.workers.engines.base import check_engine_takes
from rollfleet.workers.exact_drain import drain_exact
from rollfleet.workers.job_claim import ClaimKeeper
from rollfleet.workers.job_result import result_of
from rollfleet.workers.recent_cancels import RecentCancels
from rollfleet.workers.result_store import ResultStore
from rollfleet.workers.resumable_run import ResumableGenerator
from rollfleet.workers.run_endings import HAND_BACK_DELAY_S, RunEndings
from rollfleet.workers.run_gate import RunGate
from rollfleet.workers.running_job import RunningJob
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.worker_metrics import WorkerMetrics

_HEADROOM = 16 * 1024  # message size left for headers and protocol overhead


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
        self._js, self._names, self._engine, self._worker_id = js, names, engine, worker_id
        self._own_subject = names.replica_job_subject(worker_id)  # sessions' turns for this replica
        self._limits, self._ack_wait_s = limits, ack_wait_s
        self._chunk_bytes = max(1024, max_message_bytes - _HEADROOM)
        self._metrics, self._log = metrics, log
        self._debug = debug_enabled(log)  # per-job debug lines' fields are worked out only then
        self._served = served
        self._on_engine_down = on_engine_down  # tells the worker to stop taking jobs
        self._running: dict[int, RunningJob] = {}
        self._recent_cancels = RecentCancels()
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
        self.endings = RunEndings(self.results, self.claims, self._count)
        self.resumable = ResumableGenerator(
            js,
            names,
            engine,
            worker_id=worker_id,
            holder=self.claims.holder,
            served=served,
            metrics=metrics,
            max_record_bytes=self._chunk_bytes + _HEADROOM,
            hand_back=self.endings.hand_back,
            checkpoint_tokens=checkpoint_tokens,
            checkpoint_s=checkpoint_s,
        )
        self.gate = RunGate(self.results, self.claims, self.endings, self.resumable, self._count, ack_wait_s=ack_wait_s)
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
        matched = False
        for run in self._running.values():
            if claim_key(run.job.job_id) == claim_digest:
                matched = True
                if not run.cancelled:
                    run.cancelled = True
                    self._log.info("job cancelled by its trainer", idempotency_key=run.job.idempotency_key)
                    self._spawn_abort(run)
        if not matched:  # (its delivery may be handled after this: kept, see recent_cancels)
            self._recent_cancels.note(claim_digest, time.monotonic())

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
                await msg.nak(delay=HAND_BACK_DELAY_S)

    async def _handle(self, msg: Msg, delivery: tuple[int, float, int] | None = None) -> None:
        faults.point("worker:job-delivered")
        headers = msg.headers or {}
        client_id = headers.get(HDR_CLIENT_ID)
        key = headers.get(HDR_MSG_ID)
        if delivery is None:  # (the worker passes what it already read off the ack subject)
            delivery = delivery_info(msg.reply)
        attempt, stored_at = (delivery[0], delivery[1]) if delivery is not None else (1, time.time())
        try:
            job = checked_job(
                msg.data, msg.subject, limits=self._limits, names=self._names, own_subject=self._own_subject
            )
        except InvalidRequest as exc:
            log = self._log.bind(idempotency_key=key, attempt=attempt)
            log.warning("invalid job", error=exc.message, code=exc.code)
            # Answered under the job's own id and fingerprint wherever they can be read (a job of
            # a newer schema, a value this worker does not know): its caller accepts nothing else.
            to = refusal_address(msg.data, client_id, key)
            await self.results.store_failure(
                to.client_id, to.key, exc, attempt, job_id=to.job_id, fingerprint=to.fingerprint
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
            await msg.nak(delay=HAND_BACK_DELAY_S)
            return
        run_id = next(self._ids)
        run = self._running[run_id] = RunningJob(msg, job)
        if self._recent_cancels.taken(claim_key(job.job_id), time.monotonic()):
            run.cancelled = True  # (cancelled as it was delivered: answered Cancelled, never run)
            log.info("job cancelled by its trainer as it was delivered")
        self._holding.set()
        try:
            await self._serve(run, attempt, stored_at, log)
        finally:
            del self._running[run_id]
            if not self._running:
                self._holding.clear()
            self._changed.set()

    async def _serve(self, run: RunningJob, attempt: int, stored_at: float, log: Any) -> None:
        if not await self.gate.admits(run, attempt, log):
            return
        if run.handed_back:  # the drain gave up on it while we were claiming
            await self.endings.hand_back(run, log)
            return
        if run.cancelled:  # while it was being claimed: nothing generated yet
            self._count("cancelled")
            await self.endings.answer_and_close(run, Cancelled("cancelled by its trainer before it ran"), attempt)
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
            await self.endings.hand_back(run, log)
            return
        result = result_of(
            run,
            generation,
            attempt=attempt,
            started=started,
            stored_at=stored_at,
            finished=time.time(),
            worker_id=self._worker_id,
            engine=self._engine,
            content_digests=self._served.content_digests,
        )
        if job.session_id is not None:
            self._metrics.observe_turn(generation.cached_tokens, generation.cache_rebuilt)
        if not served_within(job.constraint, result):
            # Admission and the activation drain make this impossible; never store it if it happens.
            log.error(
                "contract violation: result outside its constraint; handing the job back",
                constraint=str(job.constraint),
                version_start=result.version_start,
                version_end=result.version_end,
            )
            self._metrics.contract_violations.inc()
            await self.endings.hand_back(run, log)
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
        if await self.endings.store_answer(run, result, attempt, log):
            self._done(run, result, log)

    async def _generate(self, run: RunningJob, attempt: int, log: Any) -> Generation | None:
        """The engine's generation of the run's job; None where there is none to answer with (a
        failure already answered or left to a redelivery, or another run has the job)."""
        job = run.job
        try:
            check_engine_takes(self._engine, job.payload)
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
                await self.endings.answer_and_close(run, err, attempt)
            return None

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
        await self.endings.engine_went_down(run, detail, attempt, log)
        return True

    # -- activations: draining exact jobs -------------------------------------------------------

    async def drain_exact(self, version: int, bound_s: float) -> tuple[float, int]:
        """Wait until no admitted ``exact-<version>`` job is running; past ``bound_s``, abort
        them and hand them back unanswered (``exact_drain``). Returns (seconds waited, jobs
        handed back)."""
        return await drain_exact(self._running, self._changed, self._engine, version, bound_s)

    def _spawn_abort(self, run: RunningJob) -> None:
        task = asyncio.ensure_future(run.abort(self._engine))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

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
