"""A claimed job's redelivery racing the run it duplicates (issue 30: the machine adversary's
``pauses`` schedule saw an at_most_once job run twice on one replica): the holder stores its
answer and releases its claim between the redelivery's look for an answer and its claim. The
claim is then free, and without a second look the job would be generated again."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import nats
import pytest

from harness import start_worker_process, terminate, wait_until
from harness.link import LinkProxy
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.topology import TopologyConfig, ensure_topology
from rollfleet.runtime import faults
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Claim,
    EngineFailure,
    Names,
    RolloutJob,
    VersionConstraint,
    claim_key,
    encode,
)
from rollfleet.schemas.errors import Interrupted
from rollfleet.trainer_client import RolloutClient, answers
from rollfleet.workers.engines.echo import EchoEngine
from rollfleet.workers.job_claim import ClaimKeeper
from rollfleet.workers.job_runner import JobRunner, RunningJob
from rollfleet.workers.result_store import after_refusal, looked_up_first
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.worker_metrics import WorkerMetrics
from tests.helpers import payload


@pytest.mark.parametrize("policy", ["at_most_once", "replayable-turn", "exact"])
async def test_a_redelivery_that_claims_after_its_holder_answered_does_not_run_the_job(
    nc: nats.NATS, namespace: str, policy: str
) -> None:
    js, names = nc.jetstream(), Names(namespace)
    await ensure_topology(js, names, TopologyConfig(ack_wait_s=1.0))
    claims = await js.key_value(names.claims_bucket)
    engine = EchoEngine()
    runner = JobRunner(
        js, names, engine, worker_id="w1", limits=DEFAULT_LIMITS, ack_wait_s=1.0,
        max_message_bytes=1 << 20, metrics=WorkerMetrics("w1", "echo"), log=get_logger("test"),
        served=ServedVersion(0), claims=claims,
    )  # fmt: skip
    kind = "exact" if policy == "exact" else "min"
    job = RolloutJob(
        job_id="job-1", idempotency_key="k", client_id="c", constraint=VersionConstraint(kind, 0),
        payload=payload(), deadline=time.time() + 60, submitted_at=time.time(),
        retry_policy="at_most_once" if policy == "at_most_once" else "replayable",
        session_id="s" if policy == "replayable-turn" else None,
    )  # fmt: skip
    assert job.claimed
    # The redelivered job, as the broker hands it out (a real stored and fetched message).
    subject = names.job_subject(kind, 0)
    await js.publish(subject, encode(job))
    sub = await js.pull_subscribe(subject, durable=f"t-{policy}".replace("_", "-"), stream=names.jobs_stream)
    [msg] = await sub.fetch(1, timeout=5)
    # The first run answered and released its claim just after the redelivery looked for an answer.
    looks = 0
    real_answered = runner.results.answered

    async def answered_after_the_first_look(j: RolloutJob) -> bool:
        nonlocal looks
        looks += 1
        return False if looks == 1 else await real_answered(j)

    runner.results.answered = answered_after_the_first_look  # type: ignore[method-assign]
    await runner.results.store_failure("c", "k", EngineFailure("the first run's answer"), 1, job)
    await runner._serve(RunningJob(msg, job), 2, time.time(), get_logger("test"))
    assert looks == 2  # looked again once the claim was taken
    assert engine.prefill_tokens == 0, "the job was generated again"
    with pytest.raises((nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError)):
        await claims.get(claim_key(job.job_id))  # the claim taken for nothing is released
    with pytest.raises(nats.errors.TimeoutError):
        await sub.fetch(1, timeout=2.5)  # acked: never delivered again


async def test_an_at_most_once_holder_paused_past_its_claim_never_stores_an_answer_beside_interrupted(
    nc: nats.NATS, namespace: str
) -> None:
    """Campaign 10, seed 6803: a replica judged an at_most_once job's paused holder stopped and
    answered it ``Interrupted``; the holder woke, refreshed its claim before that answer's release
    and stored its own answer too (dropped by the broker as a duplicate), believing the job
    answered. The verdict must be written over the claim it judged, so the holder finds it gone."""
    js, names = nc.jetstream(), Names(namespace)
    await ensure_topology(js, names, TopologyConfig(ack_wait_s=0.3))
    kv = await js.key_value(names.claims_bucket)
    job = RolloutJob(
        job_id="job-2", idempotency_key="k2", client_id="c", constraint=VersionConstraint("min", 0),
        payload=payload(), deadline=time.time() + 60, submitted_at=time.time(), retry_policy="at_most_once",
    )  # fmt: skip
    subject = names.job_subject("min", 0)
    await js.publish(subject, encode(job))
    sub = await js.pull_subscribe(subject, durable="t-fence", stream=names.jobs_stream)
    [msg] = await sub.fetch(1, timeout=5)
    first, second = RunningJob(msg, job), RunningJob(msg, job)
    log = get_logger("test")
    holder = ClaimKeeper(kv, worker_id="w2", ack_wait_s=0.3, log=log, running=lambda: [first], abort=lambda r: None)
    taker = ClaimKeeper(kv, worker_id="w6", ack_wait_s=0.3, log=log, running=lambda: [second], abort=lambda r: None)
    assert await holder.claim(first) == "ok"
    await asyncio.sleep(holder.stale_s + 0.2)  # the holder is frozen: no refresh
    assert await taker.claim(second) == "stopped"  # (the taker answers Interrupted now)
    # The holder wakes with its generation done and asks whether it may store its answer.
    assert not await holder.still_holds(first)
    assert first.claim_lost


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("policy", ["replayable-turn", "at_most_once"])
async def test_a_holder_cut_off_one_way_never_keeps_a_job_a_taker_took(
    broker: EmbeddedBroker, nc: nats.NATS, namespace: str, direction: str, policy: str
) -> None:
    """Campaign 1, seed 24769: a turn's holder whose link to the broker stalled upward (it still
    received) finished generating and asked, refresh after refresh, whether it still held its
    claim; its writes waited in the stalled direction while the moved copy's taker watched the
    claim stand still. Whichever way one link stalls, once a taker has judged the claim (taken a
    replayable turn over, or marked an at_most_once job's claim stopped), the holder's writes
    that land late (up) or whose answers never come back (down) keep nothing: it learns the claim
    is gone when the link heals and stores no answer."""
    js, names = nc.jetstream(), Names(namespace)
    await ensure_topology(js, names, TopologyConfig(ack_wait_s=0.3))
    link = await LinkProxy("127.0.0.1", broker.port).start()
    cut_off = await nats.connect(f"nats://127.0.0.1:{link.port}")
    stalled: asyncio.Future[None] | None = None
    try:
        job = RolloutJob(
            job_id=f"job-{direction}", idempotency_key=f"k-{direction}", client_id="c",
            constraint=VersionConstraint("min", 0), payload=payload(), deadline=time.time() + 120,
            submitted_at=time.time(), retry_policy="replayable" if policy == "replayable-turn" else "at_most_once",
            session_id="s" if policy == "replayable-turn" else None,
        )  # fmt: skip
        subject = names.job_subject("min", 0)
        await js.publish(subject, encode(job))
        sub = await js.pull_subscribe(subject, durable="t-one-way", stream=names.jobs_stream)
        [msg] = await sub.fetch(1, timeout=5)
        first, second = RunningJob(msg, job), RunningJob(msg, job)
        log = get_logger("test")
        holder = ClaimKeeper(
            await cut_off.jetstream().key_value(names.claims_bucket), worker_id="w2", ack_wait_s=0.3, log=log,
            running=lambda: [first], abort=lambda r: None,
        )  # fmt: skip
        kv = await js.key_value(names.claims_bucket)
        taker = ClaimKeeper(kv, worker_id="w3", ack_wait_s=0.3, log=log, running=lambda: [second], abort=lambda r: None)
        assert await holder.claim(first) == "ok"
        stalled = asyncio.ensure_future(link.stall(direction, 3600.0))
        await asyncio.sleep(0.05)
        # Its generation done, the holder asks whether it may store its answer (as w2 did).
        asking = asyncio.ensure_future(holder.still_holds(first))
        # The taker judges the claim by its own rules: it may look while the claim is still fresh
        # ("held") or give up on a look the load made slow; it looks again until it has a verdict.
        verdict, until = "held", time.monotonic() + 60
        while verdict != "stopped" and time.monotonic() < until:
            verdict = await taker.claim(second)
            if verdict != "stopped":
                await asyncio.sleep(0.2)
        assert verdict == "stopped"
        assert not asking.done()  # the holder heard nothing yet either way
        stalled.cancel()  # the link heals: what waited goes through, answers come back
        with contextlib.suppress(asyncio.CancelledError):
            await stalled
        assert not await asyncio.wait_for(asking, 30)
        assert first.claim_lost
        entry = await kv.get(claim_key(job.job_id))
        claim = Claim.decode(entry.value)
        if policy == "replayable-turn":
            assert claim.holder == taker.holder and not claim.stopped  # the taker's, as it wrote it
        else:
            assert claim.stopped  # marked: nobody runs it again, the taker answers Interrupted
    finally:
        if stalled is not None:
            stalled.cancel()
        await cut_off.close()
        await link.close()


async def test_a_holder_whose_claim_is_taken_while_it_stores_its_answer_stores_no_second_one(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A run checks its claim a last time, then stops before storing its answer (a process frozen
    there: ``worker:before-result-store``); meanwhile another replica judges it gone and answers
    the at_most_once job ``Interrupted``. Woken past the broker's duplicate window, the first run
    stored its own answer beside it: two answers to one job. Its store is refused now."""
    topology = TopologyConfig(ack_wait_s=1.0, duplicate_window_s=1.0)
    release, log_a = tmp_path / "release", tmp_path / "a.log"
    pause = faults.env("pause", "worker:before-result-store", release)
    a = start_worker_process(nats_url, namespace, "a", "--ack-wait", "1.0", log_path=log_a, env=pause)
    b = None
    try:
        client = await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topology)
        async with client:
            await wait_until(lambda: client.fleet.replica("a") is not None, timeout=20, what="replica a")
            handle = await client.submit(
                payload(max_tokens=8), min_version=0, retry_policy="at_most_once", idempotency_key="k", timeout=60
            )
            await wait_until(
                lambda: "PAUSED worker:before-result-store" in log_a.read_text(), timeout=20, what="a paused"
            )
            b = start_worker_process(nats_url, namespace, "b", "--ack-wait", "1.0", log_path=tmp_path / "b.log")
            with pytest.raises(Interrupted):  # b judged a gone and answered the job
                await handle.result(40)
            # Past the duplicate window, the answer's message id no longer hides a second answer.
            await asyncio.sleep(topology.duplicate_window_s + 0.5)
            woken = time.time()
            release.touch()

            def a_idle_again() -> bool:
                entry = client.fleet.replica("a")
                return entry is not None and entry.heartbeat_at > woken and entry.in_flight == 0

            await wait_until(a_idle_again, timeout=30, what="a done with the job after waking")
            stored = [o async for _, o in answers.stored(client.js, client.names, "c", "k")]
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)
    assert [type(o).__name__ for o in stored] == ["RolloutFailure"], stored
    assert stored[0].code == "interrupted" and stored[0].worker_id == "b"  # type: ignore[union-attr]


