"""One live client per client_id: two would split its durable results between them.

A client answers on ``Names.client_alive_subject(client_id)`` while it lives. A new client
first asks there: an answer means the id is in use (``ClientIdInUse``). No answer means the
previous holder is gone; the new one writes its instance id to the key ``client.<id>`` of the
fleet bucket (compare-and-set against the revision it read before asking), having started to
answer first: of clients starting at the same moment only one goes on. The broker drops a dead
client's subscription with its connection, so a restarted trainer takes over at once,
without waiting out a time-out.
"""

from __future__ import annotations

import uuid

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from rollfleet.schemas import Names
from rollfleet.schemas.errors import ClientIdInUse

_ASK_S = 1.0


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
        kv = await self._js.key_value(self._names.fleet_bucket)
        key = self._names.client_key(self._client_id)
        try:
            seen: int | None = (await kv.get(key)).revision
        except nats.js.errors.KeyNotFoundError:
            seen = None
        holder = await self._ask(subject)
        if holder is not None:
            raise ClientIdInUse(self._in_use(holder))
        self._sub = await self._nc.subscribe(subject, cb=self._answer)
        await self._nc.flush()
        try:
            if seen is None:
                await kv.create(key, self.instance.encode())
            else:
                await kv.update(key, self.instance.encode(), last=seen)
        except nats.js.errors.KeyWrongLastSequenceError:
            await self.release()
            raise ClientIdInUse(self._in_use("a client starting at the same moment")) from None

    async def held(self) -> bool:
        """Whether the lease key still names this client (False after another took over)."""
        kv = await self._js.key_value(self._names.fleet_bucket)
        try:
            entry = await kv.get(self._names.client_key(self._client_id))
        except nats.js.errors.KeyNotFoundError:
            return False
        return entry.value == self.instance.encode()

    async def _ask(self, subject: str) -> str | None:
        try:
            reply = await self._nc.request(subject, b"", timeout=_ASK_S)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
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
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection may already be closed
                pass
            self._sub = None
