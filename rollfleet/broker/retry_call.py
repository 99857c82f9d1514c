"""A broker call asked again while the broker recovers (a restart, a pause, a leader election).

A request sent while the connection redials is held and sent after it; one the broker took while
it was recovering its streams may go unanswered. Each of those is a timeout, and one more
attempt a moment later succeeds: a caller that gave up at the first would fail a request that
waiting a few seconds would have served (a submit just after a broker restart, as CI found).
Only what may pass is retried; a refusal (a bad request, a closed connection) is raised at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from nats.aio.client import Client as NATS

from rollfleet.broker.connection import redialed
from rollfleet.broker.errors import TRANSIENT_NATS
from rollfleet.runtime.backoff import TRANSIENT_RETRY
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas.errors import BrokerError, BrokerUnavailable, ServiceUnavailable

log = get_logger("rollfleet.broker.retry_call")

T = TypeVar("T")

# What a broker that is restarting, paused, electing a leader or not yet running JetStream answers:
# nats' own errors, or the typed one a port raised for them.
TRANSIENT: tuple[type[BaseException], ...] = (
    *TRANSIENT_NATS,
    BrokerUnavailable,
    OSError,  # (TimeoutError, asyncio's too, is one)
)


class Redialed(Exception):
    """The connection dialed the broker again while a call waited for its answer."""


async def _attempt(call: Callable[[], Awaitable[T]], reconnect: asyncio.Event | None) -> T:
    """One call, given up (``Redialed``) if the connection reconnects before it is answered."""
    if reconnect is None:
        return await call()
    answer = asyncio.ensure_future(call())
    redial = asyncio.ensure_future(reconnect.wait())
    try:
        await asyncio.wait({answer, redial}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        redial.cancel()
        if not answer.done():
            answer.cancel()  # (an idempotent call: asked again at once)
            # A cancel that lands as the answer comes is swallowed by the call's own wait (asyncio's
            # wait_for), and the call ends with the broker's answer, an error perhaps: it is read
            # here, else asyncio says "Task exception was never retrieved" (campaign 7).
            answer.add_done_callback(_read_given_up)
    if not answer.done():
        raise Redialed()
    return answer.result()


def _read_given_up(answer: asyncio.Future[object]) -> None:
    if not answer.cancelled() and (exc := answer.exception()) is not None:
        log.debug("a call given up at a redial ended", error=type(exc).__name__)


async def call_retrying(call: Callable[[], Awaitable[T]], *, until: float, what: str, nc: NATS | None = None) -> T:
    """``call()``'s result, asked again after each transient failure until ``until`` (unix time)
    has passed; then, or at once for any other broker error, ``ServiceUnavailable("cannot
    {what}: ...")``. The call must be safe to repeat (a look-up, or a create that first looks).
    With ``nc`` (rollfleet's connection), a call still unanswered when the connection dials the
    broker again is asked again at once, not after its time-out."""
    attempt = 0
    while True:
        try:
            return await _attempt(call, redialed(nc))
        except (Redialed, *TRANSIENT) as exc:
            if time.time() >= until:
                raise ServiceUnavailable(f"cannot {what}: {type(exc).__name__}") from exc
            log.debug("broker call failed; retrying", what=what, attempt=attempt, error=type(exc).__name__)
            if not isinstance(exc, Redialed):  # (a reconnect: the broker is back, ask at once)
                await asyncio.sleep(TRANSIENT_RETRY.delay_s(attempt))
            attempt += 1
        except (nats.errors.Error, BrokerError) as exc:
            raise ServiceUnavailable(f"cannot {what}: {exc}") from exc
