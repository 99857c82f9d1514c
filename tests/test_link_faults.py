"""A client's link to the broker that stops carrying bytes, through a real TCP proxy
(``harness.link``) in front of a real nats-server.

A stall shorter than the ping bound is lived through on the same connection, nothing lost;
a longer one is given up by the product's own ping bound (``broker.connection``) and the
connection dialed again, the reconnect hooks called; latency slows what it carries and loses
nothing; a cut link is dialed again at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import pytest

from harness import wait_until
from harness.link import LinkProxy
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.connection import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, connect


@pytest.fixture
async def link(broker: EmbeddedBroker) -> AsyncIterator[LinkProxy]:
    proxy = await LinkProxy("127.0.0.1", broker.port).start()
    yield proxy
    await proxy.close()


async def test_the_product_gives_a_silent_link_up_within_its_ping_bound(link: LinkProxy) -> None:
    nc = await connect(f"nats://127.0.0.1:{link.port}", name="t", initial_timeout=10)
    try:
        assert nc.options["ping_interval"] == PING_INTERVAL_S
        assert nc.options["max_outstanding_pings"] == MAX_OUTSTANDING_PINGS
        assert PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1) <= 30  # (nats-py's defaults: about 6 min)
    finally:
        await nc.close()


async def _listening(link: LinkProxy) -> tuple[Any, list[bytes], list[float]]:
    """A connection through ``link`` subscribed to ``s``: it, what it received, when it reconnected."""
    reconnected: list[float] = []
    nc = await connect(f"nats://127.0.0.1:{link.port}", name="t", initial_timeout=10,
                       reconnect_hooks=[lambda: reconnected.append(time.monotonic())])
    got: list[bytes] = []

    async def on_msg(msg: Any) -> None:
        got.append(msg.data)

    await nc.subscribe("s", cb=on_msg)
    await nc.flush()
    return nc, got, reconnected


async def test_a_short_stall_is_lived_through_in_order(link: LinkProxy) -> None:
    nc, got, reconnected = await _listening(link)
    try:
        stalled = asyncio.ensure_future(link.stall("down", 2.0))
        await asyncio.sleep(0.1)
        for i in range(20):
            await nc.publish("s", str(i).encode())
        await asyncio.sleep(0.8)  # (no flush: its PONG comes down the stalled way)
        assert got == []  # held on the way down
        await stalled
        await wait_until(lambda: len(got) == 20, 5, what="the held messages delivered")
        assert got == [str(i).encode() for i in range(20)] and reconnected == []
    finally:
        await nc.close()


@pytest.mark.parametrize("given_up_by", ["time-out", "cancelled caller"])
async def test_a_flush_given_up_during_a_stall_leaves_the_connection_reading(link: LinkProxy, given_up_by: str) -> None:
    # nats-py's read loop ended on the late PONG of a flush given up on (InvalidStateError): the
    # connection looked connected and read nothing until the ping bound redialed it (20 s). A
    # worker's pull request gives up its drain so while a broker is paused (a paused broker's
    # replicas stayed deaf 13 s after it resumed).
    nc, got, reconnected = await _listening(link)
    try:
        stalled = asyncio.ensure_future(link.stall("down", 1.0))
        await asyncio.sleep(0.05)
        if given_up_by == "time-out":
            with pytest.raises(nats.errors.TimeoutError):
                await nc.flush(timeout=0.2)
        else:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(nc.flush(timeout=5), 0.2)
        await stalled  # its PONG comes down now
        await asyncio.sleep(0.2)
        for i in range(3):
            await nc.publish("s", str(i).encode())
        # Read on the same connection within a second, not after a redial 20 s on.
        await wait_until(lambda: len(got) == 3, 3, what="messages read after the stall")
        answer = await nc.request("$JS.API.INFO", b"", timeout=3)
        assert answer.data and reconnected == [] and nc.is_connected
    finally:
        await nc.close()


async def test_a_long_stall_makes_the_client_dial_again(link: LinkProxy) -> None:
    reconnected: list[float] = []
    nc = await connect(f"nats://127.0.0.1:{link.port}", name="t", initial_timeout=10,
                       reconnect_hooks=[lambda: reconnected.append(time.monotonic())],
                       ping_interval=0.3, max_outstanding_pings=2)  # (the product's bound, shortened)
    try:
        t0 = time.monotonic()
        stall = asyncio.ensure_future(link.stall("both", 4.0))
        # New connections stall too until it heals; then the client is connected again.
        await wait_until(lambda: reconnected, 15, what="a reconnect after the stall")
        await stall
        await wait_until(lambda: nc.is_connected, 10)
        assert reconnected[0] - t0 >= 0.6  # (not before the pings went unanswered)
        answer = await nc.request("$JS.API.INFO", b"", timeout=5)  # the new connection carries traffic
        assert answer.data
    finally:
        await nc.close()


async def test_latency_slows_and_loses_nothing_and_a_cut_link_is_dialed_again(link: LinkProxy) -> None:
    reconnected: list[float] = []
    nc = await connect(f"nats://127.0.0.1:{link.port}", name="t", initial_timeout=10,
                       reconnect_hooks=[lambda: reconnected.append(time.monotonic())])
    try:
        lagging = asyncio.ensure_future(link.lag(0.2, 2.0))
        t0 = time.monotonic()
        await nc.flush(timeout=5)  # a PING up and a PONG down, each chunk 0.2 s late
        assert time.monotonic() - t0 >= 0.35
        await lagging
        link.cut()
        await wait_until(lambda: reconnected, 10, what="a reconnect after the cut")
        await nc.flush(timeout=5)
    finally:
        await nc.close()


async def test_a_truncated_link_carries_its_bytes_then_closes_and_heals(link: LinkProxy) -> None:
    """The object-store faults (the adversary's ``--store s3``) on the same proxy: a response cut
    short after N bytes, on connections open and new; whole again once the fault ends."""
    async def first_line() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        try:
            return await asyncio.wait_for(reader.readline(), 5)
        finally:
            writer.close()

    whole = await first_line()  # the server's INFO line, a few hundred bytes
    assert whole.startswith(b"INFO ") and whole.endswith(b"\r\n") and len(whole) > 100
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)  # open before the fault
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"INFO ")
    cutting = asyncio.ensure_future(link.truncate(12, 2.0))
    await asyncio.sleep(0.05)
    fresh_reader, fresh_writer = await asyncio.open_connection("127.0.0.1", link.port)
    got = await asyncio.wait_for(fresh_reader.read(), 5)  # until the proxy closes it
    assert got == whole[:12]
    fresh_writer.close()
    writer.write(b"PING\r\n")  # the open one: its answer (PONG, 6 bytes) passes, within its 12
    await writer.drain()
    assert await asyncio.wait_for(reader.readline(), 5) == b"PONG\r\n"
    writer.write(b"PING\r\nPING\r\n")  # 12 more asked, 6 left: cut after the next 6, then closed
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b"PONG\r\n"
    writer.close()
    await cutting
    assert (await first_line()).startswith(b"INFO ")  # healed


async def test_a_dropping_link_resets_open_and_new_connections_for_a_while(link: LinkProxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"INFO ")
    dropping = asyncio.ensure_future(link.drop(1.5))
    await asyncio.sleep(0.05)

    async def read_all(r: asyncio.StreamReader) -> bytes:
        try:
            return await asyncio.wait_for(r.read(), 5)
        except ConnectionResetError:
            return b""

    assert await read_all(reader) == b""  # the open one is reset
    writer.close()
    new_reader, new_writer = await asyncio.open_connection("127.0.0.1", link.port)
    assert await read_all(new_reader) == b""  # a new one is reset before a byte passes
    new_writer.close()
    await dropping
    healed_reader, healed_writer = await asyncio.open_connection("127.0.0.1", link.port)
    assert (await asyncio.wait_for(healed_reader.readline(), 5)).startswith(b"INFO ")
    healed_writer.close()


async def test_overlapping_faults_nest_until_the_last_ends(link: LinkProxy) -> None:
    """Two events on one proxy (a fault on one worker and one on all): the shorter ending does not
    heal the link while the longer's window is open."""
    long = asyncio.ensure_future(link.truncate(12, 30.0))
    await link.truncate(1000, 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    assert len(await asyncio.wait_for(reader.read(), 5)) == 12  # the long one still in force
    writer.close()
    long.cancel()
    await asyncio.gather(long, return_exceptions=True)
    assert link.truncate_after is None
    long_drop = asyncio.ensure_future(link.drop(30.0))
    await link.drop(0.2)
    assert link.dropping
    long_drop.cancel()
    await asyncio.gather(long_drop, return_exceptions=True)
    assert not link.dropping
    lagging = asyncio.ensure_future(link.lag(0.3, 30.0))
    await link.lag(0.1, 0.1)
    assert link.delay_s == 0.3
    lagging.cancel()
    await asyncio.gather(lagging, return_exceptions=True)
    assert link.delay_s == 0.0
