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
a late save, and a turn is not started on a closed session.

A turn whose job was never stored (no live replica could take it: ``NoCompatibleReplica`` at
submit) does not spend its index: the same turn can be asked again. A turn whose job was stored
is answered once, with a result or an error, and asked again returns that.

A session ends on ``close`` (its record is deleted and its replica drops the cached context) or
after ``ttl`` seconds without a turn (the client's sweep does the same; the engine's own TTL
bounds what a replica keeps if no one tells it).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable
from contextlib import suppress

from rollfleet.broker.buckets import KVBucket
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    RetryPolicy,
    RolloutPayload,
    RolloutResult,
    SessionRecord,
    TurnFailure,
    VersionConstraint,
    VersionPolicy,
    check_token,
    decode,
    encode,
    error_from_code,
)
from rollfleet.schemas.asked import AskedConstraint
from rollfleet.schemas.errors import (
    BrokerError,
    Expired,
    Fenced,
    IdempotencyConflict,
    InvalidRequest,
    NoCompatibleReplica,
    NotFound,
    RollfleetError,
    ServiceUnavailable,
    SessionConflict,
    UnknownSession,
)
from rollfleet.schemas.messages import refuses_while_activating
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.requests import asked_of
from rollfleet.trainer_client.sessions.host import SessionHost
from rollfleet.trainer_client.sessions.sticky import await_turn

log = get_logger("rollfleet.sessions")

POLICIES = ("pinned", "monotonic", "free")
# A turn answered at its deadline still gets this long to save the session's record.
SAVE_GRACE_S = 1.0
_FAILURES_KEPT = 16  # turn failures remembered in the record (asked again, they raise again)
_KEYS_KEPT = 256  # callers' own turn keys remembered in the record (asked again, they answer again)
# Turns whose placement a ``generate`` watches (``await_turn``): a second ``generate`` of the same
# turn (a retry under the caller's key while it runs, through another handle of the session)
# waits for its answer instead of watching, and moving, it a second time.
_WATCHED: weakref.WeakSet[RolloutHandle] = weakref.WeakSet()


