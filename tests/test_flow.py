"""Long jobs, flow control, broker restarts, structured logs, draining."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from harness import ProcessGroup, running_worker, start_worker_process, terminate, wait_until
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.topology import TopologyConfig
from rollfleet.schemas.errors import NoCompatibleReplica
from rollfleet.trainer_client import RolloutClient
from tests.helpers import CountingEcho, payload


async def test_job_longer_than_ack_wait_is_not_redelivered(nats_url: str, namespace: str) -> None:
    topo = TopologyConfig(ack_wait_s=1.0)
    engine = CountingEcho(latency_s=3.5)
    async with (
        running_worker(nats_url, namespace, engine=engine, topology=topo, worker_id="a"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as client,
    ):
        handle = await client.submit(payload(), min_version=0)
        await wait_until(lambda: len(engine.calls) == 1)
        # A second worker, idle and eager: the job must not be redelivered to it meanwhile.
        async with running_worker(nats_url, namespace, engine=CountingEcho(), topology=topo, worker_id="b") as other:
            result = await handle.result(15)
            assert result.delivery_attempt == 1 and result.generation_s >= 3.5
            assert len(engine.calls) == 1 and len(other.engine.calls) == 0  # type: ignore[attr-defined]


async def test_worker_never_runs_more_than_its_capacity(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(latency_s=0.3)
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=2),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        handles = [await client.submit(payload(), min_version=0) for _ in range(8)]
        # At most `capacity` jobs may be delivered-but-unacked at any moment.
        consumer = await client.js.consumer_info(client.names.jobs_stream, "min-0")
        peak_ack_pending = consumer.num_ack_pending
        for _ in range(20):
            consumer = await client.js.consumer_info(client.names.jobs_stream, "min-0")
            peak_ack_pending = max(peak_ack_pending, consumer.num_ack_pending)
            await asyncio.sleep(0.05)
        await asyncio.gather(*(h.result(20) for h in handles))
    assert engine.peak == 2 and peak_ack_pending <= 2


async def test_consumers_are_sized_for_the_fleet(nats_url: str, namespace: str) -> None:
    topo = TopologyConfig(fleet_slots=777, max_waiting=333, ack_wait_s=12.0, max_deliver=6)
    async with (
        running_worker(nats_url, namespace, topology=topo),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as client,
    ):
        await (await client.submit(payload(), min_version=0)).result(10)
        info = await client.js.consumer_info(client.names.jobs_stream, "min-0")
    assert info.config.max_ack_pending == 777 and info.config.max_waiting == 333
    assert info.config.ack_wait == 12.0 and info.config.max_deliver == 6


async def test_broker_restart_does_not_wedge_workers_or_clients(tmp_path: Path, namespace: str) -> None:
    broker = EmbeddedBroker(store_dir=tmp_path / "store").start()
    try:
        async with (
            running_worker(broker.url, namespace) as worker,
            await RolloutClient.connect(broker.url, namespace=namespace, client_id="c") as client,
        ):
            await (await client.submit(payload(), min_version=0)).result(10)
            broker.kill()
            await asyncio.sleep(1.0)
            broker.start()  # same port, same store
            await wait_until(lambda: client.nc.is_connected and worker.nc.is_connected, timeout=20)  # type: ignore[union-attr]
            handles = [await client.submit(payload([i + 1]), min_version=0) for i in range(5)]
            results = [await h.result(20) for h in handles]
            assert {r.worker_id for r in results} == {worker.config.worker_id}
            # A result can be stored while its publish acknowledgement is lost in the reconnect;
            # the worker then republishes (deduplicated) before acking, so count eventually.
            await wait_until(lambda: worker.jobs_done == 6, timeout=15)
    finally:
        broker.stop()


async def test_sigterm_drains_in_flight_jobs_and_logs_json(nats_url: str, namespace: str, tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    proc = start_worker_process(
        nats_url, namespace, "drainer", "--echo-latency", "1.5", log_path=log_path, env={"ROLLFLEET_LOG_LEVEL": "debug"}
    )
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(payload(), min_version=0, idempotency_key="drain-me")
            await wait_until(lambda: client.fleet.replicas()[0].in_flight == 1, timeout=10)
            proc.send_signal(signal.SIGTERM)
            result = await handle.result(15)  # finished, not abandoned
            assert result.worker_id == "drainer" and result.delivery_attempt == 1
            assert proc.wait(15) == 0
            await wait_until(lambda: not client.fleet.replicas(), timeout=5)
    finally:
        terminate(proc, 20.0)
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    done = [e for e in events if e["event"] == "job done"]
    assert len(done) == 1
    assert done[0]["idempotency_key"] == "drain-me" and done[0]["worker_id"] == "drainer"
    assert {"job_id", "version", "version_start", "version_end", "timestamp", "level"} <= set(done[0])
    assert [e["event"] for e in events].index("draining") < [e["event"] for e in events].index("stopped")


async def test_an_exact_job_whose_holder_died_is_not_held_up_by_a_replica_draining_its_own(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """Item 11: an exact-0 job runs on a (capacity 1); b, the only other replica at version 0, runs
    a long job of its own and is draining it (SIGTERM). a is SIGKILLed: no live replica can serve
    the exact job, and b never took it (the job's claim names a): it is answered
    NoCompatibleReplica within seconds, not left waiting for b's drain until it is Expired."""
    slow = ("--capacity", "1", "--echo-token-latency", "0.05")
    group = ProcessGroup(tmp_path)
    try:
        group.worker(nats_url, namespace, "a", *slow)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            exact = await client.submit(payload(max_tokens=400), exact_version=0, timeout=30)  # 20 s on a
            await wait_until(lambda: client.placement.taken(exact), timeout=10)
            group.worker(nats_url, namespace, "b", *slow)
            await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=30)
            own = await client.submit(payload(max_tokens=600), min_version=0, timeout=60)  # 30 s on b
            await wait_until(lambda: client.placement.taken(own), timeout=10)
            group.procs["b"].send_signal(signal.SIGTERM)
            await wait_until(lambda: (r := client.fleet.replica("b")) is not None and r.state == "draining", timeout=10)
            group.kill("a")
            t0 = time.monotonic()
            with pytest.raises(NoCompatibleReplica):
                await asyncio.wait_for(exact.result(), 12)
            assert time.monotonic() - t0 < 12.0
    finally:
        group.close()
