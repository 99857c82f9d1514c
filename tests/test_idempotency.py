"""Idempotency keys, redelivery after a worker dies, at_most_once, durable results."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from harness import (
    running_worker,
    start_worker_process,
    tensors_at,
    terminate,
    wait_until,
    write_base_checkpoint,
)
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.topology import TopologyConfig
from rollfleet.runtime import faults
from rollfleet.schemas import AnsweredNotice, Names, VersionConstraint, claim_key, encode
from rollfleet.schemas.errors import Expired, IdempotencyConflict, Interrupted, InvalidRequest, NoCompatibleReplica
from rollfleet.trainer_client import PolicyPublisher, RolloutClient, answers
from rollfleet.trainer_client.cancelling import CancelOutcome
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.inbox import ResultsInbox
from rollfleet.trainer_client.own_job_ids import JobIds
from tests.helpers import CountingEcho, built_job, payload

TOPO = TopologyConfig(ack_wait_s=1.5)


async def test_resubmitting_a_key_makes_one_job_and_one_result(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(latency_s=0.3)
    async with running_worker(nats_url, namespace, engine=engine):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            first = await client.submit(payload(), min_version=0, idempotency_key="step1/g0")
            again = await client.submit(payload(), min_version=0, idempotency_key="step1/g0")
            assert again is first  # same process: the same handle
            result = await first.result(10)
        # Another client process with the same id (a restarted trainer) resubmits the key.
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client2:
            info = await client2.js.stream_info(client2.names.jobs_stream)
            third = await client2.submit(payload(), min_version=0, idempotency_key="step1/g0")
            assert third.stream_seq is None  # the broker saw a duplicate and stored nothing
            again_result = await third.result(10)
            assert (await client2.js.stream_info(client2.names.jobs_stream)).state.last_seq == info.state.last_seq
    assert again_result.job_id == result.job_id and again_result.outputs == result.outputs
    assert len(engine.calls) == 1


def _wait_log(path: Path, event: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith("{") and json.loads(line).get("event") == event:
                    return json.loads(line)
        time.sleep(0.05)
    raise AssertionError(f"{event!r} not logged in {path}: {path.read_text() if path.exists() else ''}")


@pytest.mark.parametrize("policy", ["replayable", "at_most_once"])
async def test_worker_killed_mid_job(nats_url: str, namespace: str, tmp_path: Path, policy: str) -> None:
    """SIGKILL a real worker process holding a job: replayable -> rerun once; at_most_once -> Interrupted."""
    log_a = tmp_path / "a.log"
    a = start_worker_process(nats_url, namespace, "victim", "--echo-latency", "30", "--ack-wait", "1.5", log_path=log_a)
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(payload(), min_version=0, retry_policy=policy, idempotency_key="k1")
            await wait_until(lambda: client.fleet.replicas()[0].in_flight == 1, timeout=10)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            engine = CountingEcho()
            async with running_worker(nats_url, namespace, engine=engine, worker_id="rescuer", topology=TOPO):
                if policy == "replayable":
                    result = await handle.result(20)
                    assert result.worker_id == "rescuer" and result.delivery_attempt == 2
                    assert engine.calls  # it ran again
                else:
                    with pytest.raises(Interrupted) as info:
                        await handle.result(20)
                    assert info.value.retryable
                    assert not engine.calls  # not run again
                # Exactly one outcome reaches the client for the key.
                await client.nc.flush()
                assert client.unclaimed() == {}
                info_r = await client.js.stream_info(client.names.results_stream)
                assert info_r.state.messages == 1
    finally:
        terminate(a, 20.0, signal.SIGKILL)


async def test_result_stored_before_death_is_not_regenerated(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """The holder dies after storing the result but before acking: the redelivery is acked, not rerun."""
    env = faults.env("kill", "worker:after-result-before-ack")
    a = start_worker_process(
        nats_url, namespace, "dies-late", "--ack-wait", "1.5", env=env, log_path=tmp_path / "a.log"
    )
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(payload(), min_version=0, idempotency_key="stored")
            result = await handle.result(10)
            assert a.wait(10) == -signal.SIGKILL  # it died right after storing the result
            engine = CountingEcho()
            async with running_worker(nats_url, namespace, engine=engine, topology=TOPO):

                async def job_gone() -> bool:
                    return await _jobs_left(client) == 0

                await wait_until(job_gone, timeout=15)
            assert engine.calls == []  # found the stored result instead of generating again
            assert result.delivery_attempt == 1 and result.worker_id == "dies-late"
            assert client.unclaimed() == {}
    finally:
        terminate(a, 20.0, signal.SIGKILL)


async def _jobs_left(client: RolloutClient) -> int:
    return (await client.js.stream_info(client.names.jobs_stream)).state.messages


async def test_results_wait_for_a_reconnecting_client(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(latency_s=0.5)
    async with running_worker(nats_url, namespace, engine=engine):
        client = await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer-7")
        keys = [f"step3/s{i}" for i in range(5)]
        for key in keys:
            await client.submit(payload([len(key), 7]), min_version=0, idempotency_key=key)
        await client.close()  # the trainer goes away before any result arrives
        await wait_until(lambda: len(engine.calls) == 5, timeout=15)
        await wait_until(lambda: engine.running == 0, timeout=15)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer-7") as back:
            results = {key: await back.result(key, timeout=10) for key in keys}
    assert {r.idempotency_key for r in results.values()} == set(keys)
    assert all(r.client_id == "trainer-7" for r in results.values())


async def test_result_consumed_by_a_dead_process_is_read_back(nats_url: str, namespace: str) -> None:
    """The previous trainer received (and acked) a result but died before using it."""
    async with running_worker(nats_url, namespace):
        first = await RolloutClient.connect(nats_url, namespace=namespace, client_id="t")
        await (await first.submit(payload(), min_version=0, idempotency_key="used-by-the-dead")).result(10)
        await first.close()
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as back:
            result = await back.result("used-by-the-dead", timeout=5)
    assert result.idempotency_key == "used-by-the-dead"


async def test_a_key_resubmitted_after_the_duplicate_window_still_gets_its_one_answer(
    nats_url: str, namespace: str
) -> None:
    """Past the window the broker has forgotten the key; the client has not: a key it already had
    answered is looked up among the stored answers, and the answer comes back with nothing run
    again (a job stored again under the key's own job id would find itself answered)."""
    window = TopologyConfig(duplicate_window_s=1.0)
    engine = CountingEcho()
    async with running_worker(nats_url, namespace, engine=engine, topology=window):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=window) as client:
            first = await (await client.submit(payload(), min_version=0, idempotency_key="k")).result(10)
            await asyncio.sleep(1.5)  # the broker forgets the key, and the client's start is past the window
            again = await client.submit(payload(), min_version=0, idempotency_key="k")
            assert again.stream_seq is None  # nothing stored
            second = await again.result(10)
    assert second.job_id == first.job_id and second.outputs == first.outputs
    assert len(engine.calls) == 1