def turn_key(session_id: str, incarnation: str, turn: int) -> str:
    """The idempotency key of a session's turn."""
    return f"{session_id}/{incarnation}/{turn}" if incarnation else f"{session_id}/{turn}"


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
        if version_policy not in POLICIES:
            raise InvalidRequest(f"version_policy must be one of {POLICIES}, got {version_policy!r}")
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not ttl > 0:
            raise InvalidRequest(f"ttl must be a positive number of seconds, got {ttl!r}")
        if not isinstance(affinity_wait_s, int | float) or not affinity_wait_s >= 0:
            raise InvalidRequest(f"affinity_wait_s must be >= 0 seconds, got {affinity_wait_s!r}")
        AskedConstraint.of(min_version, exact_version, max_staleness)  # the same checks as submit
        sid = session_id if session_id is not None else uuid.uuid4().hex
        check_token(sid, "session_id")
        now = time.time()
        self._host = host
        self._record = SessionRecord(
            session_id=sid,
            client_id=host.client_id,
            version_policy=version_policy,
            min_version=min_version,
            exact_version=exact_version,
            max_staleness=max_staleness,
            retry_policy=retry_policy,
            ttl_s=float(ttl),
            opened_at=now,
            touched_at=now,
            incarnation=uuid.uuid4().hex[:12],
        )
        self.affinity_wait_s = float(affinity_wait_s)
        self._kv: KVBucket | None = None
        self._revision: int | None = None  # of the record as this handle last wrote or read it
        self._opened = False
        self._closed = False
        self._running: int | None = None  # the turn being generated
        self._heading: str | None = None  # the replica the running turn was sent to
        self._answers: dict[int, RolloutResult] = {}  # this process's answered turns
        self._errors: dict[int, RollfleetError] = {}  # ... and turns answered with an error

    # -- opening and closing -------------------------------------------------------------------
    @classmethod
    async def resume(cls, host: SessionHost, session_id: str, *, affinity_wait_s: float = 2.0) -> Session:
        check_token(session_id, "session_id")
        found = await _read(await host.sessions_kv(), host, session_id)
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
        key = host.names.session_key(self.session_id)
        try:
            self._kv = await host.sessions_kv()
            found = await _read(self._kv, host, self.session_id)
            if found is None:
                self._revision = await self._kv.create(key, encode(self._record))
            else:
                stored, revision = found
                if stored.client_id != host.client_id:
                    raise SessionConflict(f"session {self.session_id!r} belongs to client {stored.client_id!r}")
                if stored.settings() != self._record.settings():
                    raise SessionConflict(
                        f"session {self.session_id!r} is open with other settings {stored.settings()}; "
                        f"asked for {self._record.settings()}"
                    )
                self._record, self._revision = stored, revision
        except Fenced:
            raise SessionConflict(f"session {self.session_id!r} was opened concurrently elsewhere") from None
        except BrokerError as exc:
            raise ServiceUnavailable(f"cannot open session {self.session_id!r}: {exc}") from exc
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
        if self._kv is not None and self._revision is not None:
            # Only the incarnation this handle opened (a newer one under the same id is not ours).
            with suppress(Exception):
                revision = await self._current_revision()
                if revision is not None:
                    await self._kv.delete(host.names.session_key(self.session_id), revision)
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
        return turn_key(self.session_id, self._record.incarnation, turn)

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
        if turn is not None and self._asked_turn(turn, nxt) < nxt:
            return await self._stored_answer(turn, timeout)
        if key is not None and key in self._record.keys:
            return await self._asked_again(payload, key, own, timeout, asked_at, submitted)
        await self._may_start()
        constraint = self._constraint(own)
        previous, sticky = self._record.replica, self._sticky(constraint)
        self._running, self._heading = nxt, sticky  # (no await between: the next burst's choice sees it)
        spent = False
        due: float | None = None  # the turn's deadline, once its job is built
        try:
            handle = await self._host.submit_turn(
                payload,
                constraint,
                written=self._written(own),
                key=key if key is not None else self.turn_key(nxt),
                timeout=timeout,
                retry_policy=self._record.retry_policy,
                session_id=self.session_id,
                replica=sticky,
                asked_at=asked_at,
            )
            spent, due = handle.stored, handle.job.deadline  # stored: this turn is answered once
            if spent:
                self._note_spent(nxt, key, handle, submitted)
            result = await self._watch(handle)
            self._note_served(result)
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
            raise self._index_taken(nxt) from exc
        except RollfleetError as exc:
            explained = self._explained(exc)
            if spent:
                self._failed(nxt, explained)
            if explained is not exc:
                raise explained from exc
            raise
        finally:
            self._running = self._heading = None
            if spent:
                await self._save(due)
        self._answered(nxt, result, previous)
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

    def _asked_turn(self, turn: object, nxt: int) -> int:
        """The turn index a caller asked for, checked: an earlier one or the next (a later one is
        out of order)."""
        if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
            raise InvalidRequest(f"turn must be a non-negative int, got {turn!r}")
        if turn > nxt:
            raise SessionConflict(f"turn {turn} is out of order: the next turn of {self.session_id!r} is {nxt}")
        return turn

    def _note_spent(
        self, nxt: int, key: str | None, handle: RolloutHandle, submitted: Callable[[RolloutHandle], None] | None
    ) -> None:
        """Turn ``nxt``'s job is stored: the index is spent, whatever its answer; the caller is
        handed the turn's handle (``submitted``)."""
        self._record.next_turn = nxt + 1
        self._record.touched_at = time.time()
        if key is not None:
            self._note_key(key, nxt)
        if submitted is not None:
            submitted(handle)

    async def _may_start(self) -> None:
        """A new turn may start: none of this handle's is running, and the session is open."""
        if self._running is not None:
            raise SessionConflict(f"turn {self._running} of {self.session_id!r} is still running")
        await self._check_still_open()

    def _note_served(self, result: RolloutResult) -> None:
        """Where the session's context is cached now, and the version its policy holds it to."""
        self._record.replica = result.worker_id
        if self._record.version_policy == "monotonic":
            self._record.last_version = max(self._record.last_version or 0, result.version_end)
        elif self._record.version_policy == "pinned":
            # The pin is the version its turns were served at: a resumed session's first turn
            # may be the one a dead client stored, pinned to the newest version of its moment
            # (its pin was never saved); this handle's own guess yields to it.
            self._record.last_version = result.version_end

    def _index_taken(self, nxt: int) -> SessionConflict:
        """A turn's key is the session's own (``turn_key``): another request under it means this
        index was stored by another handle of this incarnation whose record of it this one
        never read (its save lost with a broker store rolled back, or its client killed
        before saving; campaign 12, seed 167). The index is taken, not failed: its own answer
        is what ``generate(turn=nxt)`` returns, and the caller's next turn is the one after."""
        self._record.next_turn = max(self._record.next_turn, nxt + 1)
        self._record.touched_at = time.time()
        return SessionConflict(
            f"turn {nxt} of session {self.session_id!r} was already asked with another prompt (by another "
            f"handle of this session, or by a client before a restart whose record of it was lost); "
            f"generate(turn={nxt}) returns its answer, and the next turn is {nxt + 1}"
        )

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
        r = self._record
        # (Built again only if the key's job and answer are gone: at the constraint as asked, or
        # at the pin; the policy's floor has moved with the turns since, and is not this turn's.)
        constraint = (own or self._asked()).resolve(self._host.latest_version)
        if r.version_policy == "pinned" and r.last_version is not None:
            constraint = VersionConstraint("exact", r.last_version)
        handle = await self._host.submit_turn(
            payload,
            constraint,
            written=self._written(own),
            key=key,
            timeout=timeout,
            retry_policy=self._record.retry_policy,
            session_id=self.session_id,
            replica=None,
            asked_at=asked_at,
        )
        if submitted is not None and handle.stored:
            submitted(handle)
        return await self._watch(handle)

    async def _watch(self, handle: RolloutHandle) -> RolloutResult:
        """The turn's answer, its placement watched by one ``generate`` at a time (``_WATCHED``)."""
        if handle in _WATCHED:
            return await handle
        _WATCHED.add(handle)
        try:
            return await await_turn(self._host.placement, handle, self.affinity_wait_s)
        finally:
            _WATCHED.discard(handle)

    def _note_key(self, key: str, turn: int) -> None:
        keys = self._record.keys
        keys[key] = turn
        for old in sorted(keys, key=keys.__getitem__)[:-_KEYS_KEPT]:
            del keys[old]

    def _key_of(self, turn: int) -> str:
        """The key turn ``turn``'s job was stored under: the caller's own, or the session's."""
        return next((k for k, t in self._record.keys.items() if t == turn), None) or self.turn_key(turn)

    def _asked(self) -> AskedConstraint:
        """The session's own constraint, as its record keeps it (checked when it was opened)."""
        r = self._record
        return AskedConstraint.of(r.min_version, r.exact_version, r.max_staleness)

    def _written(self, own: AskedConstraint | None = None) -> str:
        """The turn's request as its caller wrote it: the session's settings, or the turn's own
        constraint (for the fingerprint: a key asked again with another constraint is another request)."""
        r = self._record
        return f"session:{r.version_policy}:{(own or self._asked()).written}"

    def _constraint(self, own: AskedConstraint | None = None) -> VersionConstraint:
        """The turn's constraint: its own (else the session's), under the version policy. The
        policy narrows it, never widens it: a turn is never answered outside what it asked."""
        r = self._record
        latest = self._host.latest_version
        base = (own or self._asked()).resolve(latest)
        if r.version_policy == "pinned":
            if r.last_version is None:
                r.last_version = self._pin(base)
            if own is not None and not base.allows(r.last_version):  # (the session's own moved on with latest)
                raise InvalidRequest(f"session {self.session_id!r} is pinned to version {r.last_version}, "
                                     f"which this turn's constraint {base} does not allow")  # fmt: skip
            self._check_pin_served(r.last_version)
            return VersionConstraint("exact", r.last_version)
        if r.version_policy == "monotonic" and r.last_version is not None:
            if base.kind == "min":
                return VersionConstraint("min", max(base.version, r.last_version))
            if base.version < r.last_version:  # (an exact turn older than the session has gone)
                raise InvalidRequest(f"session {self.session_id!r} is monotonic and its last turn ran at "
                                     f"version {r.last_version}: a turn cannot ask for {base}")  # fmt: skip
        return base

    def _pin(self, base: VersionConstraint) -> int:
        """A pinned session's version: the newest a live replica serves within the constraint."""
        if base.kind == "exact":
            return base.version
        fleet = self._host.fleet
        serving = [r.active_version for r in fleet.compatible(base) if base.allows(r.active_version)]
        if not serving:
            raise NoCompatibleReplica(f"no live replica serves a version allowed by {base} to pin the session to")
        return max(serving)

    def _check_pin_served(self, pin: int) -> None:
        """A pinned session whose version no live replica serves any more fails here, before its
        turn is spent, with an error that says so. Replicas only move forward: once every live
        replica is past the pin, or behind it while a newer version is committed (a replica
        catching up goes to the newest), it is hopeless (not retryable) unless an operator starts
        one held at that version (``rollfleet worker --hold-version``): ``pin_may_be_served``."""
        fleet = self._host.fleet
        if fleet.compatible(VersionConstraint("exact", pin)):
            return
        live = fleet.replicas()
        hopeless = bool(live) and not pin_may_be_served(
            [(r.state, r.active_version, r.preparing_version) for r in live], pin, fleet.latest_version
        )
        seen = ", ".join(f"{r.worker_id}@{r.active_version}" for r in live) or "empty"
        err = NoCompatibleReplica(
            f"session {self.session_id!r} is pinned to version {pin} (version_policy='pinned'), and no live "
            f"replica serves version {pin} (fleet: {seen}). "
            + (
                f"Every replica has moved past it: start one held at it (rollfleet worker --store STORE "
                f"--hold-version {pin}) to finish this session, or open a new session."
                if hopeless
                else f"A replica at version {pin} may come back; retry, or start one held at it "
                f"(rollfleet worker --store STORE --hold-version {pin})."
            )
        )
        err.retryable = not hopeless
        raise err

    def _explained(self, exc: RollfleetError) -> RollfleetError:
        """A pinned session's turn refused or withdrawn for want of a replica at its pin (the fleet
        moved on between the check and the submit, or while the turn waited) says so, as the
        check before the turn does; any other error as it is."""
        pin = self._record.last_version
        if self._record.version_policy != "pinned" or pin is None or not isinstance(exc, NoCompatibleReplica):
            return exc
        try:
            self._check_pin_served(pin)
        except NoCompatibleReplica as pinned:
            return pinned
        return exc

    def _sticky(self, constraint: VersionConstraint) -> str | None:
        """The replica to send the turn to: the previous turn's, while live and able; for a
        session's first turn (or when that replica cannot take it), the able replica holding
        the fewest of this client's sessions, so sessions spread evenly and stay spread (a
        first turn left to the pulls lands wherever slots were free at that instant)."""
        fleet = self._host.fleet
        replica = self._record.replica
        if replica is not None:
            status = fleet.replica(replica)
            if status is not None and status.takes_now(constraint):
                return replica
        able = [r.worker_id for r in fleet.compatible(constraint) if r.takes_now(constraint)]
        if not able:
            return None  # the shared subjects: whichever replica activates a compatible version
        held = Counter(s.placed_on for s in self._host.sessions.values() if s is not self)
        return fewest_held(able, held)

    def _answered(self, turn: int, result: RolloutResult, previous: str | None) -> None:
        metrics = self._host.metrics
        metrics.session_turns.inc()
        metrics.prefix_tokens_reused.inc(result.cached_tokens)
        if previous is not None and result.worker_id == previous:
            metrics.affinity_hits.inc()
        self._answers[turn] = result

    def _failed(self, turn: int, exc: RollfleetError) -> None:
        """A stored turn answered with an error: asked again, it raises the same error (a worker's
        failure is also stored as the turn's answer; the client's own, Expired or a withdrawal,
        only here and in the record)."""
        self._errors[turn] = exc
        failures = self._record.failures
        failures[turn] = TurnFailure(code=exc.code, message=exc.message, retryable=exc.retryable)
        for old in sorted(failures)[:-_FAILURES_KEPT]:
            del failures[old]

    async def _stored_answer(self, turn: int, timeout: float | None) -> RolloutResult:
        answer = self._answers.get(turn)
        if answer is not None:
            return answer
        if turn in self._errors:
            raise self._errors[turn]
        failure = self._record.failures.get(turn)
        if failure is not None:
            raise error_from_code(failure.code, failure.message, failure.retryable)
        wait = self._host.default_timeout_s if timeout is None else timeout
        try:
            return await self._host.result(self._key_of(turn), timeout=wait)
        except TimeoutError:
            raise Expired(
                f"no answer to turn {turn} of session {self.session_id!r} arrived within {wait:g} s"
            ) from None

    # -- the record ----------------------------------------------------------------------------
    async def _current_revision(self) -> int | None:
        """The revision of this incarnation's record, None if it is gone (closed or replaced)."""
        assert self._kv is not None
        found = await _read(self._kv, self._host, self.session_id)
        if found is None or found[0].incarnation != self._record.incarnation:
            return None
        return found[1]

    async def _check_still_open(self) -> None:
        """Before a turn starts: the session was not closed through another handle meanwhile."""
        if self._kv is None:
            return
        try:
            revision = await self._current_revision()
        except ServiceUnavailable:
            return  # the broker is away: the turn's own submit says so
        if revision is None:
            self._closed = True
            if self._host.sessions.get(self.session_id) is self:
                del self._host.sessions[self.session_id]
            raise UnknownSession(f"session {self.session_id!r} was closed (or expired) elsewhere")

    async def _save(self, due: float | None = None) -> None:
        """Store the record after a turn, only over the revision this handle last saw: a record
        deleted by a close elsewhere stays deleted. A result is not lost if this fails (it is in
        the results stream under the turn's key). ``due``: the turn's deadline; the save waits at
        most until then (or ``SAVE_GRACE_S``), so a broker that does not answer never holds the
        turn's answer back from its caller past the deadline."""
        if self._kv is None or self._closed or self._revision is None:
            return
        key = self._host.names.session_key(self.session_id)
        wait = None if due is None else max(SAVE_GRACE_S, due - time.time())
        try:  # (the whole save, merge included, is bounded: a timeout's next save merges)
            await asyncio.wait_for(self._store(key), wait)
        except Exception as exc:
            log.warning("session record not stored", session_id=self.session_id, error=str(exc) or type(exc).__name__)

    async def _store(self, key: str) -> None:
        assert self._kv is not None
        try:
            self._revision = await self._kv.update(key, encode(self._record), self._revision)
        except Fenced:
            await self._save_over_newer(key)

    async def _save_over_newer(self, key: str) -> None:
        """The record changed since this handle saw it: closed elsewhere (then this handle is
        closed too), or advanced by another handle of the same incarnation (then merged)."""
        assert self._kv is not None
        try:
            found = await _read(self._kv, self._host, self.session_id)
            if found is None or found[0].incarnation != self._record.incarnation:
                log.info("session closed elsewhere; record not brought back", session_id=self.session_id)
                self._closed = True
                if self._host.sessions.get(self.session_id) is self:
                    del self._host.sessions[self.session_id]
                return
            other, revision = found
            if other.next_turn > self._record.next_turn:
                self._record.next_turn = other.next_turn
            self._record.failures = {**other.failures, **self._record.failures}
            self._record.keys = {**other.keys, **self._record.keys}
            self._revision = await self._kv.update(key, encode(self._record), revision)
        except Exception as exc:
            log.warning("session record not stored", session_id=self.session_id, error=str(exc))


