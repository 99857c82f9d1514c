"""Generating a ``resume`` job from where its earlier runs stopped, checkpointing as it goes.

A resumable job's tokens are kept in its progress log (``progress_log.ProgressLog``: records
appended at an expected sequence, so a run that another replica took over can store nothing).
A fresh run on an engine that streams its tokens is one request whose tokens go straight to the
log; any other run continues each unfinished sample from its kept tokens (the prompt and the
tokens so far prefilled), as one request per sample, or, on an engine that does not stream, in
segments of ``checkpoint_tokens`` with a checkpoint after each. A job that samples and gives no
seed runs on its job's seed (``schemas.seeds.job_seed``) in every run: an engine server would draw
a seed per request, and a continued sample would change streams unrecorded.

``jobs.JobRunner`` decides when a job is run and what becomes of its answer; this module is only
how its tokens are made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.types import JetStreamContext
from rollfleet.schemas import Completion, Names, RolloutJob, RolloutPayload
from rollfleet.schemas.errors import BrokerError, InvalidRequest, ServiceUnavailable, Superseded
from rollfleet.schemas.seeds import job_seed, sample_seed
from rollfleet.workers.engines import Engine, Generation
from rollfleet.workers.engines.base import with_drawn_seed
from rollfleet.workers.progress_log import ProgressLog
from rollfleet.workers.running_job import RunningJob
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.worker_metrics import WorkerMetrics


def _token_versions(out: Completion, default: int) -> list[int]:
    """The version of each token of a completion, from its spans (``default`` where it has none)."""
    versions = [default] * len(out.token_ids)
    for span in out.weight_versions:
        versions[span.start : span.end] = [span.version] * (span.end - span.start)
    return versions


class ResumableGenerator:
    """Makes the tokens of one worker's resumable jobs, and counts what it kept and remade."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        engine: Engine,
        *,
        worker_id: str,
        holder: str,
        served: ServedVersion,
        metrics: WorkerMetrics,
        max_record_bytes: int,
        hand_back: Callable[[RunningJob, Any], Awaitable[None]],
        checkpoint_tokens: int = 64,
        checkpoint_s: float = 2.0,
    ) -> None:
        self._js = js
        self._names = names
        self._engine = engine
        self._worker_id = worker_id
        self._holder = holder  # this process's claim holder name: a record names the run that wrote it
        self._served = served
        self._metrics = metrics
        self._max_record_bytes = max_record_bytes  # a record is one message
        self._hand_back = hand_back  # (the job runner's: a job whose progress cannot be read goes back)
        self.checkpoint_tokens = checkpoint_tokens  # a checkpoint every N tokens ...
        self.checkpoint_s = checkpoint_s  # ... or T seconds, whichever comes first
        self.resumed = 0  # resumable jobs continued from another run's tokens
        self.tokens_kept = 0
        self.tokens_regenerated = 0

    def progress_log(self, job: RolloutJob, log: Any, on_superseded: Callable[[], object] | None = None) -> ProgressLog:
        return ProgressLog(
            self._js,
            self._names,
            job,
            worker_id=self._worker_id,
            run=self._holder,
            every_tokens=self.checkpoint_tokens,
            every_s=self.checkpoint_s,
            metrics=self._metrics,
            log=log,
            max_record_bytes=self._max_record_bytes,
            on_superseded=on_superseded,
        )

    async def generate(self, run: RunningJob, log: Any) -> Generation | None:
        """The job's generation, continued from its earlier runs' checkpoints. None when another
        run took the job over meanwhile, or the job was handed back (its progress unreadable)."""
        job, engine = run.job, self._engine
        plog = self.progress_log(job, log, on_superseded=lambda: asyncio.ensure_future(run.abort(engine)))
        prompt = engine.prompt_ids(job.payload)
        try:
            with typed_errors():
                await plog.open(took_over=run.took_over, can_continue=prompt is not None)
        except Superseded:
            log.warning("job taken over by another run before this one started")
            return None
        except (BrokerError, TimeoutError, ServiceUnavailable) as exc:  # the broker, not the job
            log.warning("cannot read the job's progress; handing it back", error=str(exc))
            await self._hand_back(run, log)
            return None
        run.progress = plog
        if plog.reason is not None:
            log.warning("stored progress not usable; generating from the first token", reason=plog.reason)
            self.tokens_regenerated += plog.regenerated_tokens
            self._metrics.tokens_regenerated.inc(plog.regenerated_tokens)
        if plog.kept_tokens or plog.resumes:
            kept = [len(s.token_ids) for s in plog.samples]
            log.info("resuming", kept_tokens=plog.kept_tokens, runs_before=plog.resumes, kept=kept)
            self.resumed += 1
            self.tokens_kept += plog.kept_tokens
            self._metrics.resumed_jobs.inc()
            self._metrics.tokens_kept.inc(plog.kept_tokens)
        writer = asyncio.create_task(plog.keep_writing())
        try:
            fresh = not any(s.token_ids or s.finish for s in plog.samples)
            # (Every run of the job, on any replica, draws the job's own seed: ``job_seed``.)
            payload, drawn = with_drawn_seed(job.payload, job_seed(job.job_id))
            if fresh and engine.streams_tokens:
                run.request_ids = [job.job_id]
                generation = await engine.generate(job.job_id, payload, job.session_id, sink=plog)
                prompt_tokens = generation.prompt_tokens
            else:
                prompt_tokens = await self._continue(run, plog, prompt, payload)
        finally:
            plog.stop()
            await writer
        if plog.superseded:
            log.warning("job taken over by another run; discarding this run's generation")
            return None
        v_start, v_end = plog.version_bounds(self._served.version)
        want_text = job.payload.prompt_text is not None
        return Generation(
            plog.completions(engine.detokenize if want_text else None),
            v_start,
            v_end,
            prompt_tokens=prompt_tokens,
            seed=drawn,
            restarts=[list(s.restarts) for s in plog.samples],
        )

    async def _continue(
        self, run: RunningJob, plog: ProgressLog, prompt: list[int] | None, payload: RolloutPayload
    ) -> int:
        """Generate every unfinished sample on from its kept tokens, each as its own request
        (the prompt and its tokens so far prefilled). An engine that does not stream its tokens
        runs them in segments of ``checkpoint_tokens``, a checkpoint after each. ``payload``: the
        job's, with the seed it runs on (its job's)."""
        job, engine = run.job, self._engine
        streams = engine.streams_tokens
        segment = plog.every_tokens if not streams else None
        run.request_ids = [f"{job.job_id}.{i}" for i in range(len(plog.samples))]

        async def one(i: int) -> None:
            sample = plog.samples[i]
            while sample.finish is None and not plog.superseded and not run.handed_back and not run.cancelled:
                left = plog.max_tokens - len(sample.token_ids)
                if left <= 0:
                    plog.finished(i, "length")
                    break
                take = left if segment is None else min(segment, left)
                # Alone, sample i keeps its own random stream (not sample 0's of a request of one).
                sampling = msgspec.structs.replace(payload.sampling, seed=sample_seed(payload.sampling.seed, i))
                if prompt is not None:
                    part = msgspec.structs.replace(
                        payload,
                        prompt_token_ids=prompt + sample.token_ids,
                        prompt_text=None,
                        n=1,
                        sampling=msgspec.structs.replace(sampling, max_tokens=take),
                    )
                elif not sample.token_ids:  # a text prompt the engine cannot tokenize: one request
                    part = msgspec.structs.replace(payload, n=1, sampling=sampling)
                    take = left
                else:
                    raise InvalidRequest("cannot continue a text prompt on an engine that cannot tokenize it")
                sink = plog.for_sample(i) if streams else None
                plog.restart(i)
                gen = await engine.generate(run.request_ids[i], part, job.session_id, sink=sink)
                out = gen.outputs[0]
                if not streams:
                    versions = _token_versions(out, gen.version_end)
                    lps = out.logprobs or [0.0] * len(out.token_ids)
                    for tok, lp, v in zip(out.token_ids, lps, versions, strict=False):
                        plog.token(i, tok, lp, v)
                finish = out.finish_reason
                if finish == "abort":
                    break
                if finish == "length" and len(out.token_ids) >= take and len(sample.token_ids) < plog.max_tokens:
                    if not streams:
                        await plog.checkpoint()  # a segment done: its tokens are kept
                    continue  # the segment's end, not the sample's
                plog.finished(i, finish)

        await asyncio.gather(*(one(i) for i in range(len(plog.samples))))
        return len(prompt) if prompt is not None else 0