async def test_a_key_answered_before_asked_by_a_fresh_client_past_every_window_gets_its_one_answer(
    nats_url: str, namespace: str
) -> None:
    """A key answered through one client is asked again through a fresh one (a restarted trainer,
    another gateway) after the broker's duplicate window and the fresh client's own start window:
    the broker stores the job again, under the key's one job id, and the replica that pulls it finds
    it answered. The asker gets the stored answer, the same tokens, with nothing run again: a plain
    keyed submit, and a session's turn asked again under the caller's key."""
    window = TopologyConfig(duplicate_window_s=1.0)
    engine = CountingEcho()
    async with running_worker(nats_url, namespace, engine=engine, topology=window):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=window) as first:
            plain = await (await first.submit(payload([1]), min_version=0, idempotency_key="k")).result(10)
            session = await first.session(min_version=0).open()
            turn = await session.generate(payload([2]), key="turn-k")
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=window) as back:
            resumed = await back.resume_session(session.session_id)
            await asyncio.sleep(1.2)  # past the keys' duplicate window and this client's own start
            again = await back.submit(payload([1]), min_version=0, idempotency_key="k", timeout=8)
            assert again.stream_seq is not None  # the broker forgot the key: the job is stored again
            plain_again = await again.result(10)
            turn_again = await resumed.generate(payload([2]), key="turn-k", timeout=8)
    assert (plain_again.job_id, plain_again.outputs) == (plain.job_id, plain.outputs)
    assert (turn_again.job_id, turn_again.outputs) == (turn.job_id, turn.outputs)
    assert len(engine.calls) == 2, engine.calls  # each request ran once
    assert resumed.next_turn == 1  # asked again, the turn spent no index


