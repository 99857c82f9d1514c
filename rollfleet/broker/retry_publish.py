"""Storing a message on a JetStream stream, retried until the broker acknowledges it.

Both sides store with an idempotency key as ``Nats-Msg-Id`` (jobs by the client, results by
the worker), so a retry never stores a second copy.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from rollfleet.broker.connection import redialed
from rollfleet.broker.errors import WRONG_LAST_SEQUENCE, no_responders
from rollfleet.runtime.aio import wait_event
from rollfleet.runtime.backoff import TRANSIENT_RETRY
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas.bounded_json import load_json
from rollfleet.schemas.errors import Fenced, InvalidRequest, ServiceUnavailable

log = get_logger("rollfleet.broker.retry_publish")

ATTEMPT_S = 1.5
_MAX_ACK_BYTES = 64 * 1024  # an acknowledgement is a few dozen bytes; an error one a few hundred
_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
_SWEEP_S = 0.25  # an attempt gives up between ATTEMPT_S and ATTEMPT_S + this


class _Ack(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


class _Retry(Exception):
    """An attempt that may succeed later: no answer in time, no responders, a broker-side error."""


class _AckedPublisher:
    """JetStream publishes that wait for the store's acknowledgement, all over one reply
    subscription of the connection: what ``js.publish`` does, with a counter for reply tokens,
    one sweep over the open attempts (four times a second, only while some are open) instead of
    a timer each, and the acknowledgement decoded by msgspec. It sits on the request path of
    every job and every result."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._tokens = itertools.count()
        # token -> (future, deadline, the connection's reconnect event when it was sent)
        self._waiting: dict[str, tuple[asyncio.Future[Msg], float, asyncio.Event | None]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._started: asyncio.Future[None] | None = None
        self.started = False  # its reply subscription is in place

    async def start(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                await self._nc.subscribe(self._prefix + ".*", cb=self._on_reply)
            except BaseException as exc:
                self._started.set_exception(exc)
                self._started = None
                raise
            self._started.set_result(None)
            self.started = True
        await self._started

    async def _on_reply(self, msg: Msg) -> None:
        waiting = self._waiting.pop(msg.subject[len(self._prefix) + 1 :], None)
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(msg)

    async def _sweep(self) -> None:
        """Give up the attempts past their time-out, and at once those sent before the connection
        dialed the broker again: the broker they went to may have taken them and gone (or
        restarted) without a word, and a retry, deduplicated by its message id, is answered now."""
        while self._waiting:
            reconnect = redialed(self._nc)
            if reconnect is None:
                await asyncio.sleep(_SWEEP_S)
            else:
                await wait_event(reconnect, _SWEEP_S)
            now = time.monotonic()
            for token, (future, deadline, sent_on) in list(self._waiting.items()):
                if sent_on is not None and sent_on.is_set():
                    why = "the connection dialed the broker again"
                elif deadline <= now:
                    why = f"no acknowledgement within {ATTEMPT_S}s"
                else:
                    continue
                del self._waiting[token]
                if not future.done():
                    future.set_exception(_Retry(why))
        self._sweeper = None

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], timeout: float) -> PubAck:
        token = str(next(self._tokens))
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (future, time.monotonic() + timeout, redialed(self._nc))
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep())
        try:
            await self._nc.publish(subject, data, reply=f"{self._prefix}.{token}", headers=headers)
            reply = await future
        finally:
            self._waiting.pop(token, None)
        if no_responders(reply.headers):
            raise _Retry("no stream answered (no responders)")
        try:
            ack = load_json(reply.data, what="the broker's acknowledgement", max_bytes=_MAX_ACK_BYTES, type_=_Ack)
        except InvalidRequest as exc:  # a garbled answer: the retry is deduplicated by the message id
            raise _Retry(exc.message) from None
        if ack.error is not None:
            description = ack.error.get("description", ack.error)
            if ack.error.get("err_code") == WRONG_LAST_SEQUENCE:
                expected = headers.get(_EXPECTED_LAST_SUBJECT_SEQ)
                raise Fenced(
                    f"broker refused the conditional write on {subject}: {description}",
                    subject=subject,
                    expected_seq=int(expected) if expected is not None and expected.isdigit() else None,
                )
            if ack.error.get("code") == 400:
                raise InvalidRequest(f"broker refused the message: {description}")
            raise _Retry(f"broker error: {description}")
        return PubAck(stream=ack.stream, seq=ack.seq, duplicate=ack.duplicate)


_publishers: weakref.WeakKeyDictionary[NATS, _AckedPublisher] = weakref.WeakKeyDictionary()


async def _publisher(js: JetStreamContext) -> _AckedPublisher:
    nc: NATS = js._nc
    publisher = _publishers.get(nc)
    if publisher is None:
        publisher = _publishers[nc] = _AckedPublisher(nc)
    await publisher.start()
    return publisher


def _started_publisher(js: JetStreamContext) -> _AckedPublisher | None:
    """The connection's publisher if it has started (every publish after the first): no
    coroutines to find it."""
    publisher = _publishers.get(js._nc)
    return publisher if publisher is not None and publisher.started else None


async def publish_retrying(
    js: JetStreamContext, subject: str, data: bytes, headers: dict[str, str], *, until: float
) -> PubAck:
    """Publish until the broker acknowledges, or raise ``ServiceUnavailable`` once ``until`` (unix
    time) has passed; a message the broker refuses outright is ``InvalidRequest``, and a conditional
    write refused because the subject moved on is ``Fenced`` (one of those).

    Short attempts, many of them: a publish sent to a stream leader that just died is never
    answered, and a retry (deduplicated by the message id) reaches the new leader as soon as
    there is one.
    """
    attempt = 0
    while True:
        try:
            publisher = _started_publisher(js) or await _publisher(js)
            return await publisher.publish(subject, data, headers, ATTEMPT_S)
        except InvalidRequest:
            raise
        except nats.errors.MaxPayloadError as exc:
            raise InvalidRequest(f"message of {len(data)} bytes is over the broker's max_payload") from exc
        except (_Retry, nats.errors.Error, OSError) as exc:  # or the connection's errors while it reconnects
            if time.time() >= until:
                raise ServiceUnavailable(f"cannot store the message on {subject}: {exc}") from exc
            log.debug("publish failed; retrying", subject=subject, attempt=attempt, error=str(exc))
            await asyncio.sleep(TRANSIENT_RETRY.delay_s(attempt))
            attempt += 1
