"""One live client per client_id: two would split its durable results between them.

A client answers on ``Names.client_alive_subject(client_id)`` while it lives. A new client
first asks there: an answer means the id is in use (``ClientIdInUse``). When the key
``client.<id>`` of the fleet bucket names another instance, a silent holder may be reconnecting
(its subscription comes back with its connection), so it is asked again for
``RECONNECT_GRACE_S`` (``takeover_wait_s``). No answer then means the previous holder is gone;
the new one writes its instance id to the key (compare-and-set against the revision it read
before asking), having started to answer first: of clients starting at the same moment only one
goes on. The broker drops a dead client's subscription with its connection, so a restarted
trainer takes over within that grace, without waiting out a lease's time-out.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import suppress
from typing import Literal

from rollfleet.broker.buckets import open_bucket
from rollfleet.broker.requests import ask
from rollfleet.broker.types import NATS, JetStreamContext, Msg, Subscription
from rollfleet.schemas import Names
from rollfleet.schemas.errors import BrokerTimeout, ClientIdInUse, Fenced, NoResponders

_ASK_S = 1.0
# A key naming another instance that does not answer: dead, or reconnecting (the broker restarted,
# or its link dropped: its subscription comes back with its connection). It is asked again for
# this long before the id is taken over (campaign seed 126: a second client took a live trainer's
# id 50 ms before the trainer's reconnect completed).
RECONNECT_GRACE_S = 2.0


def takeover_wait_s(named: str | None, instance: str) -> float:
    """How long a starting client keeps asking a silent holder before taking its id: none when no
    key names anyone else (a fresh id, or this instance), else ``RECONNECT_GRACE_S``."""
    return 0.0 if named is None or named == instance else RECONNECT_GRACE_S


def _named(value: bytes | None) -> str | None:
    """The instance a lease key's value names (None: empty)."""
    return (value or b"").decode(errors="replace") or None


def lease_held(named: str | None, instance: str, others_answering: list[str]) -> Literal["held", "lost", "rewrite"]:
    """Whether a client still holds its id, from what the lease key names and which other live
    clients answer on the id's subject: another live client answering means it took over; the key
    naming this client means held; a key lost or naming a dead holder (the broker lost or rolled
    back its store) is written back."""
    if others_answering:
        return "lost"
    if named == instance:
        return "held"
    return "rewrite"


class ClientLease:
    def __init__(self, nc: NATS, js: JetStreamContext, names: Names, client_id: str) -> None:
        self._nc = nc
        self._js = js
        self._names = names
        self._client_id = client_id
        self.instance = uuid.uuid4().hex[:12]
        self._sub: Subscription | None = None

    async def acquire(self) -> None:
        """Take the client_id, or raise ``ClientIdInUse`` if another live client holds it.

        The order closes the race of clients starting together: read the key's revision, ask,
        start answering, then compare-and-set against the revision read *before* asking. A
        client that read the key before another's write loses the compare-and-set; one that
        read it after finds the other answering (it answers before it writes)."""
        subject = self._names.client_alive_subject(self._client_id)
        kv = await open_bucket(self._js, self._names.fleet_bucket)
        key = self._names.client_key(self._client_id)
        entry = await kv.read(key)
        seen, named = (None, None) if entry is None else (entry.revision, _named(entry.value))
        holder = await self._ask(subject)
        wait = takeover_wait_s(named, self.instance)
        if holder is None and wait > 0:
            holder = await self._ask_until(subject, time.monotonic() + wait)
        if holder is not None:
            raise ClientIdInUse(self._in_use(holder))
        self._sub = await self._nc.subscribe(subject, cb=self._answer)
        await self._nc.flush()
        try:
            if seen is None:
                await kv.create(key, self.instance.encode())
            else:
                await kv.update(key, self.instance.encode(), seen)
        except Fenced:
            await self.release()
            raise ClientIdInUse(self._in_use("a client starting at the same moment")) from None

    async def held(self) -> bool:
        """Whether this client still holds the id (False after another took over).

        A key that no longer names this client is not proof of a take-over: the broker may have
        lost it (a store wiped: no key) or gone back to an older copy of it (a store rolled back:
        the key names a holder that died before). Only another live client answering on the
        id's subject is (``lease_held``); without one, the key is written back."""
        kv = await open_bucket(self._js, self._names.fleet_bucket)
        key = self._names.client_key(self._client_id)
        entry = await kv.read(key)
        named = None if entry is None else _named(entry.value)
        others = [] if named == self.instance else await self._others_answering()
        verdict = lease_held(named, self.instance, others)
        if verdict != "rewrite":
            return verdict == "held"
        try:
            if entry is None:
                await kv.create(key, self.instance.encode())
            else:
                await kv.update(key, self.instance.encode(), entry.revision)
        except Fenced:
            # Written meanwhile: by this client's other look (a reconnect's check and the
            # namespace's restore race), or by another client starting now.
            now = await kv.read(key)
            return now is not None and now.value == self.instance.encode()
        return True

    async def restore(self) -> None:
        """After the broker lost the fleet bucket: the key written back (see ``held``)."""
        if self._sub is not None:
            await self.held()

    async def _others_answering(self) -> list[str]:
        """The instances, other than this one, that answer on the id's subject within ``_ASK_S``."""
        inbox = self._nc.new_inbox()
        answers: list[str] = []

        async def take(msg: Msg) -> None:
            answers.append(msg.data.decode(errors="replace"))

        sub = await self._nc.subscribe(inbox, cb=take)
        try:
            await self._nc.publish(self._names.client_alive_subject(self._client_id), b"", reply=inbox)
            await asyncio.sleep(_ASK_S)
        finally:
            with suppress(Exception):
                await sub.unsubscribe()
        return [a for a in answers if a != self.instance]

    async def _ask_until(self, subject: str, until: float) -> str | None:
        """Ask again, every half second, until somebody answers or ``until`` passes."""
        while time.monotonic() < until:
            await asyncio.sleep(0.5)
            holder = await self._ask(subject)
            if holder is not None:
                return holder
        return None

    async def _ask(self, subject: str) -> str | None:
        try:
            reply = await ask(self._nc, subject, b"", timeout=_ASK_S)
        except (NoResponders, BrokerTimeout):
            return None
        return reply.data.decode(errors="replace") or "another client"

    async def _answer(self, msg: Msg) -> None:
        if msg.reply:
            await self._nc.publish(msg.reply, self.instance.encode())

    def _in_use(self, holder: str) -> str:
        return (
            f"client_id {self._client_id!r} is in use by a live client ({holder}); two clients with one id "
            "would split its results. Use another client_id, or stop the other client first."
        )

    async def release(self) -> None:
        """Stop answering, and remove the key if it still names this instance: the next client
        with the id then takes it at once (only a holder that died costs ``RECONNECT_GRACE_S``)."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection may already be closed
                pass
            self._sub = None
            with suppress(Exception):  # (best effort: a key left behind costs the next one the grace)
                kv = await open_bucket(self._js, self._names.fleet_bucket)
                entry = await kv.get(self._names.client_key(self._client_id))
                if entry.value == self.instance.encode():
                    await kv.delete(entry.key, entry.revision)
