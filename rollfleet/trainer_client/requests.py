"""Turning ``submit``'s arguments into a job: every argument checked, nothing coerced.

A wrong type, a float where a version belongs, a non-positive time-out or an impossible
payload is a typed ``InvalidRequest`` here, before anything is queued. The payload is the only
part a caller builds, so it alone is validated the way a worker decodes it: encoded once,
decoded once (every field's type checked), and the same bytes go into the job's wire form and
its fingerprint.
"""

from __future__ import annotations

import math
import numbers
import time
import uuid
from typing import get_args

import msgspec

from rollfleet.schemas import (
    SCHEMA_VERSION,
    Limits,
    RetryPolicy,
    RolloutJob,
    RolloutJobWire,
    RolloutPayload,
    VersionConstraint,
    check_payload,
    check_token,
    decode,
    encode,
    request_fingerprint,
)
from rollfleet.schemas.asked import AskedConstraint, whole_number
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.messages import retry_behaviour

RETRY_POLICIES: tuple[str, ...] = get_args(RetryPolicy)


def seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise InvalidRequest(f"{name} must be a finite number of seconds, got {value!r}")
    return float(value)


def asked_of(constraint: object, min_version: object, exact_version: object, max_staleness: object) -> AskedConstraint:
    """The constraint of a call that may give it built (``constraint``) or as keywords: exactly
    one way, checked once (``AskedConstraint.of``)."""
    if constraint is None:
        return AskedConstraint.of(min_version, exact_version, max_staleness)
    if not isinstance(constraint, AskedConstraint):
        raise InvalidRequest(f"constraint must be an AskedConstraint, got {type(constraint).__name__}")
    if (min_version, exact_version, max_staleness) != (None, None, None):
        raise InvalidRequest("give exactly one of min_version, exact_version, max_staleness or constraint")
    return constraint


def _deadline(deadline: object, timeout: object, default_timeout_s: float, now: float) -> float:
    """When a job asked at ``now`` ends: its ``deadline``, or ``now`` and its ``timeout`` (or the
    client's default), checked."""
    if deadline is not None and timeout is not None:
        raise InvalidRequest("give deadline or timeout, not both")
    if deadline is not None:
        when = seconds("deadline", deadline)
        if when <= now:
            raise InvalidRequest(f"deadline {when} is not in the future")
        return when
    wait = default_timeout_s if timeout is None else seconds("timeout", timeout)
    if wait <= 0:
        raise InvalidRequest(f"timeout must be > 0 seconds, got {wait}")
    return now + wait


def _encoded(payload: RolloutPayload) -> bytes:
    try:
        return encode(payload)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise InvalidRequest(f"the request cannot be encoded: {exc}") from None
    except RecursionError:  # (the encoder recurses per level; check_payload bounds extra's depth)
        raise InvalidRequest("the request nests deeper than it can be encoded") from None


def build_job(
    payload: object,
    *,
    client_id: str,
    constraint: VersionConstraint,
    written: str,
    idempotency_key: object,
    deadline: object,
    timeout: object,
    default_timeout_s: float,
    retry_policy: object,
    session_id: object,
    trainer_version: int | None,
    limits: Limits,
    max_timeout_s: float | None = None,
    job_id: str | None = None,
    asked_at: float | None = None,
) -> tuple[RolloutJob, bytes]:
    """The job and its wire bytes, or ``InvalidRequest`` naming what is wrong. ``written``: the
    constraint as the caller wrote it (``AskedConstraint.written``); ``max_timeout_s``: the
    longest an ``at_most_once`` job may wait (its claim must outlive it); ``asked_at``: when the
    caller asked, where that was before this call (a ``timeout`` counts from then)."""
    _check_arguments(payload, retry_policy, idempotency_key, session_id, limits)
    now = time.time() if asked_at is None else asked_at
    when = _deadline(deadline, timeout, default_timeout_s, now)
    _check_claim_outlives(str(retry_policy), when - now, max_timeout_s)
    if constraint.version < 0:
        raise InvalidRequest(f"version constraint must be >= 0, got {constraint}")
    raw = _encoded(payload)
    # Decode what a worker will decode: every field's type is checked, nothing silently coerced.
    payload = decode(raw, RolloutPayload, what="rollout payload")
    check_payload(payload, limits)  # type: ignore[arg-type]
    job_id = job_id or uuid.uuid4().hex
    fingerprint = request_fingerprint(written, raw, retry_policy, session_id)  # type: ignore[arg-type]
    fields = {
        "job_id": job_id,
        "idempotency_key": idempotency_key or job_id,
        "client_id": client_id,
        "constraint": constraint,
        "deadline": when,
        "submitted_at": now,
        "retry_policy": retry_policy,
        "session_id": session_id,
        "trainer_version": trainer_version,
        "fingerprint": fingerprint,
        "schema": SCHEMA_VERSION,  # (a worker of an older schema refuses it: UnsupportedSchema)
    }
    data = encode(RolloutJobWire(payload=msgspec.Raw(raw), **fields))  # type: ignore[arg-type]
    if len(data) > limits.max_job_bytes:
        raise InvalidRequest(f"job is {len(data)} bytes, over the limit of {limits.max_job_bytes}")
    return RolloutJob(payload=payload, **fields), data  # type: ignore[arg-type]


def _check_arguments(
    payload: object, retry_policy: object, idempotency_key: object, session_id: object, limits: Limits
) -> None:
    """``InvalidRequest`` for an argument of the wrong type or value (the payload's own fields are
    checked once it is decoded as a worker decodes it)."""
    if not isinstance(payload, RolloutPayload):
        raise InvalidRequest(f"payload must be a RolloutPayload, got {type(payload).__name__}")
    if retry_policy not in RETRY_POLICIES:
        raise InvalidRequest(f"retry_policy must be one of {RETRY_POLICIES}, got {retry_policy!r}")
    if idempotency_key is not None and not isinstance(idempotency_key, str):
        raise InvalidRequest(f"idempotency_key must be a string, got {type(idempotency_key).__name__}")
    if idempotency_key is not None and not 1 <= len(idempotency_key) <= limits.max_key_chars:
        raise InvalidRequest(f"idempotency_key must have 1..{limits.max_key_chars} characters")
    if session_id is not None:
        check_token(session_id, "session_id")  # type: ignore[arg-type]


def _check_claim_outlives(retry_policy: str, wait_s: float, max_timeout_s: float | None) -> None:
    """A job whose holder's death ends it must find its claim until its deadline: a redelivery
    after the claim expired would start it a second time. ``InvalidRequest`` where it may wait
    (``wait_s``) longer than a claim is kept (``max_timeout_s``)."""
    if (
        retry_behaviour(retry_policy).holder_gone == "interrupted"
        and max_timeout_s is not None
        and wait_s > max_timeout_s
    ):
        raise InvalidRequest(
            f"an {retry_policy} job may wait at most {max_timeout_s:g} s (how long its claim is kept); "
            f"asked for {wait_s:g} s"
        )


__all__ = [
    "RETRY_POLICIES",
    "RetryPolicy",
    "asked_of",
    "build_job",
    "seconds",
    "whole_number",
]
