"""PullConsumer: exact accounting of open pull requests, and ending them at once (cancel)."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from harness import wait_until
from rollfleet.broker.pull_consumer import PullConsumer, delivery_info

STREAM, SUBJECT = "PULLTEST", "pulltest.jobs"


async def _setup(nc: nats.NATS, consumer: str = "c", max_waiting: int = 512) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT], retention=RetentionPolicy.WORK_QUEUE))
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name=consumer, ack_policy=AckPolicy.EXPLICIT, max_waiting=max_waiting)
    )


async def _waiting(nc: nats.NATS, consumer: str = "c") -> int:
    return (await nc.jetstream().consumer_info(STREAM, consumer)).num_waiting


async def test_overlapping_waiting_requests_are_counted_exactly(nc: nats.NATS) -> None:
    await _setup(nc)
    got: list[Msg] = []
    puller = await PullConsumer(nc, STREAM, "c", got.append).start()
    await puller.request(2, wait_s=30)
    await puller.request(3, wait_s=0.5)  # a top-up next to the waiting request
    assert puller.outstanding == 5 and puller.waiting
    js = nc.jetstream()
    for i in range(2):
        await js.publish(SUBJECT, f"job{i}".encode())
    await wait_until(lambda: len(got) == 2)
    assert puller.outstanding == 3
    # The short request expires (408 with the count it did not deliver): exactly what is left
    # of the long one stays outstanding, whichever of the two got the jobs.
    await wait_until(lambda: puller.expired == 1, timeout=5)
    left = puller.outstanding
    assert await _waiting(nc) == (1 if left else 0)
    for i in range(left):
        await js.publish(SUBJECT, f"more{i}".encode())
    await wait_until(lambda: len(got) == 2 + left)
    assert puller.outstanding == 0 and not puller.busy
    assert await _waiting(nc) == 0
    await puller.close()


async def test_no_wait_request_ends_with_what_was_there(nc: nats.NATS) -> None:
    await _setup(nc)
    js = nc.jetstream()
    for i in range(3):
        await js.publish(SUBJECT, f"job{i}".encode())
    got: list[Msg] = []
    puller = await PullConsumer(nc, STREAM, "c", got.append).start()
    assert await puller.fetch_now(10) == 3
    assert puller.outstanding == 0
    assert await puller.fetch_now(10) == 0
    info = delivery_info(got[0].reply)
    assert info is not None
    delivered, stored_at, pending = info
    # More were queued behind the first. (The broker's pending count may lag a write just acked:
    # under load the first delivery said 1, not 2; the last one always says none is left.)
    assert delivered == 1 and stored_at > 1e9 and pending >= 1
    last = delivery_info(got[-1].reply)
    assert last is not None and last[2] == 0
    assert delivery_info(got[2].reply)[2] == 0  # type: ignore[index]
    assert delivery_info("_INBOX.x") is None
    await puller.close()


async def test_cancel_ends_the_request_at_the_broker_and_hands_over_what_came(nc: nats.NATS) -> None:
    """After cancel, nothing more arrives for the old requests: a job stored later stays queued
    for others (what a worker needs to stop pulling a subject it may no longer take)."""
    await _setup(nc)
    got: list[Msg] = []
    puller = await PullConsumer(nc, STREAM, "c", got.append).start()
    await puller.request(4, wait_s=300)
    await wait_until(lambda: _waiting(nc), what="the request waiting at the broker")
    await puller.cancel()
    js = nc.jetstream()
    await js.publish(SUBJECT, b"after-cancel")
    await asyncio.sleep(0.3)
    assert got == [] and puller.outstanding == 0
    info = await js.consumer_info(STREAM, "c")
    assert info.num_pending == 1 and info.num_waiting == 0
    # The puller works on after a cancel (a fresh inbox).
    assert await puller.fetch_now(1) == 1
    await puller.close()


async def test_refused_request_gives_its_slots_back(nc: nats.NATS) -> None:
    await _setup(nc, max_waiting=1)
    puller = await PullConsumer(nc, STREAM, "c", lambda m: None).start()
    await puller.request(1, wait_s=30)
    await puller.request(2, wait_s=30)  # over max_waiting: 409, nothing delivered for it
    await wait_until(lambda: puller.outstanding == 1, what="the refused request's slots given back")
    assert puller.refused_at > 0
    await puller.cancel()
    await puller.close()


async def test_missing_consumer_is_reported(nc: nats.NATS) -> None:
    await _setup(nc)
    puller = await PullConsumer(nc, STREAM, "nobody", lambda m: None).start()
    await puller.request(3, wait_s=30)
    await wait_until(lambda: puller.missing and puller.outstanding == 0, what="503 for a missing consumer")
    await puller.close()
