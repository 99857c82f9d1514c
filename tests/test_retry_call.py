"""``broker.retry_call.call_retrying``: a call the broker left unanswered is asked again until its
bound and only then is ``ServiceUnavailable``; a refusal is raised at once (what a submit made
while the broker restarts relies on; the restart itself: test_broker_store_loss.py). A call or an
acknowledged publish (``broker.retry_publish``) still unanswered at a reconnect is asked again then."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from harness import wait_until
from rollfleet.broker import EmbeddedBroker, retry_publish
from rollfleet.broker.connection import connect
from rollfleet.broker.retry_call import Redialed, _attempt, call_retrying
from rollfleet.broker.retry_publish import publish_retrying
from rollfleet.runtime.backoff import TRANSIENT_RETRY
from rollfleet.schemas.errors import ServiceUnavailable


async def test_an_unanswered_call_is_asked_again_until_it_is_answered() -> None:
    tries: list[float] = []

    async def call() -> str:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise nats.errors.TimeoutError
        return "answered"

    assert await call_retrying(call, until=time.time() + 30, what="look") == "answered"
    assert len(tries) == 3 and tries[2] - tries[0] >= TRANSIENT_RETRY.delay_s(0) + TRANSIENT_RETRY.delay_s(1) - 0.01


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


async def test_a_call_left_unanswered_by_a_restarted_broker_is_asked_again_at_the_reconnect(tmp_path: Path) -> None:
    """A request the broker took before it restarted is never answered. Asked again only at its
    time-out, a submit just after a restart waited that long (5 s); here the time-out is 60 s and
    the call must be asked again as soon as the connection is back, and answered then."""
    broker = EmbeddedBroker(store_dir=tmp_path / "store").start()
    try:
        nc = await connect(broker.url, name="t")
        try:

            async def silent(_: object) -> None:  # (heard, never answered)
                return None

            await nc.subscribe("silent", cb=silent)
            tries = 0

            async def call() -> str:
                nonlocal tries
                tries += 1
                if tries == 1:  # taken by the broker, never answered (its server goes away)
                    await nc.request("silent", b"", timeout=60)
                return "answered"

            calling = asyncio.create_task(call_retrying(call, until=time.time() + 120, what="look", nc=nc))
            await wait_until(lambda: tries == 1, 10, what="the first attempt sent")
            broker.stop()
            broker.start()
            assert await asyncio.wait_for(calling, 40) == "answered"
            assert tries == 2
        finally:
            await nc.close()
    finally:
        broker.stop()


async def test_a_publish_whose_acknowledgement_a_restarted_broker_lost_is_sent_again_at_the_reconnect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rule for the acknowledged publish every job and answer is stored with: an attempt
    sent before the reconnect is given up at once and sent again (deduplicated by its message
    id), not after its time-out, here 60 s."""
    monkeypatch.setattr(retry_publish, "ATTEMPT_S", 60.0)
    broker = EmbeddedBroker(store_dir=tmp_path / "store").start()
    try:
        nc = await connect(broker.url, name="t")
        try:
            copies: list[bytes] = []

            async def store(msg: Msg) -> None:  # a stream that answers only the copy sent after the restart
                copies.append(msg.data)
                if len(copies) > 1 and msg.reply:
                    await nc.publish(msg.reply, b'{"stream": "S", "seq": 7}')

            await nc.subscribe("acked.x", cb=store)
            headers = {"Nats-Msg-Id": "k-1"}
            publishing = asyncio.create_task(
                publish_retrying(nc.jetstream(), "acked.x", b"job", headers, until=time.time() + 120)
            )
            await wait_until(lambda: len(copies) == 1, 10, what="the first attempt heard")
            broker.stop()
            broker.start()
            ack = await asyncio.wait_for(publishing, 40)
            assert ack.seq == 7 and copies == [b"job", b"job"]
        finally:
            await nc.close()
    finally:
        broker.stop()


async def test_a_call_given_up_at_a_redial_that_ends_in_an_error_is_read() -> None:
    """The cancel of a call given up at a redial can land as the broker's answer comes; asyncio's
    wait_for then swallows it and the call ends with the answer (an error here). Nobody reads
    that task otherwise: asyncio reported "Task exception was never retrieved" (campaign 7)."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    redial, answered = asyncio.Event(), asyncio.Event()

    async def call() -> str:
        try:
            await answered.wait()
        except asyncio.CancelledError:
            pass  # (as wait_for does when the answer is already there)
        raise nats.js.errors.NotFoundError

    try:
        attempt = asyncio.ensure_future(_attempt(call, redial))
        await asyncio.sleep(0)
        redial.set()
        with pytest.raises(Redialed):
            await attempt
        del attempt  # (its exception's frames hold the call's task)
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [c.get("message") for c in reported] == []
