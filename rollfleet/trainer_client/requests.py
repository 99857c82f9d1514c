"""Turning ``submit``'s arguments into a job: every argument checked, nothing coerced.

A wrong type, a float where a version belongs, a non-positive time-out or an impossible
payload is a typed ``InvalidRequest`` here, before anything is queued; the job is validated
exactly as a worker will decode it.
"""

from __future__ import annotations

import math
import numbers
import time
import uuid

import msgspec

from rollfleet.schemas import (
    Limits,
    RetryPolicy,
    RolloutJob,
    RolloutPayload,
    VersionConstraint,
    check_job,
    check_token,
    decode,
    encode,
    request_fingerprint,
)
from rollfleet.schemas.errors import InvalidRequest

_MAX_VERSION = 2**63 - 1
RETRY_POLICIES = ("replayable", "at_most_once")


def whole_number(name: str, value: object, low: int = 0) -> int:
    """``value`` as an int in ``[low, 2**63)``; bools, floats and strings are refused, not coerced."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= int(value) <= _MAX_VERSION:
        raise InvalidRequest(f"{name} must be in [{low}, 2**63), got {value}")
    return int(value)


def seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise InvalidRequest(f"{name} must be a finite number of seconds, got {value!r}")
    return float(value)


def constraint_from(
    min_version: object, exact_version: object, max_staleness: object, latest: int | None
) -> VersionConstraint:
    given = [x is not None for x in (min_version, exact_version, max_staleness)]
    if sum(given) != 1:
        raise InvalidRequest("give exactly one of min_version, exact_version or max_staleness")
    if exact_version is not None:
        return VersionConstraint("exact", whole_number("exact_version", exact_version))
    if min_version is not None:
        return VersionConstraint("min", whole_number("min_version", min_version))
    staleness = whole_number("max_staleness", max_staleness)
    return VersionConstraint("min", max(0, (latest or 0) - staleness))


def build_job(
    payload: object,
    *,
    client_id: str,
    constraint: VersionConstraint,
    idempotency_key: object,
    deadline: object,
    timeout: object,
    default_timeout_s: float,
    retry_policy: object,
    session_id: object,
    trainer_version: int | None,
    limits: Limits,
) -> tuple[RolloutJob, bytes]:
    """The job and its wire bytes, or ``InvalidRequest`` naming what is wrong."""
    if not isinstance(payload, RolloutPayload):
        raise InvalidRequest(f"payload must be a RolloutPayload, got {type(payload).__name__}")
    if retry_policy not in RETRY_POLICIES:
        raise InvalidRequest(f"retry_policy must be one of {RETRY_POLICIES}, got {retry_policy!r}")
    if idempotency_key is not None and not isinstance(idempotency_key, str):
        raise InvalidRequest(f"idempotency_key must be a string, got {type(idempotency_key).__name__}")
    if session_id is not None:
        check_token(session_id, "session_id")  # type: ignore[arg-type]
    now = time.time()
    if deadline is not None and timeout is not None:
        raise InvalidRequest("give deadline or timeout, not both")
    if deadline is not None:
        when = seconds("deadline", deadline)
        if when <= now:
            raise InvalidRequest(f"deadline {when} is not in the future")
    else:
        wait = default_timeout_s if timeout is None else seconds("timeout", timeout)
        if wait <= 0:
            raise InvalidRequest(f"timeout must be > 0 seconds, got {wait}")
        when = now + wait
    job_id = uuid.uuid4().hex
    job = RolloutJob(
        job_id=job_id,
        idempotency_key=idempotency_key or job_id,
        client_id=client_id,
        constraint=constraint,
        payload=payload,
        deadline=when,
        submitted_at=now,
        retry_policy=retry_policy,  # type: ignore[arg-type]
        session_id=session_id,  # type: ignore[arg-type]
        trainer_version=trainer_version,
    )
    try:
        data = encode(job)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise InvalidRequest(f"the request cannot be encoded: {exc}") from None
    # Decode what a worker will decode: every field's type is checked, nothing silently coerced.
    job = decode(data, RolloutJob, what="rollout job")
    check_job(job, limits)
    job.fingerprint = request_fingerprint(job.constraint, job.payload, job.retry_policy, job.session_id)
    data = encode(job)
    if len(data) > limits.max_job_bytes:
        raise InvalidRequest(f"job is {len(data)} bytes, over the limit of {limits.max_job_bytes}")
    return job, data


__all__ = ["RETRY_POLICIES", "RetryPolicy", "build_job", "constraint_from", "seconds", "whole_number"]
