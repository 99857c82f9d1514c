"""A client's multi-turn sessions: opening and resuming them (``RolloutClient.session``), and
what a ``Session`` asks of its client (``SessionHost``): the sessions bucket, a turn's job, the
bell that ends a session on its replica. One of ``RolloutClient``'s parts, by what it offers."""

from __future__ import annotations

from typing import Any

from rollfleet.broker.buckets import KVBucket, open_bucket
from rollfleet.broker.types import NATS, JetStreamContext
from rollfleet.schemas import Names, RetryPolicy, RolloutPayload, VersionConstraint, VersionPolicy
from rollfleet.schemas.bell_wire import end_session_payload
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.sessions import Session
from rollfleet.trainer_client.submitting import Submitter


class ClientSessions:
    nc: NATS
    js: JetStreamContext
    names: Names
    submitter: Submitter
    _sessions_bucket: KVBucket | None

    async def sessions_kv(self) -> KVBucket:
        """The sessions bucket, looked up once per client."""
        if self._sessions_bucket is None:
            self._sessions_bucket = await open_bucket(self.js, self.names.sessions_bucket)
        return self._sessions_bucket

    async def submit_turn(self, payload: RolloutPayload, constraint: VersionConstraint, **turn: Any) -> RolloutHandle:
        """A session's turn (``SessionHost.submit_turn``): a job under the turn's key, on its
        replica's own subject if it names one (``Submitter.submit_turn``)."""
        return await self.submitter.submit_turn(payload, constraint, **turn)

    async def end_session(self, replica: str, session_id: str) -> None:
        await self.nc.publish(self.names.bell_subject(replica), end_session_payload(session_id))

    def session(
        self,
        session_id: str | None = None,
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_staleness: int | None = None,
        version_policy: VersionPolicy = "monotonic",
        ttl: float = 600.0,
        retry_policy: RetryPolicy = "replayable",
        affinity_wait_s: float = 2.0,
    ) -> Session:
        """A multi-turn session (``async with client.session(...) as s: await s.generate(...)``):
        its turns stick to the replica that served the previous one, follow ``version_policy``
        (``pinned``: every turn at the first turn's version; ``monotonic``: never an older
        version than the previous turn; ``free``: each turn by the constraint alone), and are
        answered once each. Opening an existing id resumes it, with the same settings or
        ``SessionConflict``. Without a constraint: ``max_staleness=0`` at each turn."""
        if min_version is None and exact_version is None and max_staleness is None:
            max_staleness = 0
        return Session(
            self,  # type: ignore[arg-type]
            session_id=session_id,
            min_version=min_version,
            exact_version=exact_version,
            max_staleness=max_staleness,
            version_policy=version_policy,
            ttl=ttl,
            retry_policy=retry_policy,
            affinity_wait_s=affinity_wait_s,
        )

    async def resume_session(self, session_id: str, *, affinity_wait_s: float = 2.0) -> Session:
        """Reopen a session from its record (after a trainer restart); ``UnknownSession`` if it
        was never opened, was closed, or expired."""
        return await Session.resume(self, session_id, affinity_wait_s=affinity_wait_s)  # type: ignore[arg-type]
