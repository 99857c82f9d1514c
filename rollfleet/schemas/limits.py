"""Request limits and the checks every job passes before it is queued or run."""

from __future__ import annotations

import math

import msgspec

from rollfleet.schemas.bounded_json import MAX_DEPTH, depth_within
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.messages import RolloutJob, RolloutPayload


class Limits(msgspec.Struct, kw_only=True, frozen=True):
    max_job_bytes: int = 256 * 1024
    max_prompt_tokens: int = 32_768
    max_prompt_chars: int = 262_144
    max_new_tokens: int = 32_768
    max_samples: int = 64
    max_key_chars: int = 512


DEFAULT_LIMITS = Limits()


def check_payload(payload: RolloutPayload, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise ``InvalidRequest`` for an impossible or oversized payload."""
    has_ids = payload.prompt_token_ids is not None
    has_text = payload.prompt_text is not None
    if has_ids == has_text:
        raise InvalidRequest("give exactly one of prompt_token_ids or prompt_text")
    if has_ids:
        ids = payload.prompt_token_ids or []
        if not ids:
            raise InvalidRequest("prompt_token_ids is empty")
        if len(ids) > limits.max_prompt_tokens:
            raise InvalidRequest(f"prompt has {len(ids)} tokens, over the limit of {limits.max_prompt_tokens}")
        if min(ids) < 0:
            raise InvalidRequest("prompt_token_ids must be non-negative")
    elif len(payload.prompt_text or "") > limits.max_prompt_chars:
        raise InvalidRequest(f"prompt_text is over the limit of {limits.max_prompt_chars} characters")
    s = payload.sampling
    if not 1 <= s.max_tokens <= limits.max_new_tokens:
        raise InvalidRequest(f"max_tokens must be in [1, {limits.max_new_tokens}], got {s.max_tokens}")
    if not (math.isfinite(s.temperature) and s.temperature >= 0.0):
        raise InvalidRequest(f"temperature must be finite and >= 0, got {s.temperature}")
    if not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {s.top_k}")
    if s.stop_token_ids and min(s.stop_token_ids) < 0:  # (as the prompt's: no generator per job)
        raise InvalidRequest("stop_token_ids must be non-negative")
    if not 0 <= payload.stream_offset <= limits.max_new_tokens:
        raise InvalidRequest(f"stream_offset must be in [0, {limits.max_new_tokens}], got {payload.stream_offset}")
    if payload.stream_offset and s.seed is None:
        raise InvalidRequest("stream_offset advances a seeded stream; give sampling.seed")
    if not 1 <= payload.n <= limits.max_samples:
        raise InvalidRequest(f"n must be in [1, {limits.max_samples}], got {payload.n}")
    if not depth_within(payload.extra, MAX_DEPTH):  # passed on to engines, which recurse into it
        raise InvalidRequest(f"extra nests deeper than {MAX_DEPTH} levels")


def check_job(job: RolloutJob, limits: Limits = DEFAULT_LIMITS) -> None:
    if job.constraint.version < 0:
        raise InvalidRequest(f"version constraint must be >= 0, got {job.constraint}")
    if not job.idempotency_key or len(job.idempotency_key) > limits.max_key_chars:
        raise InvalidRequest(f"idempotency_key must have 1..{limits.max_key_chars} characters")
    if not math.isfinite(job.deadline):
        raise InvalidRequest("deadline must be a finite unix time")
    check_payload(job.payload, limits)
    if job.payload.stream_offset and job.behaviour.checkpoints:
        # (a run that takes it over seeds its continuation anew, past no draws: the offset would be lost)
        raise InvalidRequest("stream_offset is for a replay's one request; a resumable job cannot carry it")
