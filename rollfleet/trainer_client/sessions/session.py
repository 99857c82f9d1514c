"""Session: a multi-turn conversation with one policy, turn by turn, answered once each.

A session's turns are ordinary jobs with three additions:

- **Affinity.** A turn goes to the replica that served the previous one (its context is cached
  there) while that replica is live and can serve the turn's constraint: the job is stored on the
  replica's own subject and the replica is rung. When and why it moves: ``sessions.sticky``.
- **Version policy.** ``pinned``: every turn exactly at the version of the first (the newest a live
  replica serves when the session starts); ``monotonic``: each turn at a version at least that of
  the previous turn's last token; ``free``: each turn by the session's constraint alone.
- **Turns answered once.** Turn ``k`` has the idempotency key ``<session_id>/<incarnation>/<k>``
  (``turn_key``): asking for a turn again returns its stored answer (or raises its error), never a
  second generation. The incarnation is new at every open of an id, so a session opened again
  under the id of a closed one never meets the old one's answers. A turn may instead be asked
  under a key of the caller's own (``generate(key=...)``, what an HTTP client's
  ``Idempotency-Key`` is): its job is stored under that key, and asked again under it the turn is
  answered from its one run, as ``submit`` answers a key, without spending another index.
- **Each turn's own constraint.** A turn may carry its own version constraint
  (``generate(min_version=...)``, ...); the session's version policy applies on top of it, and
  an answer outside it is never returned.

The record in the sessions bucket (settings, incarnation, next turn, last version, replica, the
newest failures) lets a restarted trainer resume. Every write of it is a compare-and-set on the
revision this handle last saw: a session closed through another handle is never brought back by
a late save, and a turn is not started on a closed session (``session_store``). What the record
keeps of the turns: ``session_record``; the version policies: ``version_policy``; where a turn is
sent: ``turn_replica``.

A turn whose job was never stored (no live replica could take it: ``NoCompatibleReplica`` at
submit) does not spend its index: the same turn can be asked again. A turn whose job was stored
is answered once, with a result or an error, and asked again returns that.

A session ends on ``close`` (its record is deleted and its replica drops the cached context) or
after ``ttl`` seconds without a turn (the client's sweep does the same; the engine's own TTL
bounds what a replica keeps if no one tells it).
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable
from contextlib import suppress

from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    RetryPolicy,
    RolloutPayload,
    RolloutResult,
    SessionRecord,
    VersionConstraint,
    VersionPolicy,
    check_token,
)
from rollfleet.schemas.asked import AskedConstraint
from rollfleet.schemas.errors import (
    IdempotencyConflict,
    RollfleetError,
    SessionConflict,
    UnknownSession,
)
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.requests import asked_of
from rollfleet.trainer_client.sessions import session_record, version_policy
from rollfleet.trainer_client.sessions.host import SessionHost, TurnPlacement
from rollfleet.trainer_client.sessions.session_store import SessionStore, read_record
from rollfleet.trainer_client.sessions.sticky import await_turn
from rollfleet.trainer_client.sessions.turn_answers import TurnAnswers
from rollfleet.trainer_client.sessions.turn_job import store_turn
from rollfleet.trainer_client.sessions.turn_replica import turn_replica

log = get_logger("rollfleet.sessions")

# Turns whose placement a ``generate`` watches (``await_turn``): a second ``generate`` of the same
# turn (a retry under the caller's key while it runs, through another handle of the session)
# waits for its answer instead of watching, and moving, it a second time.
_WATCHED: weakref.WeakSet[RolloutHandle] = weakref.WeakSet()


class Session:
    """One open session; use ``async with client.session(...) as s`` (or ``await s.open()``)."""

    def __init__(
        self,
        host: SessionHost,
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
        session_record.check_settings(version_policy, ttl, affinity_wait_s, min_version, exact_version, max_staleness)
        self._host = host
        self._record = session_record.new_record(
            host.client_id,
            session_id,
            min_version=min_version,
            exact_version=exact_version,
            max_staleness=max_staleness,
            version_policy=version_policy,
            ttl=ttl,
            retry_policy=retry_policy,
        )
        self.affinity_wait_s = float(affinity_wait_s)
        self._store = SessionStore(host, self._record.session_id, self._closed_elsewhere)
        self._opened = False
        self._closed = False
        self._running: int | None = None  # the turn being generated
        self._heading: str | None = None  # the replica the running turn was sent to
        self._turns = TurnAnswers()  # (a turn asked again answers the same)

    # -- opening and closing -------------------------------------------------------------------
    @classmethod
    async def resume(cls, host: SessionHost, session_id: str, *, affinity_wait_s: float = 2.0) -> Session:
        check_token(session_id, "session_id")
        found = await read_record(await host.sessions_kv(), host.names, session_id)
        if found is None:
            raise UnknownSession(f"no open session {session_id!r} (never opened, closed, or expired)")
        record, _ = found
        session = cls(
            host,
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

    @property
    def closed(self) -> bool:
        return self._closed

    async def open(self) -> Session:
        """Create the session's record, or resume the live one with the same id and settings."""
        if self._opened:
            return self
        host = self._host
        self._record = await self._store.create_or_join(self._record)
        self._opened = True
        host.sessions[self.session_id] = self
        return self

    async def close(self) -> None:
        """End the session: its record is deleted and its replica drops the cached context."""
        if self._closed:
            return
        self._closed = True
        host = self._host
        if host.sessions.get(self.session_id) is self:
            del host.sessions[self.session_id]
        if self._record.replica is not None:
            with suppress(Exception):
                await host.end_session(self._record.replica, self.session_id)
        await self._store.delete(self._record.incarnation)
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
    def placed_on(self) -> str | None:
        """Where the session counts as placed: the replica its running turn was sent to, else
        the one holding its context. A first turn sent but not yet answered counts, so a burst of
        new sessions spreads over the fleet instead of all picking the replica that looked empty."""
        return self._heading or self._record.replica

    @property
    def record(self) -> SessionRecord:
        return self._record

    def turn_key(self, turn: int) -> str:
        return session_record.turn_key(self.session_id, self._record.incarnation, turn)

    # -- turns -------------------------------------------------------------------------------
    async def generate(
        self,
        payload: RolloutPayload,
        *,
        turn: int | None = None,
        timeout: float | None = None,
        key: str | None = None,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_staleness: int | None = None,
        constraint: AskedConstraint | None = None,
        submitted: Callable[[RolloutHandle], None] | None = None,
    ) -> RolloutResult:
        """Run the next turn (its prompt: the whole context so far) and return its result, or
        raise its typed error. ``turn``: an earlier turn's index returns that turn's answer (a
        retry: its result, or its error again); a later one is ``SessionConflict``. ``timeout``
        counts from this call (the session's own broker reads before the job is stored use it too).

        ``key``: the caller's own idempotency key for the turn: its job is stored under it (the
        answer names it); asked again under it, the turn is answered from its one run and no
        index is spent; the key with another request is ``IdempotencyConflict``, as for
        ``submit``. ``min_version``, ``exact_version``, ``max_staleness`` (or ``constraint``, the
        same built once): the turn's own constraint (else the session's), under the session's
        version policy. ``submitted``: called with the turn's handle as soon as its job is stored
        (a caller that leaves may cancel it)."""
        asked_at = time.time()
        own = _own_constraint(constraint, min_version, exact_version, max_staleness)
        await self._usable()
        nxt = self._record.next_turn
        if turn is not None and session_record.checked_turn(self.session_id, turn, nxt) < nxt:
            return await self._turns.of(self._host, self._record, turn, timeout)
        if key is not None and key in self._record.keys:
            return await self._asked_again(payload, key, own, timeout, asked_at, submitted)
        await self._may_start()
        return await self._next_turn(
            payload, own, nxt, key=key, timeout=timeout, asked_at=asked_at, submitted=submitted
        )

    async def _next_turn(
        self,
        payload: RolloutPayload,
        own: AskedConstraint | None,
        nxt: int,
        *,
        key: str | None,
        timeout: float | None,
        asked_at: float,
        submitted: Callable[[RolloutHandle], None] | None,
    ) -> RolloutResult:
        """Run turn ``nxt``, the session's next, on the replica it sticks to: its job stored (the
        index spent once it is), its answer awaited, the record saved by the turn's deadline."""
        constraint = version_policy.turn_constraint(self._record, own, self._host.fleet, self._host.latest_version)
        previous, sticky = self._record.replica, self._turn_replica(constraint)
        self._running, self._heading = nxt, sticky  # (no await between: the next burst's choice sees it)
        spent = False
        due: float | None = None  # the turn's deadline, once its job is built
        try:
            turn_key = key if key is not None else self.turn_key(nxt)
            handle = await store_turn(
                self._host, self._record, payload, constraint, own, key=turn_key, timeout=timeout, replica=sticky,
                asked_at=asked_at,
            )  # fmt: skip
            spent, due = handle.stored, handle.job.deadline  # stored: this turn is answered once
            if spent:
                self._note_spent(nxt, key, handle, submitted)
            result = await _watched(self._host.placement, handle, self.affinity_wait_s)
            version_policy.note_served(self._record, result)
        except IdempotencyConflict as exc:
            if key is not None:
                # The caller's key answers another request: nothing of this turn ran, and the
                # index is not spent (the caller's next turn under another key is this one).
                if spent:
                    self._record.next_turn = nxt
                    self._record.keys.pop(key, None)
                spent = False
                raise
            spent = True
            raise session_record.index_taken(self._record, nxt) from exc
        except RollfleetError as exc:
            explained = version_policy.explained(self._record, exc, self._host.fleet)
            if spent:
                self._turns.failed(self._record, nxt, explained)
            if explained is not exc:
                raise explained from exc
            raise
        finally:
            self._running = self._heading = None
            if spent:
                await self._save(due)
        self._turns.answered(self._host.metrics, nxt, result, previous)
        return result

    async def _usable(self) -> None:
        """Open the session where this handle has not yet; raise where it is closed or expired."""
        if not self._opened:
            await self.open()
        if self._closed:
            raise UnknownSession(f"session {self.session_id!r} is closed")
        if self.idle_past_ttl(time.time()):
            await self.close()
            raise UnknownSession(f"session {self.session_id!r} expired (no turn for {self._record.ttl_s:g} s)")

    def _note_spent(
        self, nxt: int, key: str | None, handle: RolloutHandle, submitted: Callable[[RolloutHandle], None] | None
    ) -> None:
        """Turn ``nxt``'s job is stored: the index is spent, whatever its answer; the caller is
        handed the turn's handle (``submitted``)."""
        session_record.note_spent(self._record, nxt, key)
        if submitted is not None:
            submitted(handle)

    async def _may_start(self) -> None:
        """A new turn may start: none of this handle's is running, and the session is open."""
        if self._running is not None:
            raise SessionConflict(f"turn {self._running} of {self.session_id!r} is still running")
        await self._check_still_open()

    async def _asked_again(
        self,
        payload: RolloutPayload,
        key: str,
        own: AskedConstraint | None,
        timeout: float | None,
        asked_at: float,
        submitted: Callable[[RolloutHandle], None] | None,
    ) -> RolloutResult:
        """A turn asked again under the caller's key: submitted again as the same request, so the
        answer is its one run's, as ``submit`` answers a key: the key's job while it runs, its
        stored answer after, whenever and through whichever client it is asked (past the broker's
        duplicate window the job is stored again, and the replica that pulls it finds it answered
        and says so: nothing runs twice). Only an answer the results stream no longer keeps is run
        again. The key with another request is the same ``IdempotencyConflict``. The session does
        not move on."""
        # (Built again only if the key's job and answer are gone: at the constraint as asked, or
        # at the pin; the policy's floor has moved with the turns since, and is not this turn's.)
        constraint = version_policy.asked_again_constraint(self._record, own, self._host.latest_version)
        handle = await store_turn(
            self._host, self._record, payload, constraint, own, key=key, timeout=timeout, replica=None,
            asked_at=asked_at,
        )  # fmt: skip
        if submitted is not None and handle.stored:
            submitted(handle)
        return await _watched(self._host.placement, handle, self.affinity_wait_s)

    # -- the record ----------------------------------------------------------------------------
    async def _check_still_open(self) -> None:
        """Before a turn starts: the session was not closed through another handle meanwhile."""
        if await self._store.gone(self._record.incarnation):
            self._closed_elsewhere()
            raise UnknownSession(f"session {self.session_id!r} was closed (or expired) elsewhere")

    def _closed_elsewhere(self) -> None:
        self._closed = True
        if self._host.sessions.get(self.session_id) is self:
            del self._host.sessions[self.session_id]

    async def _save(self, due: float | None = None) -> None:
        """Store the record after a turn (``SessionStore.save``), unless this handle is closed."""
        if self._closed:
            return
        await self._store.save(self._record, due)

    def _turn_replica(self, constraint: VersionConstraint) -> str | None:
        """The replica to send the turn to (``turn_replica``), spreading over the others' placements."""
        return turn_replica(
            self._host.fleet,
            self._record.replica,
            constraint,
            lambda: Counter(s.placed_on for s in self._host.sessions.values() if s is not self),
        )


async def _watched(placement: TurnPlacement, handle: RolloutHandle, affinity_wait_s: float) -> RolloutResult:
    """The turn's answer, its placement watched by one ``generate`` at a time (``_WATCHED``)."""
    if handle in _WATCHED:
        return await handle
    _WATCHED.add(handle)
    try:
        return await await_turn(placement, handle, affinity_wait_s)
    finally:
        _WATCHED.discard(handle)


async def expire_idle(sessions: list[Session]) -> None:
    """Close the sessions idle past their ttl (called by the client's sweep)."""
    now = time.time()
    for session in sessions:
        if session.idle_past_ttl(now):
            log.info("session expired", session_id=session.session_id, ttl_s=session.record.ttl_s)
            await session.close()


def _own_constraint(
    constraint: AskedConstraint | None, min_version: int | None, exact_version: int | None, max_staleness: int | None
) -> AskedConstraint | None:
    """A turn's own constraint where it gives one (checked as ``submit`` checks it), else None."""
    if constraint is None and (min_version, exact_version, max_staleness) == (None, None, None):
        return None
    return asked_of(constraint, min_version, exact_version, max_staleness)
