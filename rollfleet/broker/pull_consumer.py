"""Pull requests on one durable JetStream consumer, with messages handed over as they arrive.

nats-py's ``fetch`` returns a batch only when it is full or timed out, and turns an empty
pull into a long poll. Both sides of rollfleet want something else: the client wants each
result the moment it is stored; a worker wants either an immediate answer (``no_wait``, to
walk its subjects in priority order) or requests that wait at the server, for a long time and
at no cost while nothing happens, for up to its free slots.

Accounting is exact: every request gets its own reply subject under one wildcard inbox, so
each status that ends a request (404, 408, 409, 503) is matched to it, and ``outstanding`` is
the number of messages the open requests may still deliver. Waiting requests may overlap (a
top-up next to an older one); a ``no_wait`` request is only sent when nothing is open, so its
404 ends exactly what is outstanding.

``cancel`` ends every open request now: the inbox is drained (the server stops delivering
once it sees the unsubscribe, and what it sent before is still handed to ``on_msg``) and a
fresh inbox is used from then on. It costs no stored or routed message, only protocol
operations, which makes it the tool for every case where a request must not live on: a
subject the worker may no longer take, a reconnect or a consumer leader change (the broker
may have dropped the request without a word), consolidating overlapping requests.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from rollfleet.broker.errors import (
    DESCRIPTION_HEADER,
    MAX_WAITING_DESCRIPTION,
    NO_RESPONDERS_STATUS,
    STATUS_HEADER,
    pull_refused,
)
from rollfleet.runtime.aio import wait_event
from rollfleet.runtime.logs import get_logger

_PENDING = "Nats-Pending-Messages"
_HEARTBEAT = "100"
log = get_logger("rollfleet.broker.pull")
# A cancel whose old inbox took longer than this to drain is said (it holds whatever awaits it,
# the pull loop included).
_SLOW_DRAIN_S = 1.0
GRACE_S = 2.0  # a request whose end was never seen is given up this long after its expiry
_DRAIN_S = 5.0


@dataclass(slots=True)
class _Open:
    batch: int
    deadline: float  # monotonic: expiry + grace
    waiting: bool


def _header(headers: dict[str, Any], name: str) -> str:
    """A header by name; nats-py keys some of them by an enum that only compares equal to the name."""
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k == name), "")
    return str(value)


class PullConsumer:
    def __init__(self, nc: NATS, stream: str, consumer: str, on_msg: Callable[[Msg], Awaitable[None] | None]) -> None:
        self._nc = nc
        self.stream = stream
        self.consumer = consumer
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._on_msg = on_msg
        self._sub: Any = None
        self._prefix = ""
        self._tokens = itertools.count()
        self._open: dict[str, _Open] = {}
        self._overdue_at: float | None = None  # when every open request is past its expiry (None: not known)
        self._left = 0  # messages the open requests may still deliver
        self._idle = asyncio.Event()
        self._idle.set()
        self._cancelling: asyncio.Future[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.delivered = 0  # total messages handed to on_msg
        self.last_delivery = 0.0  # monotonic time of the last one
        self.requested_at = 0.0  # monotonic time of the last request
        self.expired = 0  # waiting requests that ran out (408) without filling
        self.missing = False  # the consumer did not exist when a request reached the server (503)
        self.refused_at = -1.0  # monotonic time the server last refused a request (409: max_waiting reached)
        self.on_end: Callable[[], None] | None = None  # a request ended, or all it asked for came

    async def start(self) -> PullConsumer:
        self._prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._prefix + ".*", cb=self._receive)
        return self

    @property
    def outstanding(self) -> int:
        """Messages asked for and not yet delivered (0 when no request is open)."""
        self._expire_if_overdue()
        return self._left

    @property
    def busy(self) -> bool:
        return self.outstanding > 0 or self._cancelling is not None

    @property
    def waiting(self) -> bool:
        """Whether a request is waiting at the server (not a ``no_wait`` one)."""
        return self.busy and any(r.waiting for r in self._open.values())

    async def request(self, batch: int, wait_s: float | None = None) -> None:
        """Ask for up to ``batch`` messages: those available now (``wait_s`` None), or also
        those that arrive within ``wait_s`` seconds (then it may overlap open waiting requests)."""
        if self._cancelling is not None:
            await asyncio.shield(self._cancelling)
        if batch <= 0:
            return
        if self._left and (wait_s is None or not self.waiting):
            raise RuntimeError("a no_wait pull request is only sent, or followed, when nothing else is open")
        # (Formatted, not json.dumps'd: two integers, on every top-up of a busy worker.)
        if wait_s is None:
            body = b'{"batch":%d,"no_wait":true}' % batch
        else:
            body = b'{"batch":%d,"expires":%d}' % (batch, int(wait_s * 1e9))
        token = str(next(self._tokens))
        self.requested_at = now = time.monotonic()
        self._open[token] = _Open(batch, now + (wait_s or 0.0) + GRACE_S, wait_s is not None)
        self._overdue_at = None
        self._left += batch
        self._idle.clear()
        await self._nc.publish(self._api, body, reply=f"{self._prefix}.{token}")

    async def fetch_now(self, batch: int, timeout: float = 5.0) -> int:
        """A ``no_wait`` request, awaited to its end or ``timeout``: how many messages it
        delivered (``busy`` after it: no answer yet, the request still open)."""
        before = self.delivered
        await self.request(batch)
        await self.wait_idle(timeout)
        if self.busy:
            log.debug("no_wait pull unanswered", consumer=self.consumer, waited_s=timeout)
        return self.delivered - before

    async def wait_idle(self, timeout: float | None = None) -> None:
        if not await wait_event(self._idle, timeout):
            self._expire_if_overdue()

    async def _receive(self, msg: Msg) -> None:
        headers = msg.headers
        status = headers.get(STATUS_HEADER) if headers else None
        if status is not None:
            self._ended(msg.subject, status, headers or {})
            return
        self.delivered += 1
        self.last_delivery = time.monotonic()
        if self._left > 0:
            self._left -= 1
            if self._left == 0:
                self._end()
        handled = self._on_msg(msg)
        if inspect.isawaitable(handled):
            await handled

    def _ended(self, subject: str, status: str, headers: dict[str, Any]) -> None:
        """A status on a request's own reply subject: that request is over (404, 408, 409, 503)."""
        if status == _HEARTBEAT:
            return
        request = self._open.pop(subject.rpartition(".")[2], None)
        self._overdue_at = None
        if request is None:
            return  # a request of an earlier inbox or already given up
        pending = _header(headers, _PENDING)
        if pending.isdigit():
            undelivered = int(pending)  # 408 (and 409 on a leader change): exact
        elif status == "404":
            undelivered = self._left  # no_wait: it was the only open request
        elif pull_refused(status, _header(headers, DESCRIPTION_HEADER)):
            undelivered = request.batch  # refused on arrival: nothing was delivered for it
            self.missing = self.missing or status == NO_RESPONDERS_STATUS
            if MAX_WAITING_DESCRIPTION in _header(headers, DESCRIPTION_HEADER):
                self.refused_at = time.monotonic()
        else:  # e.g. 409 Consumer Deleted: the rest is unknown; end everything cleanly
            self._spawn(self.cancel())
            return
        if status == "408" and request.waiting:
            self.expired += 1
        self._left = max(0, self._left - undelivered)
        if self._left == 0:
            self._end()
        elif self.on_end is not None:
            self.on_end()

    def _end(self) -> None:
        self._left = 0
        self._open.clear()
        self._overdue_at = None
        if not self._idle.is_set():
            self._idle.set()
            if self.on_end is not None:
                self.on_end()

    def _expire_if_overdue(self) -> None:
        """Open requests all past their expiry and still owing messages: their ends were lost
        (e.g. in a fail-over). Give them up; the inbox is replaced before the next request."""
        if not self._left or self._cancelling is not None:
            return
        # (Read on every slot count: the latest expiry is worked out only when the open requests
        # changed, not on each look.)
        if self._overdue_at is None:
            self._overdue_at = max((r.deadline for r in self._open.values()), default=0.0)
        if time.monotonic() > self._overdue_at:
            self._spawn(self.cancel())

    async def cancel(self) -> None:
        """End every open request now. When this returns, no message of theirs is still to come,
        and those that came were handed to ``on_msg``."""
        if self._cancelling is not None:
            await asyncio.shield(self._cancelling)
            return
        self._cancelling = asyncio.get_running_loop().create_future()
        try:
            old, self._sub = self._sub, None
            self._prefix = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(self._prefix + ".*", cb=self._receive)
            if old is not None:
                began = time.monotonic()
                try:
                    await asyncio.wait_for(old.drain(), _DRAIN_S)
                except Exception:  # connection closed or reconnecting: nothing more can come
                    with suppress(Exception):
                        await old.unsubscribe()
                if (took := time.monotonic() - began) > _SLOW_DRAIN_S:
                    log.info("pull cancel slow to drain", consumer=self.consumer, drain_s=round(took, 3))
        finally:
            done, self._cancelling = self._cancelling, None
            done.set_result(None)
            self._end()

    def reset(self) -> None:
        """After a reconnect: the broker may have dropped the open requests unseen (or may
        deliver to them again); end them all, from a callback that cannot await."""
        self._spawn(self.cancel())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._sub is not None:
            with suppress(Exception):  # connection already closed
                await self._sub.unsubscribe()
            self._sub = None


def delivery_info(reply: str | None) -> tuple[int, float, int] | None:
    """``(num_delivered, stored_at, num_pending)`` of a JetStream delivery, read from its ack
    subject (``$JS.ACK.[<domain>.<account>.]<stream>.<consumer>.<delivered>.<stream seq>.<consumer
    seq>.<nanos>.<pending>[.<token>]``) without building nats-py's metadata objects; None if it is
    not one. ``num_pending``: what the consumer still holds for later pull requests."""
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    dots = reply.count(".")
    if dots == 8:  # the short form: the last five tokens
        tail = reply.rsplit(".", 5)
    elif dots in (10, 11):  # with domain and account hash (and a random token last)
        tail = reply.rsplit(".", 5 + dots - 10)
    else:
        return None
    try:
        return int(tail[1]), int(tail[4]) / 1e9, int(tail[5])
    except ValueError:
        return None