def fewest_held(able: list[str], held: Counter[str | None], rng: random.Random | None = None) -> str:
    """The able replica holding the fewest sessions (placed or heading there), ties broken at
    random so that concurrent clients do not all pick the same one."""
    draw = (rng or random).random
    return min(able, key=lambda w: (held[w], draw()))


async def _read(kv: KVBucket, host: SessionHost, session_id: str) -> tuple[SessionRecord, int] | None:
    """A live session's record and its revision; None if there is none or it expired (then it is removed)."""
    key = host.names.session_key(session_id)
    try:
        entry = await kv.get(key)
    except NotFound:
        return None
    except BrokerError as exc:
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
            await kv.delete(key, entry.revision)
        return None
    return record, int(entry.revision or 0)


async def expire_idle(sessions: list[Session]) -> None:
    """Close the sessions idle past their ttl (called by the client's sweep)."""
    now = time.time()
    for session in sessions:
        if session.idle_past_ttl(now):
            log.info("session expired", session_id=session.session_id, ttl_s=session.record.ttl_s)
            await session.close()


def pin_may_be_served(replicas: list[tuple[str, int, int | None]], pin: int, latest: int | None) -> bool:
    """Whether a live replica (state, active version, preparing version) may yet serve a pinned
    session's version: one at it that is neither stopping nor activating a newer one (its engine
    down, or preparing: a failed prepare keeps it at the pin), one preparing it, or one behind it
    while it is the newest commit (catching up to it). A replica past it never comes back
    (versions only move forward), nor does one behind it once a newer version is committed (a
    replica catching up goes to the newest), nor one at it that is activating a newer version
    (it has prepared it and takes no more exact jobs for the pin: only a failing engine load would
    leave it there, a guess no caller should wait on; campaign 12, seed 211). A starting replica
    serves no version yet: only what it prepares, or catching up, counts."""
    for state, active, preparing in replicas:
        if state == "starting":
            active = -1  # (its active version is a placeholder: it serves nothing yet, see ``can_serve``)
        # (a pinned turn is an exact job: the rule for those while activating is the replicas' own)
        leaving = state == "draining" or (state == "activating" and refuses_while_activating("exact"))
        if active == pin and not leaving:
            return True
        if preparing == pin:
            return True
        if active < pin and (latest is None or latest <= pin):
            return True
    return False


def _own_constraint(
    constraint: AskedConstraint | None, min_version: int | None, exact_version: int | None, max_staleness: int | None
) -> AskedConstraint | None:
    """A turn's own constraint where it gives one (checked as ``submit`` checks it), else None."""
    if constraint is None and (min_version, exact_version, max_staleness) == (None, None, None):
        return None
    return asked_of(constraint, min_version, exact_version, max_staleness)