def test_a_delivery_is_looked_up_among_its_answers_when_it_may_be_a_copy_of_an_answered_job() -> None:
    assert not looked_up_first(attempt=1, claimed=False, keyed=False)  # a keyless job, stored once
    assert looked_up_first(attempt=1, claimed=False, keyed=True)  # a key asked again past the window
    assert looked_up_first(attempt=2, claimed=False, keyed=False)  # its holder may have died after storing
    assert looked_up_first(attempt=1, claimed=True, keyed=False)  # a moved turn: the same job, a new message


def test_a_refused_store_is_read_from_what_the_job_has_stored() -> None:
    assert after_refusal(b"head-1", b"head-1") == "stored"  # an earlier try of this store, its ack lost
    assert after_refusal(b"head-2", b"head-1") == "answered"  # another run's answer came first
    assert after_refusal(None, b"head-1") == "unstored"  # nothing readable: the redelivery decides


async def test_a_run_that_lost_its_claim_releases_nothing_of_the_taker(nc: nats.NATS, namespace: str) -> None:
    """A holder frozen past its claim's staleness; another replica takes the replayable exact job
    over and runs it. The first run ends (its answer stored or refused) and releases: the taker's
    claim stays (it was deleted, and the taker, finding it gone, stopped and answered nothing)."""
    js, names = nc.jetstream(), Names(namespace)
    await ensure_topology(js, names, TopologyConfig(ack_wait_s=0.3))
    kv = await js.key_value(names.claims_bucket)
    job = RolloutJob(
        job_id="job-3", idempotency_key="k3", client_id="c", constraint=VersionConstraint("exact", 0),
        payload=payload(), deadline=time.time() + 60, submitted_at=time.time(), retry_policy="replayable",
    )  # fmt: skip
    subject = names.job_subject("exact", 0)
    await js.publish(subject, encode(job))
    sub = await js.pull_subscribe(subject, durable="t-release", stream=names.jobs_stream)
    [msg] = await sub.fetch(1, timeout=5)
    first, second = RunningJob(msg, job), RunningJob(msg, job)
    log = get_logger("test")
    holder = ClaimKeeper(kv, worker_id="w1", ack_wait_s=0.3, log=log, running=lambda: [first], abort=lambda r: None)
    taker = ClaimKeeper(kv, worker_id="w2", ack_wait_s=0.3, log=log, running=lambda: [second], abort=lambda r: None)
    assert await holder.claim(first) == "ok"
    await asyncio.sleep(holder.stale_s + 0.2)  # the holder is frozen: no refresh
    assert await taker.claim(second) == "stopped" and second.took_over  # the taker runs it now
    await holder.release(job, first.claim_revision)
    entry = await kv.get(claim_key(job.job_id))
    assert Claim.decode(entry.value).holder == taker.holder
    await taker.release(job, second.claim_revision)  # the taker's own release does delete it
    with pytest.raises((nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError)):
        await kv.get(claim_key(job.job_id))
