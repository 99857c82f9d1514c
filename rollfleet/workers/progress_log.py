"""One run of a resumable job: its checkpoints on the broker, and taking a job over.

A ``resume`` job's worker stores the generation so far on the job's progress subject
(``schemas.progress`` has the records and their one reading, ``Replay``) every
``every_tokens`` tokens or ``every_s`` seconds, whichever comes first: only the tokens made since
the last record, in a background task, so generation never waits for the broker. A run that
takes a job over (its previous holder died) reads the records, writes a ``ResumeRecord`` and
continues from there. Each write names the subject's last sequence its run has seen, so once
another run has written its ``ResumeRecord``, this run can store nothing more (``Superseded``):
neither a checkpoint nor, since the last checkpoint comes before the answer, an answer.

What a resumed run keeps is checked against the job before it is trusted. A record without the
job's MAC (``schemas.progress.sealed``: written by someone the job was never delivered to, or
damaged) is not the job's: it is ignored, and it cannot fence this run off either (a write
refused for the subject's sequence looks at what came in between, and goes on if nothing there
is the job's). A sealed record that does not continue the output where it stands, tokens over
``max_tokens`` or at a version outside the job's constraint make the run start again from the
first token (``reason`` logged and stored). What a checkpoint stores, and which stored versions
a run may continue from, are ``checkpoint_records``'s pure rules.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any

from rollfleet.broker.retry_publish import publish_retrying
from rollfleet.broker.stream_reads import stored_on
from rollfleet.broker.types import JetStreamContext
from rollfleet.runtime.aio import wait_event
from rollfleet.schemas import Completion, Names, RolloutJob, VersionSpan, decode, encode
from rollfleet.schemas.errors import CorruptCheckpoint, Fenced, InvalidRequest, RollfleetError, Superseded
from rollfleet.schemas.progress import (
    MAC_HEADER,
    DoneRecord,
    ProgressRecord,
    Replay,
    ResumeRecord,
    SampleSoFar,
    TokensRecord,
    append_spans,
    record_mac,
    sealed,
)
from rollfleet.workers.checkpoint_records import check_versions, new_deltas
from rollfleet.workers.engines.base import TokenSink
from rollfleet.workers.worker_metrics import WorkerMetrics

_EXPECT = "Nats-Expected-Last-Subject-Sequence"
_FINAL_BUDGET_S = 20.0  # the last checkpoint before an answer: then the job is left to redeliver
_CHECKPOINT_BUDGET_S = 5.0  # a periodic one: the next one carries its tokens too
_NOISE_RETRIES = 8  # writes refused only for records that are not the job's, before giving up
_RECORD_TOKENS = 16_384  # per record at most (about 230 kB with log-probs)
_TOKEN_BYTES = 16  # a token and its log-prob in a record, at most (spans aside): the first guess
_HEADER_BYTES = 1024  # a record's message headers (id, MAC, expected sequence, roll-up), and some


class _Rebuild(Exception):
    """A write refused because this run's own earlier write (its acknowledgement lost) was stored
    after all: the cursors have moved; build the record again."""


class ProgressLog(TokenSink):
    """The progress of one job as one run sees it: ``samples`` holds every token so far (kept
    from earlier runs, then this run's), ``stored[i]`` how many of sample i are on the broker."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        job: RolloutJob,
        *,
        worker_id: str,
        run: str,
        every_tokens: int,
        every_s: float,
        metrics: WorkerMetrics,
        log: Any,
        max_record_bytes: int,
        on_superseded: Callable[[], object] | None = None,
    ) -> None:
        self._js = js
        self._names = names
        self.job = job
        self.subject = names.progress_subject(job.client_id, job.job_id)
        self._worker_id = worker_id
        self._run = run
        self.every_tokens = max(1, every_tokens)
        self.every_s = every_s
        self._metrics = metrics
        self._log = log
        self._max_bytes = max_record_bytes
        self._on_superseded = on_superseded
        n, params = job.payload.n, job.payload.sampling
        self._want_logprobs = params.logprobs
        self.max_tokens = params.max_tokens
        self.samples = [SampleSoFar() for _ in range(n)]
        self.stored = [0] * n
        self._finish_stored = [False] * n
        self.last_seq = 0  # the subject's last sequence this run has seen (0: none)
        self.kept_tokens = 0  # tokens taken over from earlier runs
        self.regenerated_tokens = 0  # tokens stored by earlier runs that could not be kept
        self.resumes = 0  # earlier runs this one continues from
        self.reason: str | None = None  # why nothing stored could be kept
        self.superseded = False
        self._pending = 0
        self._due = asyncio.Event()
        self._lock = asyncio.Lock()
        self._writes = 0
        self._stopped = False
        self._nonce = uuid.uuid4().hex

    # -- taking the job over -------------------------------------------------------------------

    async def open(self, *, took_over: bool, can_continue: bool) -> None:
        """Read what earlier runs stored and take the job over: after this, no earlier run can
        store anything. ``can_continue``: the engine can prefill the kept tokens (else a run keeps
        nothing). A first run of a job with nothing stored writes nothing here."""
        for _ in range(8):
            replay, reason, read = await self._read(from_seq=1)
            if reason is None and not can_continue and replay.tokens:
                reason = "the engine cannot continue from stored tokens (a text prompt it cannot tokenize)"
            if read == 0 and not took_over:
                return
            kept = [0] * len(self.samples) if reason else replay.kept
            record = ResumeRecord(run=self._run, worker_id=self._worker_id, kept=kept, reason=reason)
            try:
                await self._publish(record, _FINAL_BUDGET_S)
            except (Superseded, _Rebuild):
                self.superseded = False  # (not by this: it is only a reason to read again)
                continue  # another run wrote meanwhile: read again
            if reason is None:
                self.samples = replay.samples
                self.kept_tokens = replay.tokens
                self.resumes = len(replay.runs)
            else:
                self.reason = reason
                self.regenerated_tokens = replay.tokens
            self.stored = [len(s.token_ids) for s in self.samples]
            self._finish_stored = [s.finish is not None for s in self.samples]
            return
        raise Superseded("other runs of this job kept writing its progress; leaving it to them")

    async def _records(self, from_seq: int) -> AsyncIterator[ProgressRecord | CorruptCheckpoint]:
        """The job's records on the subject from ``from_seq`` on, in order (a ``CorruptCheckpoint``
        for one of the job's that does not decode); ``last_seq`` follows every message read.
        Messages that are not the job's (no valid MAC) are skipped, counted and logged."""
        async for msg in stored_on(self._js, self._names.progress_stream, self.subject, from_seq):
            self.last_seq = int(msg.seq or self.last_seq)
            data = msg.data or b""
            if not sealed(self.job.job_id, data, msg.headers):
                why = "no valid MAC for this job (written by someone it was not delivered to, or damaged)"
                self._log.warning("progress record ignored", seq=self.last_seq, reason=why)
                continue
            try:
                yield decode(data, ProgressRecord, max_bytes=self._max_bytes, what="progress record")
            except InvalidRequest as exc:  # the job's own, yet not a record: a corrupt checkpoint
                yield CorruptCheckpoint(exc.message)

    async def _read(self, from_seq: int) -> tuple[Replay, str | None, int]:
        """The job's records on the subject, replayed; the reason, if they cannot be continued;
        how many there were."""
        params = self.job.payload.sampling
        replay = Replay(self.job.payload.n, params.max_tokens, params.logprobs)
        reason = None
        read = 0
        async for record in self._records(from_seq):
            read += 1
            if reason is not None:
                continue  # read on to the last sequence; nothing after a bad record is kept
            try:
                if isinstance(record, CorruptCheckpoint):
                    raise record
                replay.apply(record)
                if isinstance(record, TokensRecord):
                    check_versions(record, self.job.constraint)
            except CorruptCheckpoint as exc:
                reason = exc.message
        if reason is None and replay.done:
            reason = "a done record: the job was answered already"
        return replay, reason, read

    # -- this run's tokens (TokenSink) ------------------------------------------------------------

    def token(self, index: int, token: int, logprob: float | None, version: int) -> None:
        sample = self.samples[index]
        at = len(sample.token_ids)
        sample.token_ids.append(int(token))
        sample.logprobs.append(float(logprob) if logprob is not None else 0.0)
        append_spans(sample.spans, [VersionSpan(version=int(version), start=at, end=at + 1, replica=self._worker_id)])
        self._metrics.tokens_generated.inc()
        self._pending += 1
        if self._pending >= self.every_tokens:
            self._due.set()

    def restart(self, index: int) -> None:
        """A request of its own makes sample ``index``'s next tokens, its stream seeded anew."""
        sample = self.samples[index]
        if not sample.restarts or sample.restarts[-1] != len(sample.token_ids):
            sample.restarts.append(len(sample.token_ids))

    def finished(self, index: int, reason: str) -> None:
        if reason != "abort":  # an aborted run did not finish the sample: a next run continues it
            self.samples[index].finish = reason  # type: ignore[assignment]
            self._due.set()

    def for_sample(self, index: int) -> TokenSink:
        """A sink for a request that generates sample ``index`` alone (its sample 0)."""
        return _OneSample(self, index)

    # -- storing -----------------------------------------------------------------------------------

    async def keep_writing(self) -> None:
        """Checkpoint every ``every_tokens`` tokens or ``every_s`` seconds, until ``stop`` or
        superseded. (Stopped by a flag: the job's run awaits the last write, never cancels it.)"""
        while not self.superseded and not self._stopped:
            await wait_event(self._due, self.every_s)
            self._due.clear()
            if self._stopped:
                return
            try:
                await self.checkpoint(_CHECKPOINT_BUDGET_S)
            except Superseded:
                return
            except RollfleetError as exc:  # the broker away: the next checkpoint carries these tokens
                self._log.warning("checkpoint not stored", error=exc.message)

    def stop(self) -> None:
        """End ``keep_writing`` (the caller stores the last checkpoint itself)."""
        self._stopped = True
        self._due.set()

    async def checkpoint(self, budget_s: float = _FINAL_BUDGET_S) -> bool:
        """Store what is new since the last record (nothing new: nothing stored), in records of at
        most ``_RECORD_TOKENS`` tokens, each within a message (``max_record_bytes``: a record is
        never split across messages, so a smaller one is built where one would not fit).
        ``Superseded`` if another run took the job over."""
        limit = max(1, self._max_bytes - _HEADER_BYTES)
        tokens = min(_RECORD_TOKENS, max(1, limit // _TOKEN_BYTES))
        async with self._lock:
            wrote = False
            while True:
                if self.superseded:
                    raise Superseded("another run took this job over")
                deltas, upto = new_deltas(
                    self.samples, self.stored, self._finish_stored, tokens, logprobs=self._want_logprobs
                )
                if not deltas:
                    return wrote
                record = TokensRecord(run=self._run, samples=deltas)
                if tokens > 1 and len(encode(record)) > limit:  # (many spans): fewer tokens a record
                    tokens //= 2
                    continue
                self._pending = 0
                try:
                    await self._publish(record, budget_s)
                except _Rebuild:
                    continue
                for i, end, done in upto:
                    self._metrics.tokens_checkpointed.inc(end - self.stored[i])
                    self.stored[i] = end
                    self._finish_stored[i] = done
                wrote = True

    async def done(self) -> None:
        """The answer is stored: roll the job's records up into one small done record."""
        with suppress(RollfleetError, _Rebuild):
            await self._publish(DoneRecord(run=self._run), 5.0, rollup=True)

    async def roll_up_answered(self) -> None:
        """The answer was stored by a run that died before rolling up (a redelivery found it):
        roll up from wherever the subject stands (no run can store anything after the answer)."""
        async for _ in self._records(self.last_seq + 1):
            pass  # (moves last_seq to the subject's last record)
        await self.done()

    async def _publish(self, record: ProgressRecord, budget_s: float, *, rollup: bool = False) -> None:
        data = encode(record)
        self._writes += 1
        # (the id is this log's own: a run's worker writes for many jobs, and ids are stream-wide)
        headers = {"Nats-Msg-Id": f"p:{self._nonce}:{self._writes}", MAC_HEADER: record_mac(self.job.job_id, data)}
        if rollup:
            headers["Nats-Rollup"] = "sub"
        for _ in range(_NOISE_RETRIES):
            headers[_EXPECT] = str(self.last_seq)
            try:
                ack = await publish_retrying(self._js, self.subject, data, headers, until=time.time() + budget_s)
            except Fenced:
                verdict = await self._since_last()
                if verdict == "other run":
                    self._supersede()
                    raise Superseded("another run took this job over (its progress moved on)") from None
                if verdict == "own":
                    raise _Rebuild() from None
                continue  # only records that are not the job's came in between: past them
            self.last_seq = int(ack.seq)
            self._metrics.checkpoints.inc()
            self._metrics.checkpoint_bytes.inc(len(data))
            return
        raise Superseded("the job's progress subject keeps moving under records that are not the job's")

    async def _since_last(self) -> str:
        """What was stored after ``last_seq`` (which moves past it all): ``"other run"`` (a record of
        this job by another run), ``"own"`` (only this run's: a write whose acknowledgement was
        lost; the cursors now count what it stored) or ``"noise"`` (nothing of this job)."""
        verdict = "noise"
        async for record in self._records(self.last_seq + 1):
            if isinstance(record, CorruptCheckpoint) or record.run != self._run:
                return "other run"
            verdict = "own"
            for d in record.samples if isinstance(record, TokensRecord) else ():
                self.stored[d.index] = max(self.stored[d.index], d.start + len(d.token_ids))
                self._finish_stored[d.index] = self._finish_stored[d.index] or d.finish is not None
        return verdict

    async def taken_over(self) -> bool:
        """Whether another run of the job has stored a record since this run's last (its claim
        changed hands: only a run that then wrote its ``ResumeRecord`` has the job). If so, this
        run is superseded."""
        async with self._lock:
            if not self.superseded and await self._since_last() == "other run":
                self._supersede()
        return self.superseded

    def _supersede(self) -> None:
        if not self.superseded:
            self.superseded = True
            self._metrics.superseded.inc()
            if self._on_superseded is not None:
                self._on_superseded()

    def supersede(self, why: str) -> None:
        """The run lost its job (its claim was taken over): store nothing more."""
        self._log.warning("job taken over by another run; storing nothing more", reason=why)
        self._supersede()

    # -- the answer -----------------------------------------------------------------------------------

    def completions(self, detokenize: Callable[[list[int]], str | None] | None) -> list[Completion]:
        outs = []
        for s in self.samples:
            c = s.completion(self._want_logprobs)
            if detokenize is not None:
                c.text = detokenize(c.token_ids)
            outs.append(c)
        return outs

    def version_bounds(self, default: int) -> tuple[int, int]:
        versions = [span.version for s in self.samples for span in s.spans]
        return (min(versions, default=default), max(versions, default=default))


class _OneSample(TokenSink):
    def __init__(self, log: ProgressLog, index: int) -> None:
        self._log, self._index = log, index

    def token(self, index: int, token: int, logprob: float | None, version: int) -> None:
        self._log.token(self._index, token, logprob, version)

    def finished(self, index: int, reason: str) -> None:
        self._log.finished(self._index, reason)
