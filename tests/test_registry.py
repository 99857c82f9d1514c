"""The fleet registry, fail-fast routing, and deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest

from harness import running_worker, wait_until
from rollfleet.schemas import ReplicaStatus
from rollfleet.schemas.errors import Expired, NoCompatibleReplica
from rollfleet.trainer_client import RolloutClient
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import CountingEcho, payload


async def test_workers_register_and_heartbeat(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, version=3, worker_id="reg", capacity=7) as worker,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        [entry] = client.fleet.replicas()
        assert (entry.worker_id, entry.state, entry.active_version, entry.engine, entry.capacity) == (
            "reg",
            "ready",
            3,
            "echo",
            7,
        )
        first = entry.heartbeat_at
        await wait_until(lambda: client.fleet.replicas()[0].heartbeat_at > first, timeout=5)
        worker.engine.latency_s = 1.0
        handle = await client.submit(payload(), min_version=0)
        await wait_until(lambda: client.fleet.replicas()[0].in_flight == 1, timeout=5)
        await handle.result(10)
    await wait_until(lambda: not client.fleet.replicas(), timeout=5)  # clean exit deregisters


async def test_a_replica_turning_full_or_freeing_a_slot_says_so_between_heartbeats(
    nats_url: str, namespace: str
) -> None:
    # Clients ring the bells of replicas with a free slot first (``FleetView.bell_target``): the
    # registry must show a replica full within a second, not at its next heartbeat.
    async with (
        running_worker(nats_url, namespace, version=0, worker_id="full", capacity=2, heartbeat_s=60.0) as worker,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        worker.engine.latency_s = 4.0
        short = await client.submit(payload(), min_version=0, idempotency_key="short")
        await wait_until(lambda: client.fleet.replicas()[0].in_flight == 1, timeout=3)
        long = await client.submit(payload(), min_version=0, idempotency_key="long")
        await wait_until(lambda: client.fleet.replicas()[0].in_flight == 2, timeout=3, what="shown full")
        await short.result(10)
        await wait_until(lambda: client.fleet.replicas()[0].in_flight == 1, timeout=3, what="a slot shown free")
        await long.result(10)


async def test_dead_worker_goes_stale_and_client_fails_fast(nats_url: str, namespace: str) -> None:
    """The promise: a replica that dies without deregistering stops counting as compatible
    within 3 heartbeat intervals (at least 1 s) of its last registry refresh."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        async with running_worker(nats_url, namespace, version=1, worker_id="dies", heartbeat_s=0.4) as worker:
            await wait_until(lambda: len(client.fleet.replicas()) == 1)
            # Simulate death: stop heartbeats without deregistering.
            registration = worker.registration
            assert registration is not None and registration._task is not None
            registration._task.cancel()
            registration._kv = None  # its final delete is lost too
            last = registration.status.heartbeat_at  # (its last refresh, on its clock)

            def heard_last() -> ReplicaStatus | None:
                seen = client.fleet.replica("dies")  # (timed on the client's clock: never before it was made)
                return seen if seen is not None and seen.heartbeat_at >= last else None

            seen = await wait_until(heard_last, what="the last refresh heard")
            bound = seen.heartbeat_at + seen.stale_after_s()
            assert seen.heartbeat_at - last < 0.5  # (the client's timing: when it was made, plus its transit)
            assert registration.status.stale_after_s() == pytest.approx(1.2)
            await wait_until(lambda: not client.fleet.replicas(), timeout=5)
            assert time.time() <= bound + 0.5  # gone within the bound (plus this loop's polling)
            assert client.fleet.replicas(live_only=False)[0].worker_id == "dies"  # still there, but stale
            handle = await client.submit(payload(), min_version=1)
            with pytest.raises(NoCompatibleReplica):  # fail fast, not at the 600 s deadline
                await asyncio.wait_for(handle, 10)


async def test_no_replica_at_all_fails_fast(nats_url: str, namespace: str) -> None:
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        with pytest.raises(NoCompatibleReplica, match="empty"):
            await (await client.submit(payload(), min_version=0))


async def test_unserved_job_expires_and_a_late_pull_answers_expired(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(latency_s=1.5)
    async with (
        running_worker(nats_url, namespace, version=0, worker_id="busy", capacity=1, engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        client.deadline_grace_s = 5.0  # let the worker's own answer arrive first
        blocker = await client.submit(payload(), min_version=0, idempotency_key="blocker")
        await wait_until(lambda: len(engine.calls) == 1)
        late = await client.submit(payload(), min_version=0, timeout=0.3, idempotency_key="late")
        await blocker.result(10)
        with pytest.raises(Expired) as info:
            await late.result(10)
        assert info.value.retryable
        assert len(engine.calls) == 1  # the expired job never reached the engine


async def test_client_side_deadline_when_nobody_pulls(nats_url: str, namespace: str) -> None:
    engine = EchoEngine(latency_s=3.0)
    async with (
        running_worker(nats_url, namespace, version=0, capacity=1, engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        client.deadline_grace_s = 0.2
        await client.submit(payload(), min_version=0)
        await asyncio.sleep(0.2)
        late = await client.submit(payload(), min_version=0, timeout=0.5)
        with pytest.raises(Expired):  # by the client's own sweep: the replica is busy for 3 s
            await asyncio.wait_for(late, 2.5)


async def test_a_draining_replica_stays_draining_whatever_its_version_sync_writes_after() -> None:
    """A replica stopped (SIGTERM) while a prepare is in flight wrote ``draining``, then its
    failing prepare wrote ``preparing`` and ``degraded`` over it (campaign seed 747108: w3,
    draining for 8 s, showed ``degraded`` with free slots; every stalled bell went to it, and a
    job on min-39 waited 12 s unpulled). Once draining, an entry says draining until it is
    deleted: clients send it no bell and no turn."""
    from rollfleet.schemas import Names
    from rollfleet.workers.registry import Registration

    now = time.time()
    status = ReplicaStatus(worker_id="w3", state="ready", active_version=41, engine="echo", capacity=3, in_flight=0,
                           heartbeat_at=now, heartbeat_interval_s=0.5, started_at=now)  # fmt: skip
    reg = Registration(None, Names("t"), status)  # type: ignore[arg-type]  # (never started: no broker writes)
    await reg.write(state="draining")
    await reg.write(state="preparing", preparing_version=42)
    await reg.write(state="degraded", preparing_version=None, degraded_reason="prepare of version 42 failed")
    assert (status.state, status.degraded_reason) == ("draining", "prepare of version 42 failed")
