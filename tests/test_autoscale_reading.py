"""The autoscaler's signal read from a real broker: jobs stored on each subject (waiting and
running), the registry's replicas and the versions they hold, pinned sessions, refusals; and
whether a store directory still has a version."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import running_worker, temp_broker, wait_until, write_base_checkpoint
from rollfleet.autoscale.reading import SignalReader, store_has
from rollfleet.autoscale.signal import LATEST, ClassDemand
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.connection import connect
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.policy_store.store import version_path
from rollfleet.schemas import Names, SessionRecord, VersionRecord, encode
from rollfleet.schemas.errors import NoCompatibleReplica
from rollfleet.trainer_client import RolloutClient
from rollfleet.trainer_client.job_watch_rules import OrphanWatch
from rollfleet.workers.engines.echo import EchoEngine
from rollfleet.workers.worker import Worker, WorkerConfig
from tests.helpers import payload


@pytest.fixture(scope="module")
def shared_broker() -> Iterator[EmbeddedBroker]:
    with temp_broker("rf-autoscale-") as broker:
        yield broker


async def test_the_signal_is_what_the_broker_holds(shared_broker: EmbeddedBroker) -> None:
    url, ns = shared_broker.url, "a" + uuid.uuid4().hex[:8]
    names = Names(ns)
    async with await RolloutClient.connect(url, namespace=ns, client_id="c", fail_fast=False) as client:
        for v in (1, 2):
            await client.commit_version(VersionRecord(version=v, kind="delta", base_version=v - 1))
        nc = await connect(url, name="autoscale-test", inbox_prefix=names.inbox_prefix("trainer"))
        reader = await SignalReader(nc, nc.jetstream(), names).start()
        slow = EchoEngine(latency_s=60.0)
        try:
            async with running_worker(
                url, ns, version=1, worker_id="held1", capacity=1, engine=slow, drain_timeout_s=0.5
            ):
                t0 = time.time()
                for i in range(3):
                    await client.submit(payload(), exact_version=1, idempotency_key=f"e1-{i}", timeout=120)
                for i in range(2):
                    await client.submit(payload(), min_version=2, idempotency_key=f"m2-{i}", timeout=120)
                await client.submit(payload(), exact_version=0, idempotency_key="e0", timeout=120)
                kv = await nc.jetstream().key_value(names.sessions_bucket)
                pinned = SessionRecord(
                    session_id="eval", client_id="c", version_policy="pinned", exact_version=1, last_version=1
                )
                await kv.put(names.session_key("eval"), encode(pinned))
                async with await RolloutClient.connect(url, namespace=ns, client_id="strict") as strict:
                    with pytest.raises(NoCompatibleReplica):
                        await (await strict.submit(payload(), exact_version=0, timeout=10)).result(10)

                async def settled() -> bool:
                    signal, replicas = await reader.read(managed=["held1"])
                    seen.update(signal=signal, replicas=replicas)
                    one = signal.demand(1)  # (the registry says busy at most a second after the broker)
                    return one.in_flight == 1 and one.busy == 1 and signal.demand(0).refusals == 1

                seen: dict[str, object] = {}
                await wait_until(settled, 20, what="the held replica busy with one job, the refusal heard")
                signal, replicas = seen["signal"], seen["replicas"]
                waited = time.time() - t0
                assert signal.latest == 2  # type: ignore[attr-defined]
                one = signal.demand(1)  # type: ignore[attr-defined]
                assert (one.backlog, one.in_flight, one.sessions, one.slots, one.busy) == (2, 1, 1, 1, 1)
                assert 0 < one.oldest_wait_s <= waited + 1
                assert signal.demand(LATEST) == ClassDemand(  # type: ignore[attr-defined]
                    backlog=2,
                    oldest_wait_s=signal.demand(LATEST).oldest_wait_s,  # type: ignore[attr-defined]
                )
                zero = signal.demand(0)  # type: ignore[attr-defined]
                assert (zero.backlog, zero.refusals) == (1, 1)
                [held] = replicas  # type: ignore[misc]
                assert (held.worker_id, held.held, held.managed, held.in_flight) == ("held1", 1, True, 1)
        finally:
            await reader.close()
            await nc.close()


async def test_a_request_that_waits_for_a_replica_is_queued_said_as_demand_and_served_once_one_starts(
    shared_broker: EmbeddedBroker,
) -> None:
    """No replica serves version 1. A request that chose to wait is queued rather than refused:
    past the grace after which an exact job nobody serves is withdrawn (shortened here) it is
    still stored, and its client has said the demand again (a second note, a second later). A
    replica of version 1 is then started with a start-up delay (the echo engine's, as a GPU
    server's): while it starts it serves nothing, and once started it answers the request."""
    url, ns = shared_broker.url, "w" + uuid.uuid4().hex[:8]
    names = Names(ns)
    nc = await connect(url, name="autoscale-test", inbox_prefix=names.inbox_prefix("trainer"))
    async with await RolloutClient.connect(url, namespace=ns, client_id="c") as client:
        client.watch.orphans = OrphanWatch(grace_s=0.2)
        for v in (1, 2):  # (training is at 2: version 1 is a class of its own, a held replica's)
            await client.commit_version(VersionRecord(version=v, kind="delta", base_version=v - 1))
        reader = await SignalReader(nc, nc.jetstream(), names).start()
        worker = Worker(
            WorkerConfig(nats_url=url, namespace=ns, version=1, worker_id="late1", heartbeat_s=0.5),
            EchoEngine(startup_s=1.0),
        )
        starting = None
        try:
            handle = await client.submit(payload(), exact_version=1, timeout=60, wait_for_replica=True)

            async def said_twice_still_queued() -> bool:
                signal, _ = await reader.read()
                return signal.demand(1).refusals >= 2 and signal.demand(1).backlog == 1

            await wait_until(said_twice_still_queued, 20, what="the waiting job said again, still queued")
            assert not handle.done(), handle  # (not withdrawn, though its grace is long past)
            starting = asyncio.create_task(worker.start())
            await wait_until(lambda: client.fleet.replicas(), 20, what="the replica registered")
            [registered] = client.fleet.replicas()
            if not starting.done():  # (its engine still starting: registered, serving nothing)
                assert registered.state == "starting" and not handle.done()
            result = await handle.result(30)
            assert (result.worker_id, result.version_start, result.version_end) == ("late1", 1, 1)
        finally:
            if starting is not None:
                await starting
            await worker.stop()
            await reader.close()
            await nc.close()


async def test_a_version_unreadable_for_a_moment_is_not_taken_for_deleted_for_a_minute(tmp_path: Path) -> None:
    """A version whose directory is missing for a moment (a flaky mount) is looked at again within
    seconds: a request that waits for a replica at it is not left to expire while the controller
    believes retention deleted it (the adversary's ``autoscaler`` schedule, ``held-wait``: the
    directory back after 3 s, the requests expired 30 s later, a held replica never started)."""
    store = tmp_path / "store"
    publisher = PolicyPublisher(store, write_base_checkpoint(tmp_path / "base"))
    publisher.record_base()
    reader = SignalReader(None, None, Names("ns"), store)  # type: ignore[arg-type]  # (no broker read here)
    now = [1000.0]
    reader.clock = lambda: now[0]
    away = tmp_path / "away"
    version_path(store, 0).rename(away)
    assert await reader._unavailable([0]) == {0}
    away.rename(version_path(store, 0))
    now[0] += 10.0
    assert await reader._unavailable([0]) == set()


def test_a_store_says_which_versions_it_can_still_materialize(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publisher = PolicyPublisher(store, write_base_checkpoint(tmp_path / "base"))
    publisher.record_base()
    assert store_has(store, 0)
    assert not store_has(store, 1)  # never published
    shutil.rmtree(version_path(store, 0))  # what retention does to an old version
    assert not store_has(store, 0)
