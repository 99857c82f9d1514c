"""Waking replicas: a job reaches a replica through a pull request already waiting for it, or
through one bell to one replica that can serve it; never a broadcast. A subject a replica may
no longer take stops being pulled at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg

from harness import ProcessGroup, running_worker, wait_until
from rollfleet.broker.topology import TopologyConfig
from rollfleet.schemas import ReplicaStatus, VersionConstraint
from rollfleet.schemas.names import LISTENED_MIN_VERSIONS
from rollfleet.trainer_client import RolloutClient
from rollfleet.trainer_client.fleet import with_room_first
from tests.helpers import CountingEcho, payload


def test_a_bell_goes_to_a_replica_with_a_free_slot_where_one_has_any() -> None:
    def replica(name: str, in_flight: int) -> ReplicaStatus:
        return ReplicaStatus(
            worker_id=name, state="ready", active_version=3, engine="echo", capacity=2,
            in_flight=in_flight, heartbeat_at=0.0, heartbeat_interval_s=1.0, started_at=0.0,
        )  # fmt: skip

    full, busy, idle = replica("a", 2), replica("b", 1), replica("c", 0)
    assert with_room_first([full, busy, idle]) == [busy, idle]
    assert with_room_first([full]) == [full]  # (all full: rung all the same, one frees a slot first)
    assert with_room_first([]) == []


async def _bells(client: RolloutClient) -> list[Msg]:
    rung: list[Msg] = []

    async def on(msg: Msg) -> None:
        rung.append(msg)

    await client.nc.subscribe(f"rf.{client.names.namespace}.bell.>", cb=on)
    await client.nc.flush()
    return rung


async def test_jobs_in_the_window_ring_no_bell(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, version=5, worker_id="a"),
        running_worker(nats_url, namespace, version=5, worker_id="b"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 2)
        oldest = 5 - LISTENED_MIN_VERSIONS + 1
        js, names = client.js, client.names
        window = [("exact", 5)] + [("min", v) for v in range(oldest, 6)]
        for kind, v in window:  # the trainer declared the window's consumers; both replicas wait there
            consumer = names.job_consumer(kind, v)  # type: ignore[arg-type]
            await wait_until(lambda c=consumer: _equals(_num_waiting(js, names.jobs_stream, c), 2), what=consumer)
        rung = await _bells(client)
        handles = [await client.submit(payload(), min_version=v) for v in range(oldest, 6) for _ in range(5)]
        handles += [await client.submit(payload(), exact_version=5) for _ in range(5)]
        for h in handles:
            await h.result(10)
        await client.nc.flush()
        # Each subject had requests waiting at the broker: no bell at submit. (Only the stall
        # check may ring, if this machine is so slow that a job waited over a second.)
        assert all(bell.data.endswith(b".stalled") for bell in rung), [b.data for b in rung]


async def test_a_job_outside_every_window_rings_one_replica(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, version=5, worker_id="a") as a,
        running_worker(nats_url, namespace, version=5, worker_id="b") as b,
        running_worker(nats_url, namespace, version=1, worker_id="old"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 3)
        rung = await _bells(client)
        # min-2: outside version 5's window (5, 4, 3), above version 1: only a or b can serve it.
        assert not client.fleet.covered(VersionConstraint("min", 2))
        result = await (await client.submit(payload(), min_version=2)).result(10)
        assert result.worker_id in ("a", "b")
        await client.nc.flush()
        assert len(rung) == 1 and rung[0].subject in (
            client.names.bell_subject("a"),
            client.names.bell_subject("b"),
        )
        # Round robin: the next bells for that subject go to the other replica, one each.
        await asyncio.sleep(0.06)  # past the per-subject bell interval
        await (await client.submit(payload(), min_version=2)).result(10)
        await client.nc.flush()
        assert len(rung) == 2 and rung[0].subject != rung[1].subject
        assert a.jobs_done + b.jobs_done == 2


async def test_a_bell_to_a_gone_replica_is_noticed_and_rung_elsewhere(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, version=5, worker_id="alive"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        # A registry entry whose replica is gone without deregistering (its heartbeat still fresh).
        ghost = msgspec.structs.replace(client.fleet.replicas()[0], worker_id="ghost")
        client.fleet._replicas["ghost"] = ghost
        client.fleet._index = None
        for _ in range(2):  # whichever the round robin rings first
            await asyncio.sleep(0.06)
            await (await client.submit(payload(), min_version=1)).result(10)
        await wait_until(lambda: "ghost" not in {r.worker_id for r in client.fleet.replicas()}, timeout=5)


async def test_stalled_subject_is_rung_again(nats_url: str, namespace: str) -> None:
    """A bell can be lost: the client's stall check finds the job queued with no request
    waiting for it, and rings a replica."""
    async with (
        running_worker(nats_url, namespace, version=5, worker_id="a"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        ring = client.bells.ring
        client.bells.ring = lambda constraint, stalled=False, **_: ring(constraint, stalled=True) if stalled else None  # type: ignore[method-assign]
        handle = await client.submit(payload(), min_version=0)  # its bell is "lost"
        result = await handle.result(10)
        assert result.worker_id == "a"


async def test_a_subject_no_longer_accepted_stops_being_pulled_at_once(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, version=3, worker_id="w") as worker,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        js, names = client.js, client.names
        exact3 = names.job_consumer("exact", 3)
        await wait_until(lambda: _waiting(js, names.jobs_stream, exact3), what="a request waiting on exact-3")
        worker.served.version = 4  # exact-3 is no longer allowed
        await worker.release_unaccepted()
        # (The broker drops a request whose inbox it no longer hears when it next looks at its
        # waiting requests: its count may lag the cancel. What matters is below: no job is taken.)
        async def dropped() -> bool:
            return await _num_waiting(js, names.jobs_stream, exact3) == 0

        await wait_until(dropped, 10, what="the broker dropping the cancelled request")
        await js.publish(names.job_subject("exact", 3), b"not for w")
        await asyncio.sleep(0.3)
        info = await js.consumer_info(names.jobs_stream, exact3)
        assert info.num_pending == 1 and info.num_ack_pending == 0  # nobody took it
        await js.purge_stream(names.jobs_stream)


async def _num_waiting(js: Any, stream: str, consumer: str) -> int:
    try:
        return int((await js.consumer_info(stream, consumer)).num_waiting or 0)
    except Exception:
        return 0


async def _waiting(js: Any, stream: str, consumer: str) -> bool:
    try:
        return bool((await js.consumer_info(stream, consumer)).num_waiting)
    except Exception:
        return False


async def test_replicas_past_max_waiting_stand_by_until_called_in(nats_url: str, namespace: str) -> None:
    """At most max_waiting requests wait per subject (the broker's work per job stays bounded);
    the other replicas stand by, and the client's stall check calls them in when jobs queue."""
    topo = TopologyConfig(max_waiting=1)
    engine_a, engine_b = CountingEcho(latency_s=0.4), CountingEcho(latency_s=0.4)
    async with (
        running_worker(nats_url, namespace, worker_id="a", capacity=1, engine=engine_a, topology=topo),
        running_worker(nats_url, namespace, worker_id="b", capacity=1, engine=engine_b, topology=topo),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 2)
        js, names = client.js, client.names
        consumer = names.job_consumer("min", 0)
        await wait_until(lambda: _waiting(js, names.jobs_stream, consumer), what="a request waiting on min-0")
        assert (await js.consumer_info(names.jobs_stream, consumer)).num_waiting == 1
        handles = [await client.submit(payload(), min_version=0) for _ in range(8)]
        results = [await h.result(20) for h in handles]
        assert {r.worker_id for r in results} == {"a", "b"}  # the one standing by was called in
        assert len(engine_a.calls) + len(engine_b.calls) == 8


async def test_slots_move_back_to_where_work_is_expected(nats_url: str, namespace: str) -> None:
    """A replica's slots follow the work, then move back once that subject is quiet: after a job
    on min-0 (outside a capacity-2 replica's listened subjects: rung by a bell), both replicas
    wait on min-2 again and serve a burst there."""
    a_engine, b_engine = CountingEcho(latency_s=0.1), CountingEcho(latency_s=0.1)
    async with (
        running_worker(nats_url, namespace, version=2, worker_id="a", capacity=2, engine=a_engine),
        running_worker(nats_url, namespace, version=2, worker_id="b", capacity=2, engine=b_engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 2)
        assert client.fleet.covered(VersionConstraint("min", 2))
        assert not client.fleet.covered(VersionConstraint("min", 0))  # capacity 2: exact-2 and min-2 only
        await (await client.submit(payload(), min_version=0)).result(15)
        # The woken replica took its slots to min-0 (and left one waiting there); once min-0 has
        # been quiet for a second they wait where they should again: one per replica on min-2.
        js, names = client.js, client.names

        async def waiting(kind: str, version: int) -> int:
            return (await js.consumer_info(names.jobs_stream, names.job_consumer(kind, version))).num_waiting  # type: ignore[arg-type]

        await wait_until(lambda: _equals(waiting("min", 2), 2), timeout=5, what="both replicas waiting on min-2 again")
        assert await waiting("min", 0) == 0
        second = [await client.submit(payload(), min_version=2) for _ in range(30)]
        served = {(await h.result(15)).worker_id for h in second}
        assert served == {"a", "b"}


async def _equals(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def test_a_job_consumer_deleted_while_the_client_believes_it_exists_is_declared_again(
    nats_url: str, namespace: str
) -> None:
    """The client created min-0's consumer and remembers it exists; the consumer is then deleted
    (an operator, a clean-up). A job stored there meanwhile would wait for its deadline: the
    client's stall watch finds the consumer missing, declares it again and rings a replica, so
    the job is answered within seconds."""
    async with (
        running_worker(nats_url, namespace, version=0, worker_id="a"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        await (await client.submit(payload(), min_version=0, timeout=10)).result(10)
        await client.js.delete_consumer(client.names.jobs_stream, client.names.job_consumer("min", 0))
        t0 = asyncio.get_running_loop().time()
        result = await (await client.submit(payload([4, 5]), min_version=0, timeout=60)).result(20)
        assert result.worker_id == "a" and asyncio.get_running_loop().time() - t0 < 8.0


async def test_a_job_whose_holder_died_outside_every_window_is_pulled_again(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A min-0 job is running on w-old (version 0) when it is SIGKILLed; the only replica left is at
    version 5, whose window (exact-5, min-5..min-3) does not include min-0, so no request waits
    there. The broker would redeliver the job after ack_wait to a replica pulling there: the
    client's stall watch sees it unacked with nobody waiting and rings w-new, which serves it."""
    topo = TopologyConfig(ack_wait_s=1.5)
    group = ProcessGroup(tmp_path)
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as client:
            group.worker(nats_url, namespace, "w-old", "--echo-token-latency", "0.05", "--ack-wait", "1.5")
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            handle = await client.submit(payload(max_tokens=100), min_version=0, timeout=60)
            # Running on w-old (said by its registry entry; a fixed sleep is outlasted by a loaded
            # host's start-up, and the job would then be w-new's first delivery, not a redelivery).
            await wait_until(lambda: any(r.in_flight for r in client.fleet.replicas()), timeout=30)
            async with running_worker(nats_url, namespace, version=5, worker_id="w-new", topology=topo):
                group.kill("w-old")
                t0 = asyncio.get_running_loop().time()
                result = await handle.result(30)
                assert result.worker_id == "w-new" and result.delivery_attempt == 2
                assert asyncio.get_running_loop().time() - t0 < 15.0
    finally:
        group.close()


async def test_a_pass_of_the_pull_loop_that_a_defect_ends_does_not_end_pulling(nats_url: str, namespace: str) -> None:
    """An error nothing in the pull loop expected (a defect) is logged and the loop goes on: a
    loop that ended would leave the replica registered ready, taking no job, with nothing said."""
    async with (
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
        # (One slot: each job after the failed pass needs a pull request only a live loop makes.)
        running_worker(nats_url, namespace, worker_id="w", capacity=1) as worker,
    ):
        assert (await (await client.submit(payload([1]), min_version=0, timeout=30)).result(30)).worker_id == "w"
        pulling = worker.pulling
        assert pulling is not None
        fill = pulling._fill
        failed: list[float] = []

        async def failing_once(now: float) -> None:
            if not failed:
                failed.append(now)
                raise RuntimeError("a defect in a pass")
            await fill(now)

        pulling._fill = failing_once  # type: ignore[method-assign]
        pulling.wake()
        await wait_until(lambda: pulling.loop_failures == 1, 10, what="the failed pass")
        for tag in range(2, 5):  # served after it, one request at a time, by the same loop
            assert (await (await client.submit(payload([tag]), min_version=0, timeout=30)).result(15)).worker_id == "w"
        assert failed and pulling.loop_failures == 1