async def test_a_notice_sends_only_the_handle_waiting_for_that_job_to_its_stored_answer() -> None:
    """A replica's notice that it found a job answered carries no answer: the handle waiting for
    that very job reads the stored one; a notice naming another job of the key, a key nobody here
    waits for, or bytes that are no notice, sends nobody (a forged one costs a look-up at most)."""
    ids, names = JobIds("c", b"s" * 32), Names("ns")
    job, data = built_job(payload(), VersionConstraint("min", 0), "min:0", key="k", job_id=ids.issue("k"))

    async def no_cancel(handle: RolloutHandle, timeout: float) -> CancelOutcome:
        raise AssertionError("not cancelled here")

    handle = RolloutHandle(job, data, no_cancel)
    noticed: list[RolloutHandle] = []
    inbox = ResultsInbox(None, None, names, {"k": handle}, lambda h, o: True, shared=False, noticed=noticed.append)  # type: ignore[arg-type]

    def notice(key: str, job_id: str) -> bytes:
        return encode(AnsweredNotice(idempotency_key=key, client_id="c", job_id=job_id))

    inbox.notice(notice("k", ids.issue("k2")))  # another job under the key
    inbox.notice(notice("k2", ids.issue("k2")))  # nobody waits for the key
    inbox.notice(b"\x81\xa1x\x01")  # no notice
    assert noticed == []
    inbox.notice(notice("k", job.job_id))
    assert noticed == [handle]
    handle.set_error(Expired("settled meanwhile"))
    inbox.notice(notice("k", job.job_id))
    assert noticed == [handle]


@pytest.mark.parametrize("policy", ["at_most_once", "resume"])
async def test_a_trainer_restarted_past_the_window_resubmitting_a_running_key_runs_it_once(
    nats_url: str, namespace: str, policy: str
) -> None:
    """A trainer restarted after the duplicate window submits a key that is still running: the
    broker stores the job again, under the key's one job id, so the running job's claim keeps the
    copy from running; the restarted trainer gets the one answer."""
    window = TopologyConfig(duplicate_window_s=1.0)
    engine = CountingEcho(per_token_s=0.2)
    async with running_worker(nats_url, namespace, engine=engine, topology=window, capacity=4):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=window) as first:
            handle = await first.submit(
                payload(max_tokens=20), min_version=0, idempotency_key="k", retry_policy=policy, timeout=6
            )
            await wait_until(lambda: len(engine.calls) == 1, timeout=5)
        await asyncio.sleep(1.2)  # past the key's duplicate window, the job still running (4 s)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=window) as back:
            again = await back.submit(
                payload(max_tokens=20), min_version=0, idempotency_key="k", retry_policy=policy, timeout=6
            )
            assert again.stream_seq is not None and again.job_id == handle.job_id  # stored again: the same job
            result = await again.result(15)
            await asyncio.sleep(1.0)  # the copy's delivery has been judged by now
            stored = [o async for _, o in answers.stored(back.js, back.names, "c", "k")]
    assert len(engine.calls) == 1, engine.calls
    assert len(stored) == 1 and result.job_id == handle.job_id and len(result.outputs[0].token_ids) == 20


async def test_a_stored_answer_wins_over_the_fleet_check(nats_url: str, namespace: str) -> None:
    """Resubmitting an answered key must return its answer even when no replica could serve the
    request any more (the fleet moved past its exact version)."""
    async with running_worker(nats_url, namespace, version=0):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            answered = await (await client.submit(payload(), exact_version=0, idempotency_key="k0")).result(10)
    async with running_worker(nats_url, namespace, version=1):  # the only replica is at version 1 now
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: [r.active_version for r in client.fleet.replicas()] == [1], 10)
            again = await (await client.submit(payload(), exact_version=0, idempotency_key="k0")).result(10)
            with pytest.raises(NoCompatibleReplica):  # a new key still fails fast
                await (await client.submit(payload(), exact_version=0, idempotency_key="new")).result(10)
    assert again.job_id == answered.job_id and again.outputs == answered.outputs


