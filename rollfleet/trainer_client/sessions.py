"""Session: a multi-turn conversation with one policy, turn by turn, answered once each.

A session's turns are ordinary jobs with three additions:

- **Affinity.** A turn goes to the replica that served the previous one (its context is cached
  there) while that replica is live and can serve the turn's constraint: the job is stored on the
  replica's own subject and the replica is rung. If it has not taken the turn within
  ``affinity_wait_s``, or is gone, the same job moves to the constraint's shared subject and the
  session moves to whichever replica serves it (``RolloutClient._await_sticky``).
- **Version policy.** ``pinned``: every turn exactly at the version of the first (the newest a live
  replica serves when the session starts); ``monotonic``: each turn at a version at least that of
  the previous turn's last token; ``free``: each turn by the session's constraint alone.
- **Turns answered once.** Turn ``k`` has the idempotency key ``<session_id>/<k>``: asking for a
  turn again returns its stored answer, never a second generation. The record in the sessions
  bucket (settings, next turn, last version, replica) lets a restarted trainer resume.

A session ends on ``close`` (its record is deleted and its replica drops the cached context) or
after ``ttl`` seconds without a turn (the client's sweep does the same; the engine's own TTL
bounds what a replica keeps if no one tells it).
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from contextlib import suppress
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    Names,
    RetryPolicy,
    RolloutPayload,
    RolloutResult,
    SessionRecord,
    VersionConstraint,
    VersionPolicy,
    check_token,
    decode,
    encode,
)
from rollfleet.schemas.errors import (
    InvalidRequest,
    NoCompatibleReplica,
    RollfleetError,
    ServiceUnavailable,
    SessionConflict,
    UnknownSession,
)
from rollfleet.trainer_client.requests import constraint_from

if TYPE_CHECKING:
    from rollfleet.trainer_client.client import RolloutClient

log = get_logger("rollfleet.sessions")

_POLICIES = ("pinned", "monotonic", "free")


def turn_key(session_id: str, turn: int) -> str:
    """The idempotency key of a session's turn."""
    return f"{session_id}/{turn}"


