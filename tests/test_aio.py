"""Waiting on an event with a time-out, and keys watched, stop when their task is cancelled."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.kv_watch import watch_keys
from rollfleet.broker.topology import ensure_topology
from rollfleet.runtime.aio import KeyedLocks, cancel_until_done, stop_tasks, wait_event
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names


async def _loop_until_cancelled(event: asyncio.Event, wait: object) -> None:
    while True:
        await wait(event)  # type: ignore[operator]
        event.clear()


async def test_a_cancellation_that_lands_as_the_event_is_set_stops_the_loop() -> None:
    """The race asyncio.wait_for loses on 3.11: the event is set, then the task is cancelled, in
    one turn of the loop. With wait_event the loop stops; with wait_for it runs on."""
    for wait, stops in ((lambda e: wait_event(e, 10.0), True), (lambda e: asyncio.wait_for(e.wait(), 10.0), False)):
        event = asyncio.Event()
        task = asyncio.ensure_future(_loop_until_cancelled(event, wait))
        await asyncio.sleep(0.01)
        event.set()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1.0)
        assert bool(done) == stops
        if not done:  # (what wait_event prevents: a second cancel is needed)
            task.cancel()
            await asyncio.wait([task], timeout=1.0)


async def _wait_for_a_first_commit(answers: list[asyncio.Future[None]]) -> None:
    while True:  # like VersionSync.catch_up: a request, a pause, a request ...
        answers.append(asyncio.get_running_loop().create_future())
        await asyncio.wait_for(answers[-1], 10.0)
        await asyncio.sleep(0.01)


async def test_a_start_whose_request_swallowed_its_cancel_is_stopped_all_the_same() -> None:
    """make test run H: a worker SIGTERMed while it waited for a first commit ran on for 10 s. Its
    read of the policy bucket (a nats request: asyncio.wait_for) got its answer in the turn its
    cancel landed, returned it, and the wait went on polling. ``cancel_until_done`` cancels again."""
    once = (lambda t: stop_tasks([t], 0.5), False)
    again = (lambda t: cancel_until_done(t, 2.0, every_s=0.1), True)
    for stop, stops in (again, once):
        answers: list[asyncio.Future[None]] = []
        task = asyncio.ensure_future(_wait_for_a_first_commit(answers))
        await asyncio.sleep(0.01)
        answers[-1].set_result(None)  # the broker's answer and the cancel, in one turn of the loop
        await stop(task)
        if sys.version_info < (3, 12):  # (3.12's wait_for no longer swallows it)
            assert task.done() == stops
        assert not stops or task.done()
        task.cancel()
        await asyncio.wait([task], timeout=1.0)
        assert task.done()


async def test_wait_event_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    event.set()
    assert await wait_event(event, 0.01) and await wait_event(event, None)


async def test_a_watch_cancelled_while_it_is_being_set_up_stops(tmp_path: Path) -> None:
    """Cancelled at every point of its start (a client closed right after it connected)."""
    broker = EmbeddedBroker(store_dir=tmp_path / "nats").start()
    try:
        import nats

        nc = await nats.connect(broker.url)
        names = Names("w")
        await ensure_topology(nc.jetstream(), names)
        kv = await nc.jetstream().key_value(names.fleet_bucket)
        for step in range(60):  # cancelled 0 to 6 ms into its start, by 0.1 ms
            task = asyncio.ensure_future(watch_keys(kv, ">", lambda e, live: None, get_logger("test")))
            await asyncio.sleep(step / 10_000)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=3.0)
            assert done, f"a watch cancelled {step / 10:.1f} ms into its start kept running"
            with pytest.raises(asyncio.CancelledError):
                task.result()
        await nc.close()
    finally:
        broker.stop()


async def test_keyed_locks_serialize_one_key_and_keep_no_lock_for_keys_done_with() -> None:
    """A gateway opens each session under its id's lock: two opens of one id never overlap, other
    ids do not wait, and once nobody holds or waits for an id its lock is gone (a gateway that
    served a million trajectories keeps none)."""
    locks = KeyedLocks()
    inside: dict[str, int] = {}
    most: dict[str, int] = {}

    async def open_session(key: str) -> None:
        async with locks.hold(key):
            inside[key] = inside.get(key, 0) + 1
            most[key] = max(most.get(key, 0), inside[key])
            await asyncio.sleep(0.01)
            inside[key] -= 1

    async def watch() -> int:  # how many ids were inside at once, at most
        seen = 0
        while True:
            seen = max(seen, sum(1 for n in inside.values() if n))
            if seen > 1:
                return seen
            await asyncio.sleep(0.001)

    watcher = asyncio.ensure_future(watch())
    await asyncio.gather(*(open_session(f"s{i % 50}") for i in range(200)))
    assert set(most.values()) == {1}  # one at a time per id
    assert await asyncio.wait_for(watcher, 1.0) > 1  # other ids did not wait for it
    assert len(locks) == 0
    with pytest.raises(RuntimeError):  # released also when the work under it fails
        async with locks.hold("x"):
            raise RuntimeError("boom")
    assert len(locks) == 0
