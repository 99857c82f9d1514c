"""A server process's start against a broker that is not ready yet: a cluster electing a leader
(JetStream answers 503, "temporarily unavailable"), a node cut off from its peers, a broker
restarting. A worker or a gateway tries its start again while the error is retryable, within a
bound, instead of exiting at the first refusal (a supervisor would restart it into the same
refusal; without one it stayed down). A person's one-off command still fails at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from rollfleet.broker.retry_call import TRANSIENT
from rollfleet.runtime.backoff import Backoff
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas.errors import BrokerError, ConnectionClosed, NotFound, RollfleetError, ServiceUnavailable

T = TypeVar("T")

STARTUP_WAIT_S = 60.0  # how long a start is tried again while the broker is not ready
# A start asked again: the same half second each time (an election takes about that; a start is
# a handful of reads, so asking twice a second for a minute costs the broker nothing).
STARTUP_RETRY = Backoff.fixed(0.5)

log = get_logger("rollfleet.broker.startup")


# What a broker that is not ready (stalled, restarting, electing, its store wiped meanwhile) raises
# from a step that does not translate its errors: what any call meets while the broker recovers
# (``retry_call.TRANSIENT``), and, at a start, a connection not made yet or given up, and a
# stream or bucket lost between two reads.
_NOT_READY = (
    *TRANSIENT,
    nats.errors.ConnectionClosedError,
    nats.errors.NoServersError,
    nats.js.errors.NotFoundError,
    ConnectionClosed,  # (the typed errors a port raised for those)
    NotFound,
)


def not_ready(exc: BaseException, what: str) -> RollfleetError | None:
    """``exc`` as a typed error if it says only that the broker is not ready (a retryable
    ``ServiceUnavailable``), else None. Without it a start whose reads met a broker stalled for
    longer than a request's time-out raised nats' own error, which nobody tried again: the process
    exited (a gateway started while its new broker stalled never listened)."""
    if isinstance(exc, _NOT_READY):
        return ServiceUnavailable(f"the broker is not ready ({what}): {type(exc).__name__}: {exc}")
    return None


def try_again(retryable: bool, elapsed_s: float, bound_s: float) -> bool:
    """Whether a start that failed with an error (``retryable`` as the error says) is tried again."""
    return retryable and elapsed_s < bound_s


async def until_ready(
    attempt: Callable[[], Awaitable[T]],
    *,
    what: str,
    bound_s: float = STARTUP_WAIT_S,
    retry: Backoff = STARTUP_RETRY,
    typed: bool = True,
) -> T:
    """``attempt()``'s result, tried again while it fails with a retryable error for ``bound_s``.
    ``typed=False``: only nats' own "not ready" errors are tried again; the step's own typed
    errors are its answer (a worker that can serve no version exits with that error at once)."""
    t0 = time.monotonic()
    said = False
    failures = 0
    while True:
        try:
            return await attempt()
        except Exception as raw:
            if isinstance(raw, RollfleetError) and not isinstance(raw, BrokerError):
                exc: RollfleetError | None = raw if typed else None
            else:
                exc = not_ready(raw, what)
            if exc is None:
                raise
            if not try_again(exc.retryable, time.monotonic() - t0, bound_s):
                if exc is raw:
                    raise
                raise exc from raw
            if not said:
                log.warning("the broker is not ready; trying again", step=what, error=str(exc), for_s=bound_s)
                said = True
        await asyncio.sleep(retry.delay_s(failures))
        failures += 1
