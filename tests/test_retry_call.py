"""``broker.retry_call.call_retrying``: a call the broker left unanswered is asked again until its
bound and only then is ``ServiceUnavailable``; a refusal is raised at once (what a submit made
while the broker restarts relies on; the restart itself: test_broker_store_loss.py)."""

from __future__ import annotations

import time

import nats.errors
import nats.js.errors
import pytest

from rollfleet.broker.retry_call import backoff_s, call_retrying
from rollfleet.schemas.errors import ServiceUnavailable


async def test_an_unanswered_call_is_asked_again_until_it_is_answered() -> None:
    tries: list[float] = []

    async def call() -> str:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise nats.errors.TimeoutError
        return "answered"

    assert await call_retrying(call, until=time.time() + 30, what="look") == "answered"
    assert len(tries) == 3 and tries[2] - tries[0] >= backoff_s(0) + backoff_s(1) - 0.01


async def test_a_call_unanswered_past_its_bound_is_service_unavailable_only_then() -> None:
    tries = 0

    async def call() -> None:
        nonlocal tries
        tries += 1
        raise nats.js.errors.ServiceUnavailableError

    t0 = time.time()
    with pytest.raises(ServiceUnavailable) as info:
        await call_retrying(call, until=t0 + 0.5, what="create the consumer of min:0")
    assert time.time() >= t0 + 0.5 and tries >= 2
    assert info.value.retryable and "create the consumer of min:0" in info.value.message


async def test_a_refusal_is_raised_at_once() -> None:
    tries = 0

    async def call() -> None:
        nonlocal tries
        tries += 1
        raise nats.errors.ConnectionClosedError

    with pytest.raises(ServiceUnavailable):
        await call_retrying(call, until=time.time() + 30, what="look")
    assert tries == 1