async def test_a_key_reused_for_a_different_request_is_refused(nats_url: str, namespace: str) -> None:
    async with running_worker(nats_url, namespace, engine=CountingEcho(latency_s=0.5)):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            pending = await client.submit(payload([1, 2, 3]), min_version=0, idempotency_key="k")
            with pytest.raises(IdempotencyConflict):  # while pending, in this process
                await client.submit(payload([4, 5, 6]), min_version=0, idempotency_key="k")
            with pytest.raises(IdempotencyConflict):  # another constraint is another request too
                await client.submit(payload([1, 2, 3]), exact_version=0, idempotency_key="k")
            assert (await client.submit(payload([1, 2, 3]), min_version=0, idempotency_key="k")) is pending
            await pending.result(10)
        # After the answer, from a restarted trainer: the stored answer is for another request.
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            with pytest.raises(IdempotencyConflict):
                await (await client.submit(payload([9]), min_version=0, idempotency_key="k")).result(10)
            same = await (await client.submit(payload([1, 2, 3]), min_version=0, idempotency_key="k")).result(10)
            assert same.idempotency_key == "k"


async def test_a_restarted_trainer_resubmitting_the_same_request_after_a_commit_gets_its_answer(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A request is what its caller wrote: ``max_staleness=1`` asked before a crash and again after
    a commit moved ``latest`` is the same request (no IdempotencyConflict), with the one answer."""
    base = write_base_checkpoint(tmp_path / "base")
    publisher = PolicyPublisher(tmp_path / "store", base, keep_last=None)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t", fail_fast=False) as first:
        await first.publish_policy(publisher, tensors_at(0))
        await first.publish_policy(publisher, tensors_at(1))
        async with running_worker(nats_url, namespace, version=1, worker_id="old"):
            answered = await (await first.submit(payload([8]), max_staleness=1, idempotency_key="step8/g0")).result(10)
            assert answered.version_start == 1
        await wait_until(lambda: not first.fleet.replicas(), timeout=10)
        queued = await first.submit(payload([4, 2]), max_staleness=1, idempotency_key="step9/g0", timeout=60)
        assert queued.job.constraint.version == 0
        s = await first.session("talk", max_staleness=1, version_policy="free").open()
        turn = asyncio.ensure_future(s.generate(payload([1, 2]), timeout=60))
        await asyncio.sleep(0.3)
        turn.cancel()
    # (The trainer died. Meanwhile the policy moved on: latest - 1 is 2 now, not 0.)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="x") as other:
        await other.publish_policy(publisher, tensors_at(2))
        await other.publish_policy(publisher, tensors_at(3))
    async with (
        running_worker(nats_url, namespace, version=3, worker_id="w"),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as back,
    ):
        await wait_until(lambda: len(back.fleet.replicas()) == 1)
        again = await back.submit(payload([4, 2]), max_staleness=1, idempotency_key="step9/g0", timeout=60)
        result = await again.result(20)  # the job stored before the crash (min 0), served at 3
        assert result.job_id == queued.job_id and result.version_start == 3
        # One answered before the crash, at 1: the same answer, judged by what it was asked (min 0).
        same = await (await back.submit(payload([8]), max_staleness=1, idempotency_key="step8/g0")).result(10)
        assert same.job_id == answered.job_id and same.version_start == 1
        resumed = await back.resume_session("talk")
        assert (await resumed.generate(payload([1, 2]), timeout=20)).worker_id == "w"


async def test_an_at_most_once_job_outliving_its_claims_lifetime_is_never_run_twice(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """The claims bucket keeps a claim for claims_ttl_s (8 s here). A time-out longer than that
    is refused at submit; a job running longer keeps its claim fresh, so a claims' lifetime
    after it was first claimed, mid-way through a 50 s run, it is still claimed. Its worker is
    SIGKILLed then (its trainer is gone too, so nobody withdraws it): redelivered, the job is
    answered by the other replica without being run again."""
    topo = TopologyConfig(ack_wait_s=1.0, claims_ttl_s=8.0)
    a = start_worker_process(
        nats_url, namespace, "a", "--ack-wait", "1", "--echo-token-latency", "0.05", log_path=tmp_path / "a.log"
    )
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as client:
            with pytest.raises(InvalidRequest, match="at most 8 s"):
                await client.submit(payload(), min_version=0, retry_policy="at_most_once", timeout=12)
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            # A job answered first: the subject's consumer exists and the worker pulls there, so
            # the job below starts within its deadline however loaded the host (else it is
            # answered Expired unrun, and never claimed).
            await (await client.submit(payload(), min_version=0)).result(30)
            handle = await client.submit(  # a 50 s run: still running when it is killed, however slow the host
                payload(max_tokens=1000), min_version=0, retry_policy="at_most_once", idempotency_key="once", timeout=8
            )
            job_id = handle.job_id
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="obs", topology=topo) as obs:
            claims = await obs.js.key_value(obs.names.claims_bucket)
            # (from when it was claimed, not from the submit: a loaded host may start it late)
            await wait_until(lambda: claims.get(claim_key(job_id)), 8, what="the job claimed", retry_errors=True)
            await asyncio.sleep(9.0)  # past the claims' lifetime, mid-run
            held = await claims.get(claim_key(job_id))
            assert (held.value or b"").startswith(b"a:"), held.value  # refreshed, not expired
        a.send_signal(signal.SIGKILL)
        b_engine = CountingEcho()
        async with running_worker(nats_url, namespace, worker_id="b", engine=b_engine, topology=topo):
            async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as back:
                with pytest.raises((Interrupted, Expired)):
                    await back.result("once", timeout=20)
            assert b_engine.calls == []  # answered, never run a second time
    finally:
        terminate(a, 10.0, signal.SIGKILL)


async def test_a_key_resubmitted_after_a_broker_restart_is_answered_once(tmp_path: Path) -> None:
    """The broker rebuilds its duplicate detection from the jobs it stores when it restarts, and
    an answered job is no longer stored: a restarted trainer resubmitting an answered key after
    a broker restart still gets the one answer, and nothing runs a second time."""
    broker = EmbeddedBroker(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    try:
        engine = CountingEcho()
        async with running_worker(broker.url, "restart", engine=engine, worker_id="w"):
            async with await RolloutClient.connect(broker.url, namespace="restart", client_id="t") as first:
                answered = await (await first.submit(payload([3]), min_version=0, idempotency_key="k")).result(10)
            broker.kill()
            broker.start()  # same port, same store
            async with await RolloutClient.connect(broker.url, namespace="restart", client_id="t") as back:
                again = await (await back.submit(payload([3]), min_version=0, idempotency_key="k")).result(10)
                assert again.job_id == answered.job_id and again.outputs == answered.outputs
                await asyncio.sleep(0.5)
            assert len(engine.calls) == 1
    finally:
        broker.stop()


async def test_a_key_resubmitted_while_the_broker_restarts_is_answered_once(tmp_path: Path) -> None:
    """Item 12: a client older than the duplicate window (3 s here) resubmits an answered key while
    the broker is down; the broker comes back with its duplicate detection rebuilt from the jobs
    it stores (the answered one is gone). The resubmission waits for the broker and finds the
    stored answer before it stores anything: one job run, one answer."""
    topo = TopologyConfig(duplicate_window_s=3.0)
    broker = EmbeddedBroker(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    try:
        engine = CountingEcho()
        async with (
            running_worker(broker.url, "restart", engine=engine, worker_id="w", topology=topo),
            await RolloutClient.connect(broker.url, namespace="restart", client_id="t", topology=topo) as client,
        ):
            await asyncio.sleep(topo.duplicate_window_s)  # this client's own start is past the window
            answered = await (await client.submit(payload([3]), min_version=0, idempotency_key="k")).result(10)
            broker.kill()
            await wait_until(lambda: not client.nc.is_connected, timeout=5)  # the client knows it is away
            again = asyncio.ensure_future(client.submit(payload([3]), min_version=0, idempotency_key="k"))
            await asyncio.sleep(0.3)
            broker.start()  # same port, same store; well inside the key's duplicate window
            result = await (await asyncio.wait_for(again, 20)).result(10)
            assert result.job_id == answered.job_id and result.outputs == answered.outputs
            await asyncio.sleep(1.0)
            stored = [o async for _, o in answers.stored(client.js, client.names, "t", "k")]
            assert len(stored) == 1 and len(engine.calls) == 1
    finally:
        broker.stop()


def test_a_resubmission_looks_for_a_stored_answer_in_the_window_or_while_the_broker_is_away() -> None:
    assert answers.look_up_before_storing(now=10.0, recheck_until=11.0, connected=True)
    assert not answers.look_up_before_storing(now=12.0, recheck_until=11.0, connected=True)
    # Past the window, but the broker is away: it may come back without the key's duplicate entry.
    assert answers.look_up_before_storing(now=12.0, recheck_until=11.0, connected=False)
    # Past the window, a key this process already had answered (the broker forgot it).
    assert answers.look_up_before_storing(now=12.0, recheck_until=11.0, connected=True, answered_here=True)


def test_a_key_has_one_job_id_per_client_id_and_a_keyless_job_a_new_one_each_time() -> None:
    ids, again, other = JobIds("c", b"s" * 32), JobIds("c", b"s" * 32), JobIds("d", b"s" * 32)
    assert ids.issue("k") == again.issue("k")  # a restarted trainer: the same job
    assert ids.issue("k") != ids.issue("k2") and ids.issue("k") != other.issue("k")
    assert ids.issue("k") != JobIds("c", b"t" * 32).issue("k")  # unguessable without the secret
    assert ids.issued(ids.issue("k"), "k") and not ids.issued(ids.issue("k"), "k2")
    assert not other.issued(ids.issue("k"), "k")
    keyless = ids.issue(None)
    assert keyless != ids.issue(None) and ids.issued(keyless, keyless)


def test_keyless_job_ids_never_repeat_across_nonce_blocks_or_a_fork() -> None:
    """Keyless jobs' nonces are cut from blocks of OS randomness: every one is new, over several
    blocks, and a forked child does not hand out the parent's next ones."""
    ids = JobIds("c", b"s" * 32)
    issued = [ids.issue(None) for _ in range(3 * 512 + 7)]  # (512 nonces a block)
    assert len(set(issued)) == len(issued) and all(ids.issued(i, i) for i in issued)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its next id, to the parent
        try:
            os.write(write, ids.issue(None).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read, "rb") as pipe:
        from_child = pipe.read().decode()
    assert ids.issued(from_child, from_child) and from_child != ids.issue(None)
    assert from_child not in issued


async def test_a_job_stored_again_under_a_move_id_an_earlier_process_used_is_not_lost(
    nats_url: str, namespace: str
) -> None:
    """A trainer restarted within the duplicate window moves a job its predecessor had moved
    already: the move's message id (``<key>#1``) is a duplicate of a copy that is gone, so the
    broker stores nothing. The job must still be stored somewhere, not left nowhere."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", fail_fast=False) as client:
        handle = await client.submit(payload(), min_version=0, idempotency_key="k")
        assert handle.subject is not None and handle.stream_seq is not None
        earlier = await client.placement.store(handle, handle.subject, "k#1")  # the predecessor's move
        await client.js.delete_msg(client.names.jobs_stream, earlier.seq)  # ... taken and gone since
        assert await client.placement.requeue(handle)
        assert handle.stream_seq not in (None, earlier.seq)
        found = await client.placement.job_at(handle.stream_seq)
        assert found is not None and found[0].job_id == handle.job_id


def test_a_withdrawn_key_stays_bound_to_its_request_for_the_window() -> None:
    from rollfleet.trainer_client.withdrawn import WithdrawnKeys

    keys = WithdrawnKeys(window_s=10.0)
    keys.note("k", "request-1", now=100.0)
    assert keys.conflicts("k", "request-2", now=105.0)
    assert not keys.conflicts("k", "request-1", now=105.0)  # asked again: the same request
    assert not keys.conflicts("other", "request-2", now=105.0)
    assert not keys.conflicts("k", "request-2", now=110.0) and len(keys) == 0  # past the window


async def test_a_different_request_under_a_withdrawn_jobs_key_is_a_conflict(nats_url: str, namespace: str) -> None:
    # Campaign 10, seed 73: a key's job was withdrawn unanswered; within the duplicate window a
    # different request under the key found no job to compare with, was stored in its place and
    # ran, and the first request, asked again, was refused as the conflict.
    engine = CountingEcho(latency_s=3.0)
    async with (
        running_worker(nats_url, namespace, version=0, worker_id="busy", capacity=1, engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        client.deadline_grace_s = 0.2
        blocker = await client.submit(payload(), min_version=0, idempotency_key="blocker")
        await wait_until(lambda: len(engine.calls) == 1)
        first = await client.submit(payload([7, 8]), min_version=0, timeout=0.3, idempotency_key="k")
        with pytest.raises(Expired):
            await first.result(10)
        await wait_until(lambda: len(client.placement.withdrawn) == 1, what="the expired job withdrawn")
        with pytest.raises(IdempotencyConflict):
            await client.submit(payload([9, 9]), min_version=0, idempotency_key="k")
        again = await client.submit(payload([7, 8]), min_version=0, timeout=20, idempotency_key="k")
        await blocker.result(10)
        assert (await again.result(20)).outputs  # the first request, asked again, runs
