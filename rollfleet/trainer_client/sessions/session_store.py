"""A session's record in the sessions bucket, as one handle of the session sees it.

The record (settings, incarnation, next turn, last version, replica, the newest failures and
callers' keys) lets a restarted trainer resume. Every write of it is a compare-and-set on the
revision this handle last saw: a session closed through another handle is never brought back by
a late save, and a turn is not started on a closed session. A save that finds the record advanced
by another handle of the same incarnation merges the two.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress

from rollfleet.broker.buckets import KVBucket
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, SessionRecord, decode, encode
from rollfleet.schemas.errors import (
    BrokerError,
    Fenced,
    NotFound,
    RollfleetError,
    ServiceUnavailable,
    SessionConflict,
)
from rollfleet.trainer_client.sessions.host import SessionHost

log = get_logger("rollfleet.sessions")

# A turn answered at its deadline still gets this long to save the session's record.
SAVE_GRACE_S = 1.0


class SessionStore:
    """The record of one session in the bucket, written only over the revision last seen here."""

    def __init__(self, host: SessionHost, session_id: str, closed_elsewhere: Callable[[], None]) -> None:
        self._host = host
        self._session_id = session_id
        self._closed_elsewhere = closed_elsewhere  # (a save found the record gone: the handle is closed)
        self.kv: KVBucket | None = None
        self.revision: int | None = None  # of the record as this handle last wrote or read it

    async def create_or_join(self, record: SessionRecord) -> SessionRecord:
        """Create the session's record, or join the live one with the same id and settings; the
        record this handle goes on with."""
        host = self._host
        sid = self._session_id
        key = host.names.session_key(sid)
        try:
            self.kv = await host.sessions_kv()
            found = await read_record(self.kv, host.names, sid)
            if found is None:
                self.revision = await self.kv.create(key, encode(record))
                return record
            stored, revision = found
            if stored.client_id != host.client_id:
                raise SessionConflict(f"session {sid!r} belongs to client {stored.client_id!r}")
            if stored.settings() != record.settings():
                raise SessionConflict(
                    f"session {sid!r} is open with other settings {stored.settings()}; asked for {record.settings()}"
                )
            self.revision = revision
            return stored
        except Fenced:
            raise SessionConflict(f"session {sid!r} was opened concurrently elsewhere") from None
        except BrokerError as exc:
            raise ServiceUnavailable(f"cannot open session {sid!r}: {exc}") from exc

    async def delete(self, incarnation: str) -> None:
        """Delete the record, only the incarnation this handle opened (a newer one under the same
        id is not ours); errors are swallowed (the record's ttl ends it)."""
        if self.kv is None or self.revision is None:
            return
        with suppress(Exception):
            revision = await self.current_revision(incarnation)
            if revision is not None:
                await self.kv.delete(self._host.names.session_key(self._session_id), revision)

    async def current_revision(self, incarnation: str) -> int | None:
        """The revision of this incarnation's record, None if it is gone (closed or replaced)."""
        assert self.kv is not None
        found = await read_record(self.kv, self._host.names, self._session_id)
        if found is None or found[0].incarnation != incarnation:
            return None
        return found[1]

    async def gone(self, incarnation: str) -> bool:
        """Whether the record was closed (or expired) through another handle; False while the
        broker is away (the turn's own submit says so)."""
        if self.kv is None:
            return False
        try:
            revision = await self.current_revision(incarnation)
        except ServiceUnavailable:
            return False
        return revision is None

    async def save(self, record: SessionRecord, due: float | None = None) -> None:
        """Store the record after a turn, only over the revision this handle last saw: a record
        deleted by a close elsewhere stays deleted. A result is not lost if this fails (it is in
        the results stream under the turn's key). ``due``: the turn's deadline; the save waits at
        most until then (or ``SAVE_GRACE_S``), so a broker that does not answer never holds the
        turn's answer back from its caller past the deadline."""
        if self.kv is None or self.revision is None:
            return
        key = self._host.names.session_key(self._session_id)
        wait = None if due is None else max(SAVE_GRACE_S, due - time.time())
        try:  # (the whole save, merge included, is bounded: a timeout's next save merges)
            await asyncio.wait_for(self._store(key, record), wait)
        except Exception as exc:
            log.warning("session record not stored", session_id=self._session_id, error=str(exc) or type(exc).__name__)

    async def _store(self, key: str, record: SessionRecord) -> None:
        assert self.kv is not None
        try:
            self.revision = await self.kv.update(key, encode(record), self.revision)
        except Fenced:
            await self._save_over_newer(key, record)

    async def _save_over_newer(self, key: str, record: SessionRecord) -> None:
        """The record changed since this handle saw it: closed elsewhere (then this handle is
        closed too), or advanced by another handle of the same incarnation (then merged)."""
        assert self.kv is not None
        try:
            found = await read_record(self.kv, self._host.names, self._session_id)
            if found is None or found[0].incarnation != record.incarnation:
                log.info("session closed elsewhere; record not brought back", session_id=self._session_id)
                self._closed_elsewhere()
                return
            other, revision = found
            if other.next_turn > record.next_turn:
                record.next_turn = other.next_turn
            record.failures = {**other.failures, **record.failures}
            record.keys = {**other.keys, **record.keys}
            self.revision = await self.kv.update(key, encode(record), revision)
        except Exception as exc:
            log.warning("session record not stored", session_id=self._session_id, error=str(exc))


async def read_record(kv: KVBucket, names: Names, session_id: str) -> tuple[SessionRecord, int] | None:
    """A live session's record and its revision; None if there is none or it expired (then it is removed)."""
    key = names.session_key(session_id)
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
