"""The contract every side reads: messages, names, errors, limits, version constraints."""

from rollfleet.schemas.codec import decode, decode_event, decode_outcome, encode
from rollfleet.schemas.errors import *  # noqa: F403
from rollfleet.schemas.errors import RollfleetError, error_from_code
from rollfleet.schemas.limits import DEFAULT_LIMITS, Limits, check_job, check_payload
from rollfleet.schemas.messages import (
    SCHEMA_VERSION,
    Completion,
    ConstraintKind,
    Outcome,
    ReplicaStatus,
    RetryPolicy,
    RolloutFailure,
    RolloutJob,
    RolloutPayload,
    RolloutResult,
    SamplingParams,
    VersionActivated,
    VersionConstraint,
    VersionEvent,
    VersionPublished,
    VersionRecord,
    VersionSpan,
    version_spans,
)
from rollfleet.schemas.names import Names, check_token, key_token

__all__ = [
    "DEFAULT_LIMITS",
    "SCHEMA_VERSION",
    "Completion",
    "ConstraintKind",
    "Limits",
    "Names",
    "Outcome",
    "ReplicaStatus",
    "RetryPolicy",
    "RollfleetError",
    "RolloutFailure",
    "RolloutJob",
    "RolloutPayload",
    "RolloutResult",
    "SamplingParams",
    "VersionActivated",
    "VersionConstraint",
    "VersionEvent",
    "VersionPublished",
    "VersionRecord",
    "VersionSpan",
    "check_job",
    "check_payload",
    "check_token",
    "decode",
    "decode_event",
    "decode_outcome",
    "encode",
    "error_from_code",
    "key_token",
    "version_spans",
]
