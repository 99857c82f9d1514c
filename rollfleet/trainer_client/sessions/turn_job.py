"""Storing a session turn's job: the one place a turn's request is written, whether asked for
the first time or asked again under the caller's key: its key, the session's retry policy and
id, and the constraint as the caller wrote it under the session's version policy (what the
fingerprint compares: a key asked again with another constraint is another request)."""

from __future__ import annotations

from rollfleet.schemas import RolloutPayload, SessionRecord, VersionConstraint
from rollfleet.schemas.asked import AskedConstraint
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.sessions import version_policy
from rollfleet.trainer_client.sessions.host import SessionHost


async def store_turn(
    host: SessionHost,
    record: SessionRecord,
    payload: RolloutPayload,
    constraint: VersionConstraint,
    own: AskedConstraint | None,
    *,
    key: str,
    timeout: float | None,
    replica: str | None,
    asked_at: float,
) -> RolloutHandle:
    """The turn's job under ``key``, at ``constraint`` (resolved), on ``replica``'s own subject
    where one is named; ``own``: the turn's own constraint, where it gave one."""
    return await host.submit_turn(
        payload,
        constraint,
        written=version_policy.written(record, own),
        key=key,
        timeout=timeout,
        retry_policy=record.retry_policy,
        session_id=record.session_id,
        replica=replica,
        asked_at=asked_at,
    )
