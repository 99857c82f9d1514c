"""The broker's store lost (restarted on an empty store: a disk replaced) or a stream or bucket
deleted through the JetStream API: the trainer's client declares the namespace again, restores
its own part of it (its results consumer, its job-id secret, its lease), and the fleet serves again
by itself, without a process restart. Real nats-server, real workers and clients."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import nats
import nats.aio.msg
import nats.js.errors

from harness import running_worker, wait_until
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.topology import (
    ensure_topology,
    renewed_streams,
    topology_check_due,
)
from rollfleet.schemas.errors import Expired
from rollfleet.trainer_client import RolloutClient
from rollfleet.trainer_client.lease import lease_held
from rollfleet.trainer_client.restore import versions_to_declare
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import payload

BOUND_S = 12.0  # a deletion advisory or a reconnect pokes the keeper at once


async def _served(client: RolloutClient, tag: int, bound: float = BOUND_S) -> str:
    """Submit until one call is answered within ``bound`` (a call during the loss may fail)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + bound
    last: Exception | None = None
    while loop.time() < until:
        try:
            handle = await client.submit(payload([tag]), min_version=0, timeout=4.0)
            return (await handle.result(5)).worker_id
        except Exception as exc:  # (ServiceUnavailable, Expired while the namespace is missing)
            last = exc
            await asyncio.sleep(0.3)
    raise AssertionError(f"not served again within {bound} s: {last!r}")


async def _answered_by(client: RolloutClient, handle: Any, worker_id: str, timeout: float) -> None:
    """The handle's answer came from ``worker_id``; if none came, fail with what the broker says of
    the job's subject (what a run that failed here once, unreproduced, did not leave behind)."""
    try:
        result = await handle.result(timeout)
    except (Expired, TimeoutError) as exc:  # (its deadline, or the wait's)
        consumer = client.names.job_consumer(handle.job.constraint.kind, handle.job.constraint.version)
        try:
            info = await client.js.consumer_info(client.names.jobs_stream, consumer)
            seen = (
                f"waiting={info.num_waiting} pending={info.num_pending} ack_pending={info.num_ack_pending} "
                f"delivered={info.delivered} ack_floor={info.ack_floor} stored at seq {handle.stream_seq}"
            )
        except Exception as info_exc:  # (the diagnosis only)
            seen = f"consumer info failed: {info_exc!r}"
        try:  # (an answer stored but never delivered to this client would show here)
            info = await client.js.consumer_info(client.names.results_stream, client._results_consumer)
            results = (
                f"waiting={info.num_waiting} pending={info.num_pending} ack_pending={info.num_ack_pending} "
                f"delivered={info.delivered}"
            )
        except Exception as info_exc:  # (the diagnosis only)
            results = f"consumer info failed: {info_exc!r}"
        fleet = [(r.worker_id, r.active_version, r.state) for r in client.fleet.replicas()]
        raise AssertionError(f"{exc!r}; {consumer}: {seen}; results: {results}; fleet {fleet}") from exc
    assert result.worker_id == worker_id


def _busy_worker(url: str, namespace: str, worker_id: str) -> Any:
    """A replica with one slot, which it keeps for ten minutes with the first job it takes (it
    drains for a second only when stopped): jobs stored after that one stay queued."""
    return running_worker(
        url, namespace, worker_id=worker_id, capacity=1, engine=EchoEngine(latency_s=600), drain_timeout_s=1.0
    )


async def test_deleted_jobs_and_results_streams_are_declared_again(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, worker_id="w") as worker,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        assert await _served(client, 1) == "w"
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            await js.delete_stream(client.names.jobs_stream)
            await js.delete_stream(client.names.results_stream)
            # Declared again at once by another process (another trainer, a gateway): this client
            # must still see that what it kept there (its results consumer) was lost.
            await ensure_topology(js, client.names)
            assert await _served(client, 2) == worker.config.worker_id
            # The client id's results consumer is back with the stream (a restarted trainer's too).
            await js.consumer_info(client.names.results_stream, client.names.results_consumer("c"))
        finally:
            await nc.close()


async def test_broker_restarted_on_an_empty_store_serves_again(tmp_path: Path, namespace: str) -> None:
    broker = EmbeddedBroker(store_dir=tmp_path / "store").start()
    try:
        async with (
            running_worker(broker.url, namespace, worker_id="w"),
            await RolloutClient.connect(broker.url, namespace=namespace, client_id="c") as client,
        ):
            assert await _served(client, 1) == "w"
            broker.kill()
            shutil.rmtree(tmp_path / "store")  # the disk replaced: every stream, consumer, bucket gone
            broker.start()  # same port
            assert await _served(client, 2) == "w"
            assert client.inbox.receiving  # the lease key the wipe took was not taken for a take-over
            # The client id's secret is back: a restarted trainer recognises the ids issued before.
            nc = await nats.connect(broker.url)
            try:
                kv = await nc.jetstream().key_value(client.names.sessions_bucket)
                await kv.get("c.c")
            finally:
                await nc.close()
    finally:
        broker.stop()


