"""A run's answer as it is stored: the engine's generation with the job's identity, its timings
and its replay coordinate. Pure: plain data in (the finishing time an argument), a result out."""

from __future__ import annotations

from rollfleet.schemas import RolloutResult
from rollfleet.workers.engines import Engine, Generation
from rollfleet.workers.replay_stamp import stamp
from rollfleet.workers.running_job import RunningJob


def result_of(
    run: RunningJob,
    generation: Generation,
    *,
    attempt: int,
    started: float,
    stored_at: float,
    finished: float,
    worker_id: str,
    engine: Engine,
    content_digests: dict[int, bytes],
) -> RolloutResult:
    """The run's answer, with its timings and its replay coordinate. Its queue wait counts from
    when the job was asked (its submission, or its storing where that is earlier or unknown)."""
    job = run.job
    asked = min(stored_at, job.submitted_at if job.submitted_at > 0 else stored_at)
    return RolloutResult(
        job_id=job.job_id,
        idempotency_key=job.idempotency_key,
        client_id=job.client_id,
        outputs=generation.outputs,
        version_start=generation.version_start,
        version_end=generation.version_end,
        worker_id=worker_id,
        engine=engine.name,
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
        replay=stamp(job.payload, generation, engine, content_digests, worker_id),
    )
