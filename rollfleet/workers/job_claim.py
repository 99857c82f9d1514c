"""A job's claim (``Names.claims_bucket``, key ``claim_key(job_id)``): taken before a claimed job
starts (``at_most_once`` jobs, sessions' turns, exact and resumable jobs), refreshed by revision
while it runs, released once its answer is stored and acked, and judged when a delivery finds it
taken: its holder still runs the job (``held``), or stopped (``stopped``), or it is too soon to say
(``watch``: a stalled broker stalls every holder's refreshes too). The rules are pure:
``judge_claim`` and ``watched_after`` for one look, ``ClaimWatch`` for a delivery's looks in turn,
``verdict_write`` for how a verdict is written; ``ClaimKeeper`` carries them out for one worker
process.

A claim names its holder and this process (a worker restarted under the same id is a new holder:
what the old one held is not being run any more). A run whose claim changed under it (this process
was paused or cut off while another replica took the job over or answered it) is told so
(``lose``): it stops and answers nothing. A run stores its answer only on a proof that it holds
the claim that is fresh by its own clock (``proof_of_holding``): the broker's word that its write
stands may reach it late, after another replica took the job over.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

from rollfleet.broker.claims_bucket import ClaimEntry, ClaimsBucket
from rollfleet.broker.errors import typed_errors
from rollfleet.broker.types import KeyValue
from rollfleet.schemas import RolloutJob
from rollfleet.schemas.errors import BrokerError, Fenced, RollfleetError
from rollfleet.schemas.names import Claim
from rollfleet.schemas.progress import open_claim, seal_claim
from rollfleet.workers.result_store import RESULT_PUBLISH_BUDGET_S
from rollfleet.workers.running_job import RunningJob

ClaimVerdict = Literal["held", "stopped", "watch"]


def judge_claim(refreshed: float, now: float, *, stale_s: float, watched_s: float, confirm_s: float) -> ClaimVerdict:
    """Whether the holder of a claim still runs its job, judged by a replica the job was delivered to.

    ``refreshed``: when the holder last wrote the claim (unix time; 0: marked stopped by a client
    that found the holder's connection gone). ``watched_s``: how long this replica has watched the
    claim stay unchanged while the broker answered each of its looks promptly (``watched_after``).
    A claim old by the clock is not enough: a paused or restarting broker stops every holder's
    refreshes too, and redelivers the job the moment it is back, before any holder could write
    again. The holder is gone only once it has also let ``confirm_s`` of broker time, seen
    available, pass without a refresh; until then: ``"watch"``."""
    if refreshed == 0.0:
        return "stopped"
    if now - refreshed < stale_s:
        return "held"
    return "stopped" if watched_s >= confirm_s else "watch"


def watched_after(watched_s: float, *, same: bool, look_s: float, since_last_s: float, slow_s: float) -> float:
    """``watched_s`` after one more look at a claim, ``since_last_s`` after the previous one: back
    to 0 if the claim changed (its holder wrote it) or the look took longer than ``slow_s`` (the
    broker stalled, and the holder's refreshes with it); otherwise the time since the last look."""
    if not same or look_s > slow_s:
        return 0.0
    return watched_s + since_last_s


@dataclass
class ClaimWatch:
    """One delivery's looks at a claim that another process holds, judged as they come: the
    pure state of ``ClaimKeeper.claim``'s loop (times are arguments; nothing here reads a clock
    or the broker). ``stale_s``/``confirm_s``: as ``judge_claim``'s; ``slow_s``: a look answered
    later than this says the broker stalled (``watched_after``); ``give_up_at``: a monotonic time
    past which a broker that keeps stalling gets no verdict from this delivery."""

    stale_s: float
    confirm_s: float
    slow_s: float
    give_up_at: float
    watched: float = 0.0  # seconds the claim stood still while the broker answered
    seen: int | None = None  # the revision of the previous look
    last_look: float = 0.0  # when the previous look was answered

    def judge(
        self, revision: int | None, refreshed: float, *, anybody_else: bool, asked: float, answered: float, now: float
    ) -> ClaimVerdict:
        """The verdict of one look, asked at ``asked`` and answered at ``answered`` (monotonic):
        the claim at ``revision`` (None: there is none), last written at ``refreshed`` (unix
        time; ``now`` is unix time too). A claim that is nobody's, or this process's own (a
        process that is not running the job), is ``stopped``."""
        if revision is None or not anybody_else:
            return "stopped"
        self.watched = watched_after(
            self.watched,
            same=self.seen is not None and revision == self.seen,
            look_s=answered - asked,
            since_last_s=answered - self.last_look,
            slow_s=self.slow_s,
        )
        verdict = judge_claim(refreshed, now, stale_s=self.stale_s, watched_s=self.watched, confirm_s=self.confirm_s)
        if verdict == "watch":
            self.seen, self.last_look = revision, answered
        return verdict

    def unanswered(self) -> None:
        """A look the broker did not answer: what was watched counts for nothing."""
        self.watched, self.seen = 0.0, None

    def given_up(self, now: float) -> bool:
        return now >= self.give_up_at


def proof_of_holding(proved_at: float, now: float, *, hold_s: float) -> bool:
    """Whether this process still holds a claim at ``now``, from its own write found current: the
    write stamped ``proved_at`` (this process's clock, set as the value was made, before it was
    sent), acknowledged, or read back as the claim's newest revision.

    The write reached the broker no earlier than its stamp, and a replica judging the claim
    (``ClaimWatch``) writes over it only after seeing that revision stand for ``confirm_s`` while
    the broker answered it promptly. So with ``hold_s`` below ``confirm_s`` nobody has written
    over it before ``proved_at + hold_s``, whichever way the clocks of the two machines are set.
    When the acknowledgement or the read arrived says nothing: a link stalled towards this process
    delivers it after the stall, when another replica may have taken the job over or answered it
    ``Interrupted`` (campaign 1, seed 24769's cut, turned downward)."""
    return now - proved_at < hold_s


VerdictWrite = Literal["take_over", "create_stopped", "mark_stopped"]


def verdict_write(takeover: bool, exists: bool) -> VerdictWrite:
    """How a ``stopped`` verdict is written over the claim judged (so that one verdict wins, and a
    holder that was only paused finds it when it refreshes): a policy that takes a job over writes
    its own claim; any other marks the judged claim stopped, or creates one marked stopped where
    there was none, so that nobody starts the job from here."""
    if takeover:
        return "take_over"
    return "mark_stopped" if exists else "create_stopped"


class ClaimKeeper:
    """The claims of the jobs one worker process runs: its holder name, the timings derived from
    ``ack_wait``, and every read and write of the claims bucket."""

    def __init__(
        self,
        kv: KeyValue,
        *,
        worker_id: str,
        ack_wait_s: float,
        log: Any,
        running: Callable[[], Iterable[RunningJob]],
        abort: Callable[[RunningJob], None],
    ) -> None:
        self.bucket = ClaimsBucket(kv)
        self._log = log
        self._running = running  # the jobs running on this process now
        self._abort = abort  # stop a run's engine requests (one that lost its claim)
        self.holder = f"{worker_id}:{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # A claim is refreshed every ack_wait / 3 and counts as stopped when twice ack_wait old: a
        # holder cut off from the broker for a while (a broker restart, a partition) while it runs
        # the job is not taken for dead at the moment the broker redelivers the job (ack_wait).
        self.refresh_s = max(ack_wait_s / 3.0, 0.2)
        self.stale_s = 2 * max(ack_wait_s, 3 * self.refresh_s)
        # A resumable job's holder is taken for gone sooner (three refreshes missed, not six): a
        # takeover of a holder that was only slow costs the tokens since its last checkpoint, never
        # a second answer (its writes are fenced off), and a replica's death costs less waiting.
        self.resume_stale_s = 3 * self.refresh_s
        # A claim old by the clock is judged stopped only after this long watched unchanged while
        # the broker answered (``judge_claim``): two refreshes of a live holder, and some.
        self.confirm_s = 3 * self.refresh_s
        # A run's proof that it holds its claim counts for this long after the write that made it
        # (``proof_of_holding``): half of what any replica watches a claim before it writes over it.
        self.hold_s = self.confirm_s / 2

    async def claim(self, run: RunningJob) -> str:
        """Claim a job before it starts: ``"ok"`` (ours now), ``"held"`` (a replica that refreshed
        its claim lately runs it: leave it alone) or ``"stopped"`` (its holder stopped running it;
        for a replayable turn the claim is ours now). A claim old by the clock is watched (the
        delivery kept in progress) until its holder has missed refreshes while the broker answered
        (``judge_claim``): a broker that stalled stalled every holder's refreshes too."""
        try:
            run.claim_revision = await self.bucket.create(run.job.job_id, self.value(run.job))
            run.claimed_at = time.monotonic()
            return "ok"
        except Fenced:
            pass
        judged = await self._judge_holder(run)
        if judged is None:
            return "held"
        return await self._write_verdict(run, *judged)

    async def _judge_holder(self, run: RunningJob) -> tuple[ClaimEntry | None, Claim] | None:
        """Watch the job's claim, another's, until its holder is judged (``ClaimWatch``): the
        claim judged stopped (its entry, None where there is none, and the claim read), or None
        where its holder runs it, or nothing could be judged."""
        job_id = run.job.job_id
        stale_s = self.resume_stale_s if run.job.behaviour.checkpoints else self.stale_s
        # (A broker that keeps stalling past four stale periods: this delivery judges nothing.)
        watch = ClaimWatch(stale_s, self.confirm_s, self.refresh_s, give_up_at=time.monotonic() + 4 * stale_s)
        while True:
            asked = time.monotonic()
            try:
                entry = await self.bucket.get(job_id)
                claim = self.read(run.job, entry.value) if entry is not None else Claim("", 0.0)
            except (BrokerError, TimeoutError):  # the broker did not answer: it judges nothing
                if run.handed_back or watch.given_up(time.monotonic()):
                    return None
                watch.unanswered()
                await asyncio.sleep(self.refresh_s)
                continue
            answered = time.monotonic()
            if self.runs_here(run):
                return None
            verdict = watch.judge(
                None if entry is None else entry.revision,
                claim.refreshed,
                anybody_else=claim.holder != self.holder,
                asked=asked,
                answered=answered,
                now=time.time(),
            )
            if verdict != "watch":
                break
            if run.handed_back or watch.given_up(answered):
                return None
            with suppress(Exception):
                await run.msg.in_progress()
            await asyncio.sleep(self.refresh_s)
        return None if verdict == "held" else (entry, claim)

    async def _write_verdict(self, run: RunningJob, entry: ClaimEntry | None, claim: Claim) -> str:
        """Write the verdict "stopped" over the claim revision judged: ``"stopped"`` where it was
        written, ``"held"`` where another verdict won or the write's fate is unknown."""
        job_id = run.job.job_id
        # The verdict is written over the claim revision judged, whatever the job's policy: a
        # holder that was only paused or cut off and refreshes first keeps the job (this delivery
        # is handed back), and one that refreshes after finds its claim gone and answers nothing.
        # Without the write, an at_most_once job's holder could refresh and store its answer
        # between this verdict and the ``Interrupted`` stored for it, and believe the job answered
        # while its caller was told otherwise (campaign 10, seed 6803). A policy that takes nothing
        # over writes the judged claim marked stopped, as a client does for a holder it found
        # gone: nobody starts the job from here.
        write = verdict_write(run.job.behaviour.takeover, entry is not None)
        try:  # (one verdict wins)
            if write == "take_over":
                revision = None if entry is None else entry.revision
                run.claim_revision = await self.bucket.write(job_id, self.value(run.job), revision)
            elif write == "create_stopped":
                run.claim_revision = await self.bucket.create(job_id, Claim(self.holder, 0.0).as_stopped().encode())
            else:
                assert entry is not None
                run.claim_revision = await self.bucket.mark_stopped(job_id, claim, entry.revision)
        except Fenced:
            return "held"
        except (BrokerError, TimeoutError):  # unknown whether it was written: judge nothing
            return "held"
        if run.job.behaviour.takeover:
            run.claimed_at = time.monotonic()
            run.took_over = True
        return "stopped"

    async def await_claim(self, run: RunningJob) -> str:
        """A resumable job redelivered while its claim still looks fresh: keep the delivery (in
        progress) and look again each refresh period, up to twice the time after which a holder
        counts as gone, instead of handing it back (each hand-back spends one of the job's
        ``max_deliver`` deliveries, and a dead holder's job would wait for the next one)."""
        until = time.monotonic() + 2 * self.resume_stale_s
        verdict = "held"
        while verdict == "held" and time.monotonic() < until and not run.handed_back:
            if self.runs_here(run):
                break  # this replica runs it: its answer comes from there
            with suppress(Exception):
                await run.msg.in_progress()
            await asyncio.sleep(self.refresh_s)
            verdict = await self.claim(run)
        return verdict

    def runs_here(self, run: RunningJob) -> bool:
        """Whether another delivery of the same job runs on this replica now."""
        return any(r.job.job_id == run.job.job_id for r in self._running() if r is not run)

    def value(self, job: RolloutJob | None = None, stamp: float | None = None) -> bytes:
        claim = Claim(self.holder, time.time() if stamp is None else stamp)
        # A resumable job's claim is sealed with its job id, like its progress records: a claim
        # written by someone the job was never delivered to is nobody's (``read``).
        return seal_claim(job.job_id, claim) if job is not None and job.behaviour.checkpoints else claim.encode()

    @staticmethod
    def read(job: RolloutJob, value: bytes | None) -> Claim:
        """A claim as its job's replicas read it; a resumable job's without its MAC (a rogue
        write, or one marked stopped since) reads as nobody's: stopped."""
        if not job.behaviour.checkpoints:
            return Claim.decode(value)
        return open_claim(job.job_id, value) or Claim("", 0.0)

    async def release(self, job: RolloutJob, revision: int | None = None, *, only_own: bool = True) -> None:
        """The claim has done its work (the job answered and acked, or handed back unrun): delete
        it, only while it is still this process's own. ``revision``: the one this run wrote last; the
        claim is deleted at that revision, else (moved since: a refresh racing this release, or
        another run took the job) only if it still names this process. A run that lost the job
        unnoticed never deletes the claim of the run that has it now. ``only_own=False``: the job
        is answered (a redelivery found its answer), so whoever still holds its claim holds it for
        nothing: deleted whatever it names, and a holder still running learns it at its refresh."""
        if not job.claimed:
            return
        with suppress(Exception):
            if not only_own:
                await self.bucket.delete(job.job_id)
                return
            if revision is not None:
                with suppress(Fenced):
                    await self.bucket.delete(job.job_id, revision)
                    return
            entry = await self.bucket.get(job.job_id)
            claim = None if entry is None else self.read(job, entry.value)
            # (One naming this process but marked stopped is the verdict of whoever judged it gone.)
            if entry is not None and claim is not None and claim.holder == self.holder and not claim.stopped:
                await self.bucket.delete(job.job_id, entry.revision)

    async def refresh(self, now: float) -> None:
        """A long job's claim says, every ack_wait / 3, that its holder still runs it."""
        for run in list(self._running()):
            if run.claimed_at is not None and now - run.claimed_at >= self.refresh_s and not run.claim_lost:
                run.claimed_at = now
                if run.claim_revision is not None:
                    await self.refresh_by_revision(run)
                    continue
                with suppress(Exception):
                    await self.bucket.put(run.job.job_id, self.value())

    async def refresh_by_revision(self, run: RunningJob) -> bool | None:
        """Refresh a claim only if it is still the one this run wrote: True if so, False if it was
        taken over, answered ``Interrupted`` or marked stopped meanwhile (this process was paused
        or cut off too long: another replica has the job, and this run stops and answers nothing),
        None if the broker did not answer (the next refresh tries again)."""
        job_id, revision = run.job.job_id, run.claim_revision
        if revision is None:  # (not claimed by revision: nothing to compare with)
            return None
        stamp = time.time()
        try:
            run.claim_revision = await self.bucket.replace(job_id, self.value(run.job, stamp), revision)
            run.claim_proved_at = stamp
            return True
        except Fenced:
            if run.job.behaviour.checkpoints:
                return await self.reclaim_resumable(run)
        except Exception:
            return None
        try:  # a write of ours whose acknowledgement was lost (the broker stalled) moved it too
            entry = await self.bucket.get(job_id)
            claim = None if entry is None else Claim.decode(entry.value)
        except Exception:
            return None
        if entry is not None and claim is not None and claim.holder == self.holder and not claim.stopped:
            run.claim_revision = entry.revision
            run.claim_proved_at = claim.refreshed  # (that write's own stamp: when it was made)
            return True
        self.lose(run)
        return False

    async def reclaim_resumable(self, run: RunningJob) -> bool | None:
        """A resumable job's claim changed under its run. Only the job's progress says whether
        another run has the job (a run that takes it over stores its ``ResumeRecord`` at once, and
        that fences this run's next write): a claim written or deleted by someone who does not know
        the job id fences nothing, and this run writes its own back. (A taker whose record is not
        stored yet gets its claim back the same way; the records decide which run goes on.)"""
        job_id = run.job.job_id
        try:
            with typed_errors():  # (the progress log reads the stream)
                if run.progress is not None and await run.progress.taken_over():
                    self.lose(run)
                    return False
            entry = await self.bucket.get(job_id)
            revision = None if entry is None else entry.revision
            stamp = time.time()
            run.claim_revision = await self.bucket.write(job_id, self.value(run.job, stamp), revision)
            run.claim_proved_at = stamp
        except RollfleetError:  # the broker away (a BrokerError), or written again meanwhile
            return None
        self._log.warning("resumable job's claim rewritten by someone else; written back", job_id=run.job.job_id)
        return True

    def lose(self, run: RunningJob) -> None:
        if run.claim_lost:
            return
        run.claim_lost = True
        job = run.job
        self._log.warning("claim lost; this run stops and answers nothing", job_id=job.job_id, key=job.idempotency_key)
        if run.progress is not None:
            run.progress.supersede("its claim was taken over")  # (it aborts the run's requests)
        else:
            self._abort(run)

    async def still_holds(self, run: RunningJob) -> bool:
        """Just before a claimed job is answered: whether this run still holds the claim (refreshed
        by revision, retried while the broker is away). A holder paused past the moment another
        replica took the job over (or answered it ``Interrupted``), even past the duplicate window
        that would drop a second answer, never stores one. Nor does a holder whose link stalled
        towards it: the broker's word that its refresh stands counts only while that refresh is
        fresh by this process's clock (``proof_of_holding``); one that came back later is
        written again, and the new write finds a taker's if there is one."""
        if run.claim_lost:
            return False
        if run.claimed_at is None or run.claim_revision is None:
            return True
        until = time.time() + RESULT_PUBLISH_BUDGET_S
        while True:
            held = await self.refresh_by_revision(run)
            if held is False:
                return False
            proved_at = run.claim_proved_at
            if held and proved_at is not None and proof_of_holding(proved_at, time.time(), hold_s=self.hold_s):
                return True
            if time.time() >= until:
                return False
            if held is None:  # (the broker did not answer; a proof that came late is written again at once)
                await asyncio.sleep(0.2)