async def test_a_key_answered_before_the_store_was_lost_is_answered_again(tmp_path: Path, namespace: str) -> None:
    """A key answered, then its stored answer lost with the broker's store, then submitted again:
    its job runs again (under the key's job id) and that answer reaches the waiting handle; the
    client's memory of answers it handed out must not drop it as a late duplicate."""
    broker = EmbeddedBroker(store_dir=tmp_path / "store").start()
    try:
        async with (
            running_worker(broker.url, namespace, worker_id="w"),
            await RolloutClient.connect(broker.url, namespace=namespace, client_id="c") as client,
        ):
            first = await (await client.submit(payload([7]), min_version=0, idempotency_key="k")).result(10)
            broker.kill()
            shutil.rmtree(tmp_path / "store")
            broker.start()
            await _served(client, 2)  # (the namespace is back)
            again = await client.submit(payload([7]), min_version=0, idempotency_key="k", timeout=6.0)
            result = await again.result(8)
            assert result.job_id == first.job_id  # (the key's job id)
    finally:
        broker.stop()


async def test_consumers_a_rollback_left_past_their_streams_end_serve_new_jobs(tmp_path: Path, namespace: str) -> None:
    """A broker restarted on a store whose streams lost their last writes while a consumer's state
    kept them (a copy taken while the broker had not flushed its message blocks, as the
    adversary's rollback found: "consumer ACK sequence 33 past last stream sequence of 29"),
    with an older job still unacknowledged (running then). Were the consumer left counting the
    sequences the stream reuses as delivered, it would skip every new job until the stream passed
    the old end; the broker (2.15) moves such a consumer back to its stream's end, and the next
    job is served at once. Held here because the recovery rests on it."""
    store = tmp_path / "store"
    broker = EmbeddedBroker(store_dir=store).start()
    try:
        async with (
            await RolloutClient.connect(broker.url, namespace=namespace, client_id="c") as client,
            _busy_worker(broker.url, namespace, "slow"),
        ):
            # A job taken and still running when the store is copied: the consumer waits for its ack.
            await client.submit(payload([1]), min_version=0, timeout=300.0)

            async def taken() -> bool:
                info = await client.js.consumer_info(client.names.jobs_stream, client.names.job_consumer("min", 0))
                return info.num_ack_pending == 1

            await wait_until(taken, 10, what="the slow replica took the job", retry_errors=True)
            # (Stopped, not killed, for each copy: the broker writes consumers' states lazily.)
            broker.stop()
            shutil.copytree(store, tmp_path / "early", symlinks=True)
            broker.start()
            async with running_worker(broker.url, namespace, worker_id="w"):
                for tag in range(2, 8):  # the consumer's delivered sequence moves past the early end
                    handle = await client.submit(payload([tag]), min_version=0, timeout=20.0)
                    await _answered_by(client, handle, "w", 25)
                broker.stop()
                shutil.copytree(store, tmp_path / "late", symlinks=True)
                # The early copy's messages with the late copy's consumer states: a lost unflushed tail.
                shutil.rmtree(store)
                shutil.copytree(tmp_path / "early", store, symlinks=True)
                for obs in (tmp_path / "late").rglob("obs"):
                    target = store / obs.relative_to(tmp_path / "late")
                    shutil.rmtree(target, ignore_errors=True)
                    shutil.copytree(obs, target)
                broker.start()
                # One job, asked once: the consumer left past the end would skip it.
                handle = await client.submit(payload([8]), min_version=0, timeout=15.0)
                await _answered_by(client, handle, "w", 18)
    finally:
        broker.stop()


async def test_a_submit_while_the_broker_restarts_waits_for_it_to_declare_the_subjects_consumer(
    tmp_path: Path, namespace: str
) -> None:
    """After a reconnect the client looks up every consumer again (the broker may have come back on
    an older store). A submit made while the broker is away, longer than one request waits (5 s),
    must wait for it as storing the job does, not fail at the first unanswered look-up (as CI
    found: "cannot create the consumer of min:0: nats: timeout" just after a restart)."""
    store = tmp_path / "store"
    broker = EmbeddedBroker(store_dir=store).start()
    try:
        async with (
            await RolloutClient.connect(broker.url, namespace=namespace, client_id="c") as client,
            running_worker(broker.url, namespace, worker_id="w"),
        ):
            assert (await (await client.submit(payload([1]), min_version=0, timeout=30.0)).result(30)).worker_id == "w"
            broker.stop()
            client.forget_consumers()  # (as restoring after the reconnect does)
            submitting = asyncio.create_task(client.submit(payload([2]), min_version=0, timeout=60.0))
            await asyncio.sleep(6.5)  # past the first look-up's wait
            assert not submitting.done(), submitting.exception()
            broker.start()
            handle = await asyncio.wait_for(submitting, 40)
            await _answered_by(client, handle, "w", 30)
    finally:
        broker.stop()


