"""Pull requests on one durable JetStream consumer, with messages handed over as they arrive.

nats-py's ``fetch`` returns a batch only when it is full or timed out, and turns an empty
pull into a long poll. Both sides of rollfleet want something else: the client wants each
result the moment it is stored; a worker wants either an immediate answer (``no_wait``,
to walk its subjects in priority order) or a request that waits at the server for up to
its free slots. One request is outstanding at a time, so its end (a status message, or the
whole batch delivered) is unambiguous and ``outstanding`` is exact.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

_STATUS = "Status"
_HEARTBEAT = "100"
_GRACE_S = 1.0  # a request whose end was lost (e.g. in a reconnect) is given up after this
_HEARTBEAT_S = 1.0  # long requests ask for server heartbeats, so a request lost in a
# fail-over (the consumer's leader moved) is noticed in seconds, not at its expiry


class PullConsumer:
    def __init__(self, nc: NATS, stream: str, consumer: str, on_msg: Callable[[Msg], Awaitable[None] | None]) -> None:
        self._nc = nc
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._on_msg = on_msg
        self._sub = None
        self._left = 0  # messages the current request may still deliver
        self._deadline = 0.0
        self._heartbeat_s = 0.0  # 0: the request has no heartbeats
        self._last_seen = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self.delivered = 0  # total messages handed to on_msg
        self.on_idle: Callable[[], None] | None = None

    async def start(self) -> PullConsumer:
        self._sub = await self._nc.subscribe(self._inbox, cb=self._receive)
        return self

    @property
    def outstanding(self) -> int:
        """Messages asked for and not yet delivered (0 when no request is open)."""
        self._expire_if_overdue()
        return self._left

    @property
    def busy(self) -> bool:
        return self.outstanding > 0

    async def request(self, batch: int, wait_s: float | None = None) -> None:
        """Ask for up to ``batch`` messages: those available now (``wait_s`` None), or also
        those that arrive within ``wait_s`` seconds."""
        if self.busy:
            raise RuntimeError("a pull request is already open on this consumer")
        body: dict[str, object] = {"batch": batch}
        self._heartbeat_s = 0.0
        if wait_s is None:
            body["no_wait"] = True
        else:
            body["expires"] = int(wait_s * 1e9)
            if wait_s >= 4 * _HEARTBEAT_S:
                body["idle_heartbeat"] = int(_HEARTBEAT_S * 1e9)
                self._heartbeat_s = _HEARTBEAT_S
        self._left = batch
        self._last_seen = time.monotonic()
        self._deadline = self._last_seen + (wait_s or 0.0) + _GRACE_S
        self._idle.clear()
        await self._nc.publish(self._api, json.dumps(body).encode(), reply=self._inbox)

    async def wait_idle(self, timeout: float | None = None) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            self._expire_if_overdue()

    async def _receive(self, msg: Msg) -> None:
        self._last_seen = time.monotonic()
        headers = msg.headers
        if headers and _STATUS in headers:
            if headers[_STATUS] != _HEARTBEAT:
                self._end()  # 404 nothing now, 408 expired, 409 consumer gone or limits: request over
            return
        self.delivered += 1
        if self._left > 0:
            self._left -= 1
            if self._left == 0:
                self._end()
        handled = self._on_msg(msg)
        if inspect.isawaitable(handled):
            await handled

    def _end(self) -> None:
        self._left = 0
        if not self._idle.is_set():
            self._idle.set()
            if self.on_idle is not None:
                self.on_idle()

    def reset(self) -> None:
        """Forget the open request: after a reconnect the broker may have dropped it unseen."""
        self._end()

    def _expire_if_overdue(self) -> None:
        if not self._left:
            return
        now = time.monotonic()
        silent = self._heartbeat_s and now - self._last_seen > 3 * self._heartbeat_s
        if now > self._deadline or silent:
            self._end()

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed
                pass
            self._sub = None
