"""A replica's registry entry as the worker writes it: what it says when it starts, and what each
refresh reads of the replica. No I/O: what it reads comes in, the status goes out (the clock an
argument)."""

from __future__ import annotations

from rollfleet.schemas import ReplicaStatus
from rollfleet.workers.engines.session_cache import SessionCacheStats
from rollfleet.workers.resumable_run import ResumableGenerator


def held_version(hold_version: int | None, follows: bool, version: int) -> int | None:
    """The one version a replica serves and no other (None: it follows commits): the one it
    holds, else, where it follows nothing, the fixed checkpoint's."""
    if hold_version is not None:
        return hold_version
    return None if follows else version


def starting_status(
    worker_id: str,
    *,
    version: int,
    engine: str,
    capacity: int,
    heartbeat_s: float,
    held: int | None,
    now: float,
) -> ReplicaStatus:
    """The registry entry of a replica that is starting."""
    return ReplicaStatus(
        worker_id=worker_id,
        state="starting",
        active_version=version,
        engine=engine,
        capacity=capacity,
        in_flight=0,
        heartbeat_at=now,
        heartbeat_interval_s=heartbeat_s,
        started_at=now,
        held_version=held,
    )


def refresh(
    status: ReplicaStatus,
    *,
    in_flight: int,
    jobs_done: int,
    resumable: ResumableGenerator | None,
    sessions: SessionCacheStats | None,
) -> None:
    """What a refresh says of the replica now: jobs running and done, resumable jobs' tokens
    (None: no job runner yet), the sessions its engine holds."""
    status.in_flight = in_flight
    status.jobs_done = jobs_done
    if resumable is not None:
        status.resumed = resumable.resumed
        status.tokens_kept = resumable.tokens_kept
        status.tokens_regenerated = resumable.tokens_regenerated
    status.sessions = sessions.entries if sessions is not None else 0