async def test_a_withdrawal_after_a_rollback_removes_only_its_own_job(nats_url: str, namespace: str) -> None:
    """A broker gone back to an older copy of its store hands the sequences past the copy's end to
    new jobs, so a handle from before may hold a sequence where another job lies now (as the
    adversary's rollback found: a job stored after it vanished unserved). Withdrawing that handle's
    job must leave the other job where it is."""
    async with (
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
        _busy_worker(nats_url, namespace, "busy"),
    ):
        await client.submit(payload([1]), min_version=0, timeout=300.0)  # keeps the one slot busy
        lost = await client.submit(payload([2]), min_version=0, timeout=300.0)
        other = await client.submit(payload([3]), min_version=0, timeout=300.0)
        assert other.stream_seq is not None and lost.stream_seq != other.stream_seq
        lost.stream_seq = other.stream_seq  # where the rolled-back stream put the other job
        await client.placement.delete(lost)
        found = await client.placement.job_at(other.stream_seq)
        assert found is not None and found[0].job_id == other.job_id


async def test_a_sticky_turn_lost_with_the_store_moves_to_the_shared_subject(
    nats_url: str, namespace: str
) -> None:
    """A turn whose job the broker's store lost (a wipe just after it was stored) is no longer on
    its replica's subject: it cannot be withdrawn, yet it is not answered. It must still move to
    the shared subject (stored again, the same job), or it waits out its deadline while no replica
    could ever take it (the adversary's broker-stores seed 2: a pinned session's turn sent at the
    wipe, answered only at its deadline)."""
    async with (
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
        _busy_worker(nats_url, namespace, "busy"),
    ):
        await client.submit(payload([1]), min_version=0, timeout=300.0)  # keeps the one slot busy
        turn = await client.submit(payload([2]), min_version=0, timeout=300.0)
        assert turn.stream_seq is not None
        await client.js.delete_msg(client.names.jobs_stream, turn.stream_seq)  # lost with the store
        turn.replica = "busy"  # (as a sticky turn: on the replica's own subject)
        lost_at = turn.stream_seq
        assert await client.placement.move_to_shared(turn)
        assert turn.replica is None and turn.stream_seq != lost_at
        found = await client.placement.job_at(turn.stream_seq)
        assert found is not None and found[0].job_id == turn.job_id  # the same job, stored again


async def test_deleted_registry_and_claims_buckets_are_declared_again(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, worker_id="w"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        assert await _served(client, 1) == "w"
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            await js.delete_key_value(client.names.fleet_bucket)
            await js.delete_key_value(client.names.claims_bucket)

            async def back() -> bool:
                try:
                    await js.key_value(client.names.fleet_bucket)
                    await js.key_value(client.names.claims_bucket)
                    return True
                except nats.js.errors.BucketNotFoundError:
                    return False

            await wait_until(back, timeout=BOUND_S)
            # The worker's heartbeat writes its entry again, and the client's view hears it: its
            # watch of the registry was renewed (the old one waits on a consumer that is gone).
            await asyncio.sleep(1.0)
            heard = client.fleet.replica("w")
            since = heard.heartbeat_at if heard is not None else 0.0
            await wait_until(
                lambda: (r := client.fleet.replica("w")) is not None and r.heartbeat_at > since + 1.0, timeout=BOUND_S
            )
            assert await _served(client, 2) == "w"
            assert client.inbox.receiving
        finally:
            await nc.close()


async def test_a_lease_key_lost_or_rolled_back_is_not_a_take_over(nats_url: str, namespace: str) -> None:
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        kv = await client.js.key_value(client.names.fleet_bucket)
        key, mine = client.names.client_key("c"), client._lease.instance.encode()
        await kv.delete(key)  # lost with a wiped store
        assert await client._lease.held()
        assert (await kv.get(key)).value == mine  # written back
        await kv.put(key, b"a-dead-instance")  # a store rolled back to before this client took the id
        assert await client._lease.held()
        assert (await kv.get(key)).value == mine
        # Another live client answering on the id's subject: that is a take-over.
        nc = await nats.connect(nats_url)
        try:

            async def answer(msg: nats.aio.msg.Msg) -> None:
                await nc.publish(msg.reply, b"another-instance")

            await nc.subscribe(client.names.client_alive_subject("c"), cb=answer)
            await nc.flush()
            await kv.put(key, b"another-instance")
            assert not await client._lease.held()
        finally:
            await nc.close()


def test_rules() -> None:
    assert topology_check_due(None, False)  # the first look
    assert topology_check_due(9.9, True)  # a reconnect, a deletion advisory: at once
    assert not topology_check_due(8.0, False)  # no timer: an idle trainer asks nothing
    # The lease: only another live client answering is a take-over; a lost or stale key is rewritten.
    assert lease_held("me", "me", []) == "held"
    assert lease_held(None, "me", []) == "rewrite"
    assert lease_held("dead-one", "me", []) == "rewrite"
    assert lease_held("other", "me", ["other"]) == "lost"
    assert versions_to_declare([3, 3, 5], 6) == [3, 5, 6]
    assert versions_to_declare([], None) == []
    # A stream missing, or created at another time than last seen (deleted and declared again by
    # any process), lost what it held; one seen for the first time did not.
    before = {"A": "t1", "B": "t1", "C": "t1"}
    assert renewed_streams(before, {"A": "t1", "B": "t2", "C": None, "D": "t1"}) == ["B", "C"]
