"""A session's record: its settings, checked as it is made, and what it keeps of its turns.

The settings (constraint, version policy, ttl, retry policy) are checked as ``submit`` checks
its arguments (``InvalidRequest``), and a record is made with a fresh incarnation: a session
opened again under the id of a closed one never meets the old one's answers.

Turn ``k`` has the idempotency key ``<session_id>/<incarnation>/<k>`` (``turn_key``), unless it
was asked under a key of the caller's own, which the record then remembers (the newest
``KEYS_KEPT``). A turn's index is spent once its job is stored, whatever its answer; a failed
turn's error is remembered (the newest ``FAILURES_KEPT``), so asked again it raises again. These
rules change the record in place; saving it is ``session_store``'s.
"""

from __future__ import annotations

import time
import uuid

from rollfleet.schemas import RetryPolicy, SessionRecord, TurnFailure, VersionPolicy, check_token
from rollfleet.schemas.asked import AskedConstraint
from rollfleet.schemas.errors import InvalidRequest, RollfleetError, SessionConflict
from rollfleet.trainer_client.sessions.version_policy import POLICIES

FAILURES_KEPT = 16  # turn failures remembered in the record (asked again, they raise again)
KEYS_KEPT = 256  # callers' own turn keys remembered in the record (asked again, they answer again)


def check_settings(
    version_policy: object,
    ttl: object,
    affinity_wait_s: object,
    min_version: int | None,
    exact_version: int | None,
    max_staleness: int | None,
) -> None:
    """A session's settings, checked before anything is made of them (``InvalidRequest``)."""
    if version_policy not in POLICIES:
        raise InvalidRequest(f"version_policy must be one of {POLICIES}, got {version_policy!r}")
    if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not ttl > 0:
        raise InvalidRequest(f"ttl must be a positive number of seconds, got {ttl!r}")
    if not isinstance(affinity_wait_s, int | float) or not affinity_wait_s >= 0:
        raise InvalidRequest(f"affinity_wait_s must be >= 0 seconds, got {affinity_wait_s!r}")
    AskedConstraint.of(min_version, exact_version, max_staleness)  # the same checks as submit


def new_record(
    client_id: str,
    session_id: str | None,
    *,
    min_version: int | None,
    exact_version: int | None,
    max_staleness: int | None,
    version_policy: VersionPolicy,
    ttl: float,
    retry_policy: RetryPolicy,
) -> SessionRecord:
    """A new session's record (settings checked by ``check_settings``), under ``session_id`` or a
    fresh one, with a fresh incarnation."""
    sid = session_id if session_id is not None else uuid.uuid4().hex
    check_token(sid, "session_id")
    now = time.time()
    return SessionRecord(
        session_id=sid,
        client_id=client_id,
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


def turn_key(session_id: str, incarnation: str, turn: int) -> str:
    """The idempotency key of a session's turn."""
    return f"{session_id}/{incarnation}/{turn}" if incarnation else f"{session_id}/{turn}"


def key_of(r: SessionRecord, turn: int) -> str:
    """The key turn ``turn``'s job was stored under: the caller's own, or the session's."""
    return next((k for k, t in r.keys.items() if t == turn), None) or turn_key(r.session_id, r.incarnation, turn)


def checked_turn(session_id: str, turn: object, nxt: int) -> int:
    """The turn index a caller asked for, checked: an earlier one or the next (a later one is
    out of order)."""
    if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
        raise InvalidRequest(f"turn must be a non-negative int, got {turn!r}")
    if turn > nxt:
        raise SessionConflict(f"turn {turn} is out of order: the next turn of {session_id!r} is {nxt}")
    return turn


def note_spent(r: SessionRecord, nxt: int, key: str | None) -> None:
    """Turn ``nxt``'s job is stored: the index is spent, whatever its answer."""
    r.next_turn = nxt + 1
    r.touched_at = time.time()
    if key is not None:
        note_key(r, key, nxt)


def note_key(r: SessionRecord, key: str, turn: int) -> None:
    keys = r.keys
    keys[key] = turn
    for old in sorted(keys, key=keys.__getitem__)[:-KEYS_KEPT]:
        del keys[old]


def note_failure(r: SessionRecord, turn: int, exc: RollfleetError) -> None:
    """A stored turn answered with an error, as the record keeps it."""
    failures = r.failures
    failures[turn] = TurnFailure(code=exc.code, message=exc.message, retryable=exc.retryable)
    for old in sorted(failures)[:-FAILURES_KEPT]:
        del failures[old]


def index_taken(r: SessionRecord, nxt: int) -> SessionConflict:
    """A turn's key is the session's own (``turn_key``): another request under it means this
    index was stored by another handle of this incarnation whose record of it this one
    never read (its save lost with a broker store rolled back, or its client killed
    before saving; campaign 12, seed 167). The index is taken, not failed: its own answer
    is what ``generate(turn=nxt)`` returns, and the caller's next turn is the one after."""
    r.next_turn = max(r.next_turn, nxt + 1)
    r.touched_at = time.time()
    return SessionConflict(
        f"turn {nxt} of session {r.session_id!r} was already asked with another prompt (by another "
        f"handle of this session, or by a client before a restart whose record of it was lost); "
        f"generate(turn={nxt}) returns its answer, and the next turn is {nxt + 1}"
    )