class Session:
    """One open session; use ``async with client.session(...) as s`` (or ``await s.open()``)."""

    def __init__(
        self,
        client: RolloutClient,
        *,
        session_id: str | None,
        min_version: int | None,
        exact_version: int | None,
        max_staleness: int | None,
        version_policy: VersionPolicy,
        ttl: float,
        retry_policy: RetryPolicy,
        affinity_wait_s: float,
    ) -> None:
        if version_policy not in _POLICIES:
            raise InvalidRequest(f"version_policy must be one of {_POLICIES}, got {version_policy!r}")
        if not isinstance(ttl, int | float) or not ttl > 0:
            raise InvalidRequest(f"ttl must be a positive number of seconds, got {ttl!r}")
        if not isinstance(affinity_wait_s, int | float) or not affinity_wait_s >= 0:
            raise InvalidRequest(f"affinity_wait_s must be >= 0 seconds, got {affinity_wait_s!r}")
        constraint_from(min_version, exact_version, max_staleness, 0)  # the same checks as submit
        sid = session_id if session_id is not None else uuid.uuid4().hex
        check_token(sid, "session_id")
        now = time.time()
        self._client = client
        self._record = SessionRecord(
            session_id=sid,
            client_id=client.client_id,
            version_policy=version_policy,
            min_version=min_version,
            exact_version=exact_version,
            max_staleness=max_staleness,
            retry_policy=retry_policy,
            ttl_s=float(ttl),
            opened_at=now,
            touched_at=now,
        )
        self.affinity_wait_s = float(affinity_wait_s)
        self._kv: KeyValue | None = None
        self._opened = False
        self._closed = False
        self._running: int | None = None  # the turn being generated
        self._answers: dict[int, RolloutResult] = {}  # this process's answered turns

    # -- opening and closing -------------------------------------------------------------------
    @classmethod
    async def resume(cls, client: RolloutClient, session_id: str, *, affinity_wait_s: float = 2.0) -> Session:
        check_token(session_id, "session_id")
        record = await _read(await client._sessions_kv(), client.names, session_id)
        if record is None:
            raise UnknownSession(f"no open session {session_id!r} (never opened, closed, or expired)")
        session = cls(
            client,
            session_id=session_id,
            min_version=record.min_version,
            exact_version=record.exact_version,
            max_staleness=record.max_staleness,
            version_policy=record.version_policy,
            ttl=record.ttl_s,
            retry_policy=record.retry_policy,
            affinity_wait_s=affinity_wait_s,
        )
        return await session.open()

    async def open(self) -> Session:
        """Create the session's record, or resume the live one with the same id and settings."""
        if self._opened:
            return self
        client, names = self._client, self._client.names
        try:
            self._kv = await client._sessions_kv()
            stored = await _read(self._kv, names, self.session_id)
            if stored is None:
                await self._kv.create(names.session_key(self.session_id), encode(self._record))
            else:
                if stored.client_id != client.client_id:
                    raise SessionConflict(f"session {self.session_id!r} belongs to client {stored.client_id!r}")
                if stored.settings() != self._record.settings():
                    raise SessionConflict(
                        f"session {self.session_id!r} is open with other settings {stored.settings()}; "
                        f"asked for {self._record.settings()}"
                    )
                self._record = stored
        except nats.js.errors.KeyWrongLastSequenceError:
            raise SessionConflict(f"session {self.session_id!r} was opened concurrently elsewhere") from None
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise ServiceUnavailable(f"cannot open session {self.session_id!r}: {exc}") from exc
        self._opened = True
        client._sessions[self.session_id] = self
        return self

    async def close(self) -> None:
        """End the session: its record is deleted and its replica drops the cached context."""
        if self._closed:
            return
        self._closed = True
        self._client._sessions.pop(self.session_id, None)
        names = self._client.names
        if self._record.replica is not None:
            with suppress(Exception):
                await self._client.nc.publish(
                    names.bell_subject(self._record.replica), names.end_session_payload(self.session_id)
                )
        if self._kv is not None:
            with suppress(Exception):
                await self._kv.delete(names.session_key(self.session_id))
        log.debug("session closed", session_id=self.session_id, turns=self._record.next_turn)

    def idle_past_ttl(self, now: float) -> bool:
        return self._running is None and now - self._record.touched_at > self._record.ttl_s

    async def __aenter__(self) -> Session:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- reading -----------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self._record.session_id

    @property
    def next_turn(self) -> int:
        return self._record.next_turn

    @property
    def replica(self) -> str | None:
        """The replica that served the last turn (where the session's context is cached)."""
        return self._record.replica

    @property
    def record(self) -> SessionRecord:
        return self._record

    # -- turns -------------------------------------------------------------------------------
    async def generate(
        self, payload: RolloutPayload, *, turn: int | None = None, timeout: float | None = None
    ) -> RolloutResult:
        """Run the next turn (its prompt: the whole context so far) and return its result, or
        raise its typed error. ``turn``: an earlier turn's index returns that turn's stored
        answer (a retry); a later one is ``SessionConflict``."""
        if not self._opened:
            await self.open()
        if self._closed:
            raise UnknownSession(f"session {self.session_id!r} is closed")
        if self.idle_past_ttl(time.time()):
            await self.close()
            raise UnknownSession(f"session {self.session_id!r} expired (no turn for {self._record.ttl_s:g} s)")
        nxt = self._record.next_turn
        if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or turn < 0):
            raise InvalidRequest(f"turn must be a non-negative int, got {turn!r}")
        if turn is not None and turn < nxt:
            return await self._stored_answer(turn, timeout)
        if turn is not None and turn > nxt:
            raise SessionConflict(f"turn {turn} is out of order: the next turn of {self.session_id!r} is {nxt}")
        if self._running is not None:
            raise SessionConflict(f"turn {self._running} of {self.session_id!r} is still running")
        constraint = self._constraint()
        previous, sticky = self._record.replica, self._sticky(constraint)
        self._running = nxt
        try:
            handle = await self._client._submit(
                payload,
                constraint,
                idempotency_key=turn_key(self.session_id, nxt),
                deadline=None,
                timeout=timeout,
                retry_policy=self._record.retry_policy,
                session_id=self.session_id,
                replica=sticky,
            )
            self._record.next_turn = nxt + 1  # the key is used: this turn is answered once, whatever comes
            self._record.touched_at = time.time()
            if handle.replica is not None:
                result = await self._client._await_sticky(handle, self.affinity_wait_s)
            else:
                result = await handle.result()
            self._record.replica = result.worker_id  # where its context is cached now
            if self._record.version_policy == "monotonic":
                self._record.last_version = max(self._record.last_version or 0, result.version_end)
        finally:
            self._running = None
            await self._save()
        self._answered(nxt, result, previous)
        return result

    def _constraint(self) -> VersionConstraint:
        r = self._record
        latest = self._client.latest_version
        base = constraint_from(r.min_version, r.exact_version, r.max_staleness, latest)
        if r.version_policy == "pinned":
            if r.last_version is None:
                r.last_version = self._pin(base)
            return VersionConstraint("exact", r.last_version)
        if r.version_policy == "monotonic" and base.kind == "min" and r.last_version is not None:
            return VersionConstraint("min", max(base.version, r.last_version))
        return base

    def _pin(self, base: VersionConstraint) -> int:
        """A pinned session's version: the newest a live replica serves within the constraint."""
        if base.kind == "exact":
            return base.version
        serving = [r.active_version for r in self._client.fleet.compatible(base) if base.allows(r.active_version)]
        if not serving:
            raise NoCompatibleReplica(f"no live replica serves a version allowed by {base} to pin the session to")
        return max(serving)

    def _sticky(self, constraint: VersionConstraint) -> str | None:
        """The replica to send the turn to: the previous turn's, while live and able; for a
        session's first turn (or when that replica cannot take it), the able replica holding
        the fewest of this client's sessions, so sessions spread evenly and stay spread (a
        first turn left to the pulls lands wherever slots were free at that instant)."""
        fleet = self._client.fleet
        replica = self._record.replica
        if replica is not None:
            status = fleet.replica(replica)
            if status is not None and status.takes_now(constraint):
                return replica
        able = [r.worker_id for r in fleet.compatible(constraint) if r.takes_now(constraint)]
        if not able:
            return None  # the shared subjects: whichever replica activates a compatible version
        held = Counter(s.replica for s in self._client._sessions.values() if s is not self)
        return min(able, key=lambda w: (held[w], random.random()))

    def _answered(self, turn: int, result: RolloutResult, previous: str | None) -> None:
        metrics = self._client.metrics
        metrics.session_turns.inc()
        metrics.prefix_tokens_reused.inc(result.cached_tokens)
        if previous is not None and result.worker_id == previous:
            metrics.affinity_hits.inc()
        self._answers[turn] = result

    async def _stored_answer(self, turn: int, timeout: float | None) -> RolloutResult:
        answer = self._answers.get(turn)
        if answer is not None:
            return answer
        return await self._client.result(turn_key(self.session_id, turn), timeout=timeout)

    async def _save(self) -> None:
        """Store the record after a turn; a result is not lost if this fails (it is in the
        results stream under the turn's key)."""
        if self._kv is None or self._closed:
            return
        try:
            await self._kv.put(self._client.names.session_key(self.session_id), encode(self._record))
        except Exception as exc:
            log.warning("session record not stored", session_id=self.session_id, error=str(exc))


async def _read(kv: KeyValue, names: Names, session_id: str) -> SessionRecord | None:
    """A live session's record; None if there is none or it expired (then it is removed)."""
    try:
        entry = await kv.get(names.session_key(session_id))
    except nats.js.errors.KeyNotFoundError:
        return None
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        raise ServiceUnavailable(f"cannot read session {session_id!r}: {exc}") from exc
    if not entry.value:
        return None
    try:
        record = decode(entry.value, SessionRecord, what="session record")
    except RollfleetError as exc:
        log.warning("undecodable session record ignored", session_id=session_id, error=exc.message)
        return None
    if time.time() - record.touched_at > record.ttl_s:
        with suppress(Exception):
            await kv.delete(names.session_key(session_id))
        return None
    return record


async def expire_idle(sessions: list[Session]) -> None:
    """Close the sessions idle past their ttl (called by the client's sweep)."""
    now = time.time()
    for session in sessions:
        if session.idle_past_ttl(now):
            log.info("session expired", session_id=session.session_id, ttl_s=session.record.ttl_s)
            await session.close()
