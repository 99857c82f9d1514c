"""What a delivered job must be before it runs: decoded within the limits, checked, on the
subject its constraint names (or this replica's own), from a client id that is a valid token.

A delivery that is not is answered with ``InvalidRequest`` under the job's own id and
fingerprint wherever they can be read (a job of a newer schema, a value this worker does not
know): its caller accepts nothing else. Pure: bytes and names in, a job or an error out.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollfleet.schemas import JobAddress, Limits, Names, RolloutJob, check_job, decode_job, job_address
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.names import check_token


def checked_job(data: bytes, subject: str, *, limits: Limits, names: Names, own_subject: str) -> RolloutJob:
    """The job a delivery on ``subject`` carries; ``InvalidRequest`` where it may not run."""
    job = decode_job(data, max_bytes=limits.max_job_bytes)
    check_job(job, limits)
    parsed = names.parse_job_subject(subject)
    if subject != own_subject and parsed != (job.constraint.kind, job.constraint.version):
        raise InvalidRequest(f"job constraint {job.constraint} does not match its subject {subject}")
    check_token(job.client_id, "client_id")
    return job


@dataclass(frozen=True)
class RefusalAddress:
    """Where the refusal of an invalid job is stored, and the id and fingerprint it carries."""

    client_id: str | None
    key: str | None
    job_id: str | None
    fingerprint: str


def refusal_address(data: bytes, client_id: str | None, key: str | None) -> RefusalAddress:
    """The job's own client id and key where they can be read, else the delivery's headers'."""
    address = job_address(data) or JobAddress()
    if address.client_id and address.idempotency_key:
        client_id, key = address.client_id, address.idempotency_key
    return RefusalAddress(client_id, key, address.job_id, address.fingerprint)
