"""The claims bucket: which process runs a job, read and written by workers and clients alike.

A claim (``schemas.names.Claim``: a holder and when it last said it still runs the job) lies
under ``claim_key(job_id)``. Every write that decides something is conditional on the revision
the writer judged: one verdict wins, and the loser learns it by a typed refusal, ``Fenced``,
never by an error's text. A missing claim (never written, released, or deleted) is ``None``,
not an error. The broker's other errors are typed ones (``BrokerError``: a time-out, the
connection away, ...): whether an unanswered write was stored is unknown, and each caller
decides what that means for its job (a worker judges nothing then; a client says nothing).
"""

from __future__ import annotations

from typing import NamedTuple

from nats.js.kv import KeyValue

from rollfleet.broker.buckets import KVBucket
from rollfleet.schemas import Claim, claim_key
from rollfleet.schemas.errors import Fenced


class ClaimEntry(NamedTuple):
    value: bytes
    revision: int


class ClaimsBucket:
    """The claims bucket's operations that the job lifecycle needs, keyed by job id."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self._bucket = KVBucket(kv)

    async def get(self, job_id: str) -> ClaimEntry | None:
        """The job's claim as stored and its revision; None if there is none."""
        entry = await self._bucket.read(claim_key(job_id))
        return None if entry is None else ClaimEntry(entry.value, entry.revision)

    async def create(self, job_id: str, value: bytes) -> int:
        """Write the job's first claim; its revision. ``Fenced`` if a claim is there already."""
        key = claim_key(job_id)
        try:
            return await self._bucket.create(key, value)
        except Fenced:
            raise Fenced(f"claim {key} exists", subject=key) from None

    async def replace(self, job_id: str, value: bytes, revision: int) -> int:
        """Write over the claim at ``revision`` (the one judged); its new revision. ``Fenced`` if
        it moved since (refreshed, taken over, marked stopped, released)."""
        key = claim_key(job_id)
        try:
            return await self._bucket.update(key, value, revision)
        except Fenced:
            raise Fenced(f"claim {key} moved past revision {revision}", subject=key, expected_seq=revision) from None

    async def write(self, job_id: str, value: bytes, revision: int | None) -> int:
        """``replace`` over ``revision``, or ``create`` where there was none (None)."""
        if revision is None:
            return await self.create(job_id, value)
        return await self.replace(job_id, value, revision)

    async def mark_stopped(self, job_id: str, claim: Claim, revision: int) -> int:
        """Mark the claim read at ``revision`` as its holder's stopped one (refreshed at time 0):
        the replica that finds the job acts at once, and an ``at_most_once`` job is answered
        ``Interrupted``, never run again. ``Fenced`` if the claim moved since."""
        return await self.replace(job_id, claim.as_stopped().encode(), revision)

    async def put(self, job_id: str, value: bytes) -> int:
        """Write the claim whatever is there (an unconditional refresh)."""
        return await self._bucket.put(claim_key(job_id), value)

    async def delete(self, job_id: str, revision: int | None = None) -> None:
        """Remove the claim (only the one at ``revision`` if given: ``Fenced`` if it moved)."""
        key = claim_key(job_id)
        try:
            await self._bucket.delete(key, revision)
        except Fenced:
            raise Fenced(f"claim {key} moved past revision {revision}", subject=key, expected_seq=revision) from None
