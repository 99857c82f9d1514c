"""The README's central promise under an outside look: a request is never served outside its
constraint, and it is answered once, with typed errors, whatever the schedule of activations.

Every test here runs real workers following a real policy store on a real nats-server; the
echo engine's per-token latency makes a job long enough for an activation to land in it.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest

from harness import ProcessGroup, running_worker, tensors_at, wait_until, write_base_checkpoint
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams, served_within
from rollfleet.schemas.errors import Expired, NoCompatibleReplica, RollfleetError
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.workers.engines.echo import EchoEngine


def long_job(tokens: int) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=tokens))


def spans(result: RolloutResult) -> list[tuple[int, int, int]]:
    return [(w.version, w.start, w.end) for w in result.outputs[0].weight_versions]


def follower(tmp_path: Path, name: str, **config: Any) -> dict[str, Any]:
    """Worker settings for a replica that follows ``tmp_path/store``."""
    return {"store_dir": tmp_path / "store", "local_dir": tmp_path / f"local-{name}", "worker_id": name, **config}


class SlowLoadEcho(EchoEngine):
    """An echo engine whose weight load takes as long as SGLang's reload of a real model."""

    def __init__(self, load_s: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.load_s = load_s
        self.paused = False

    async def pause(self) -> None:
        self.paused = True
        await super().pause()

    async def load_weights(self, checkpoint_dir: Path | None, changed: Any, version: int) -> None:
        await asyncio.sleep(self.load_s)
        await super().load_weights(checkpoint_dir, changed, version)

    async def resume(self) -> None:
        self.paused = False
        await super().resume()


@pytest.fixture
def publisher(tmp_path: Path) -> PolicyPublisher:
    return PolicyPublisher(tmp_path / "store", write_base_checkpoint(tmp_path / "base"), keep_last=None)


async def test_exact_job_spanning_an_activation_runs_entirely_at_its_version(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        engine = EchoEngine(per_token_s=0.04)
        async with running_worker(nats_url, namespace, engine=engine, **follower(tmp_path, "a")) as worker:
            exact = await client.submit(long_job(40), exact_version=0)  # ~1.6 s
            loose = await client.submit(long_job(100), min_version=0)  # ~4 s: outlives the activation
            assert worker.jobs is not None
            await wait_until(lambda: len(worker.jobs.running) == 2, 10)
            await client.publish_policy(publisher, tensors_at(1))
            pinned, spanning = await exact.result(30), await loose.result(30)
            await client.wait_for_version(1, timeout=20)
            assert worker.sync is not None
            activation = worker.sync.activations[-1]
    assert (pinned.version_start, pinned.version_end) == (0, 0)
    assert spans(pinned) == [(0, 0, 40)]
    # The activation waited for the exact job (and said so), then landed inside the loose one.
    assert activation.version == 1 and activation.drain_s > 0.3 and activation.handed_back == 0
    assert spanning.version_start == 0 and spanning.version_end == 1
    (v0, s0, e0), (v1, s1, e1) = spans(spanning)
    assert (v0, s0, v1, e1) == (0, 0, 1, 100) and e0 == s1


@pytest.mark.parametrize("policy", ["replayable", "at_most_once"])
async def test_exact_job_past_the_drain_bound_is_handed_back_and_served_at_its_version(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher, policy: str
) -> None:
    """A replica that must activate stops waiting after its bound: it aborts the exact job and hands
    it back unanswered; another replica at that version serves it whole, and an at_most_once job
    handed back this way was never answered, so it runs normally instead of being Interrupted."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        slow = EchoEngine(per_token_s=0.05)
        async with running_worker(nats_url, namespace, engine=slow, **follower(tmp_path, "a", exact_drain_s=0.3)) as a:
            handle = await client.submit(long_job(200), exact_version=0, retry_policy=policy, timeout=60)
            assert a.jobs is not None
            await wait_until(lambda: len(a.jobs.running) == 1, 10)
            async with running_worker(nats_url, namespace, version=0, worker_id="b") as b:
                await client.publish_policy(publisher, tensors_at(1))
                result = await handle.result(30)
                assert a.sync is not None
                await wait_until(lambda: a.version == 1, 10)
                assert a.sync.activations[-1].handed_back == 1
                assert a.outcomes.get("handed_back", 0) >= 1
                await wait_until(lambda: b.jobs_done == 1, 5)  # counted once the job is acked, after the answer
    assert result.worker_id == "b" and result.delivery_attempt >= 2
    assert spans(result) == [(0, 0, 200)]


async def test_exact_job_submitted_during_a_slow_pause_is_never_served_at_the_new_version(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", fail_fast=False) as client:
        await client.publish_policy(publisher, tensors_at(0))
        engine = SlowLoadEcho(load_s=2.0)
        async with running_worker(nats_url, namespace, engine=engine, **follower(tmp_path, "a")) as worker:
            await client.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: engine.paused, 10)
            late = await client.submit(long_job(4), exact_version=0, timeout=4)
            loose = await client.submit(long_job(4), min_version=0, timeout=10)
            with pytest.raises(Expired):  # nobody serves version 0 any more: never a v1 answer
                await late.result(15)
            served = await loose.result(15)
            assert worker.version == 1
    assert served.version_start == served.version_end == 1


async def test_at_most_once_jobs_handed_back_unrun_are_served_not_interrupted(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """A replica that moved on still has a pull request waiting on exact-0 (its cancel lost the
    race with deliveries; simulated by a cancel that never reaches the broker): the jobs it
    receives there it hands back unrun, and the replica at 0 serves every one of them."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", fail_fast=False) as client:
        await client.publish_policy(publisher, tensors_at(0))
        # Pull requests wait 10 s at the broker, so a's request on exact-0 outlives its activation.
        async with running_worker(nats_url, namespace, **follower(tmp_path, "a", wait_pull_s=10.0)) as a:
            await (await client.submit(long_job(3), exact_version=0)).result(10)  # exact-0 exists, and is hot
            await wait_until(lambda: (p := a.pulling._pullers.get(("exact", 0))) is not None and p.busy, 10)
            stale = a.pulling._pullers[("exact", 0)]

            async def lost() -> None:
                return None

            stale.cancel = stale.close = lost  # type: ignore[method-assign]
            await client.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: a.version == 1, 10)
            handles = [
                await client.submit(long_job(3), exact_version=0, retry_policy="at_most_once", timeout=30)
                for _ in range(4)
            ]
            await wait_until(lambda: a.outcomes.get("handed_back", 0) >= 1, 10)
            async with running_worker(nats_url, namespace, version=0, worker_id="b"):
                results = [await h.result(20) for h in handles]
    assert all(r.worker_id == "b" and r.version_start == r.version_end == 0 for r in results)
    assert max(r.delivery_attempt for r in results) >= 2


@pytest.mark.parametrize("seed", [11, 12])
async def test_randomized_schedule_never_serves_outside_a_constraint(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher, seed: int
) -> None:
    """Publications interleaved with min, exact and staleness jobs of random lengths on two real
    workers with different drain bounds: every answer satisfies its constraint token by token;
    everything else is a typed, retryable error."""
    rng = random.Random(seed)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        fast = EchoEngine(per_token_s=0.01)
        slow = EchoEngine(per_token_s=0.02)
        async with (
            running_worker(nats_url, namespace, engine=fast, **follower(tmp_path, "a", exact_drain_s=0.2)),
            running_worker(nats_url, namespace, engine=slow, **follower(tmp_path, "b", exact_drain_s=5.0)),
        ):
            await client.wait_for_version(0, replicas=2, timeout=20)
            handles = []
            for _ in range(40):
                roll = rng.random()
                latest = client.latest_version or 0
                if roll < 0.15 and latest < 5:
                    await client.publish_policy(publisher, tensors_at(latest + 1))
                    continue
                job = long_job(rng.randint(5, 80))
                if roll < 0.45:
                    kw: dict[str, Any] = {"exact_version": max(0, latest - rng.randint(0, 1))}
                elif roll < 0.75:
                    kw = {"min_version": rng.randint(0, latest)}
                else:
                    kw = {"max_staleness": rng.randint(0, 2)}
                handles.append(await client.submit(job, timeout=20, **kw))
                await asyncio.sleep(rng.random() * 0.15)
            outcomes = await asyncio.gather(*(h.result(40) for h in handles), return_exceptions=True)
    served = 0
    for handle, outcome in zip(handles, outcomes, strict=True):
        if isinstance(outcome, RolloutResult):
            served += 1
            assert served_within(handle.job.constraint, outcome), (handle.job.constraint, spans(outcome))
            assert sum(e - s for _, s, e in spans(outcome)) == len(outcome.outputs[0].token_ids)
        else:
            assert isinstance(outcome, (Expired, NoCompatibleReplica)), repr(outcome)
            assert isinstance(outcome, RollfleetError) and outcome.retryable
    assert served >= len(handles) // 2, f"only {served}/{len(handles)} served: the schedule tested little"


async def test_an_exact_job_no_replica_will_serve_fails_fast_instead_of_waiting_for_its_deadline(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """The only replica is busy, so an exact-0 job waits in the queue; then the replica moves to
    version 1. Nobody will ever serve that job: the client withdraws it and says so within seconds."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        engine = EchoEngine(per_token_s=0.02)
        async with running_worker(nats_url, namespace, engine=engine, capacity=1, **follower(tmp_path, "a")) as w:
            busy = await client.submit(long_job(60), min_version=0)  # ~1.2 s, holds the only slot
            assert w.jobs is not None
            await wait_until(lambda: len(w.jobs.running) == 1, 10)
            queued = await client.submit(long_job(3), exact_version=0, timeout=60)
            await client.publish_policy(publisher, tensors_at(1))
            with pytest.raises(NoCompatibleReplica):  # (within 30 s: not at its 60 s deadline)
                await queued.result(30)
            assert (await busy.result(10)).version_start == 0
            assert queued.stream_seq is not None
            with pytest.raises(nats.js.errors.NotFoundError):  # withdrawn: no worker will find it later
                await client.js.get_msg(client.names.jobs_stream, queued.stream_seq)


async def test_an_exact_job_handed_back_at_the_drain_bound_is_withdrawn_within_seconds(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """The only replica at v0 hands back a running exact-0 job at its drain bound and activates v1:
    nobody will ever serve the job, so it is withdrawn and answered NoCompatibleReplica within
    seconds, not at its deadline."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        slow = EchoEngine(per_token_s=0.05)
        async with running_worker(nats_url, namespace, engine=slow, **follower(tmp_path, "a", exact_drain_s=0.5)) as a:
            handle = await client.submit(long_job(400), exact_version=0, timeout=120)
            assert a.jobs is not None
            await wait_until(lambda: len(a.jobs.running) == 1, 10)
            await client.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: a.version == 1, 20)
            with pytest.raises(NoCompatibleReplica):  # (within 30 s: not at its 120 s deadline)
                await handle.result(30)


async def test_an_exact_job_whose_caller_waits_is_kept_when_its_replica_moves_on_and_served_later(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """As above, but the caller chose to wait for a replica (``wait_for_replica=True``) while one at
    v0 could still serve it: when that one moves on the job is not withdrawn (it was, 2 s later,
    answered NoCompatibleReplica); a replica started at v0 serves it within its deadline."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        slow = EchoEngine(per_token_s=0.05)
        async with running_worker(nats_url, namespace, engine=slow, **follower(tmp_path, "a", exact_drain_s=0.5)) as a:
            handle = await client.submit(long_job(400), exact_version=0, timeout=120, wait_for_replica=True)
            assert a.jobs is not None
            await wait_until(lambda: len(a.jobs.running) == 1, 10)
            await client.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: a.version == 1, 20)
            await asyncio.sleep(3 * 2.0)  # (three orphan graces: it was withdrawn after one)
            assert not handle.done()
            held = {"store_dir": tmp_path / "store", "local_dir": tmp_path / "local-held", "worker_id": "held"}
            async with running_worker(nats_url, namespace, hold_version=0, **held):
                result = await handle.result(60)
        assert (result.worker_id, result.version_start, result.version_end) == ("held", 0, 0)


async def test_a_min_job_at_the_newest_version_waits_while_the_follower_still_loads_an_older_one(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """The only replica follows ``latest`` and spends 6 s loading v1 when v2 is committed: no
    replica shows v2 yet, but this one will reach it. A ``min_version=2`` job is queued and served
    at v2, not refused NoCompatibleReplica at once (as it was)."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        slow = SlowLoadEcho(load_s=6.0)
        async with running_worker(nats_url, namespace, engine=slow, **follower(tmp_path, "a")) as a:
            await client.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: slow.paused, 10, what="v1 loading")
            await client.publish_policy(publisher, tensors_at(2))
            assert a.version == 0
            handle = await client.submit(long_job(4), min_version=2, timeout=60)
            result = await handle.result(60)
        assert (result.worker_id, result.version_start) == ("a", 2)


async def test_an_exact_job_handed_back_while_its_replica_still_activates_is_withdrawn_within_seconds(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """The only replica at v0 hands back a running exact-0 job at its drain bound, then spends
    10 s loading v1: it is 'activating' at v0 all along, holding nothing. Nobody will ever serve
    the job: it is withdrawn within seconds, not once the load is done."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        slow = SlowLoadEcho(load_s=10.0, per_token_s=0.05)
        async with running_worker(nats_url, namespace, engine=slow, **follower(tmp_path, "a", exact_drain_s=0.5)) as a:
            handle = await client.submit(long_job(400), exact_version=0, timeout=120)
            assert a.jobs is not None
            await wait_until(lambda: len(a.jobs.running) == 1, 10)
            await client.publish_policy(publisher, tensors_at(1))
            with pytest.raises(NoCompatibleReplica):
                await handle.result(30)
            # Withdrawn while the replica still loads (10 s), not once the load is done.
            status = client.fleet.replica("a")
            assert status is not None and (status.state, status.active_version) == ("activating", 0)


@pytest.mark.parametrize("retry_policy", ["replayable", "at_most_once"])
async def test_an_exact_job_no_draining_replica_took_is_withdrawn_within_seconds(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher, retry_policy: str
) -> None:
    """Two busy replicas at v0; an exact-0 job waits in the queue. Replica a is stopped (SIGTERM:
    it drains, finishing its own long job at v0 for seconds more) and b moves to v1. A draining
    replica takes nothing new, so nobody will ever serve the queued job: it is withdrawn and
    answered NoCompatibleReplica within seconds, not after a's drain or at its deadline. a still
    finishes what it held."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        a_ctx = running_worker(nats_url, namespace, engine=EchoEngine(per_token_s=0.05), capacity=1, worker_id="a")
        a = await a_ctx.__aenter__()
        stopping = None
        try:
            b_engine = EchoEngine(per_token_s=0.02)
            async with running_worker(nats_url, namespace, engine=b_engine, capacity=1, **follower(tmp_path, "b")) as b:
                await wait_until(lambda: len(client.fleet.replicas()) == 2)
                held = [await client.submit(long_job(300), min_version=0) for _ in range(2)]  # a: 15 s, b: 6 s
                assert a.jobs is not None and b.jobs is not None
                await wait_until(lambda: len(a.jobs.running) == 1 and len(b.jobs.running) == 1, 10)
                queued = await client.submit(long_job(3), exact_version=0, timeout=60, retry_policy=retry_policy)  # type: ignore[arg-type]
                stopping = asyncio.ensure_future(a.stop())
                await wait_until(lambda: (r := client.fleet.replica("a")) is not None and r.state == "draining", 10)
                await client.publish_policy(publisher, tensors_at(1))
                await wait_until(lambda: b.version == 1, 20)
                with pytest.raises(NoCompatibleReplica):
                    await queued.result(60)
                # Withdrawn while a still drains its own 15 s job: not after it, nor at the deadline.
                draining = client.fleet.replica("a")
                assert draining is not None and draining.state == "draining"
                # (a's 300 tokens at 0.05 s are 15 s unloaded; 30 s was too short under load: run I)
                results = [await h.result(90) for h in held]
        finally:
            if stopping is not None:
                await stopping
            await a_ctx.__aexit__(None, None, None)
    assert sorted(r.worker_id for r in results) == ["a", "b"]


async def test_an_exact_job_whose_replica_is_killed_mid_drain_is_withdrawn_within_seconds(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """The replica draining an exact-0 job before activating v1 is SIGKILLed: its registry entry
    still says it is at v0 (for three heartbeats), but it answers no probe; the job, which no
    live replica can serve, is withdrawn and answered NoCompatibleReplica within seconds."""
    group = ProcessGroup(tmp_path)
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await client.publish_policy(publisher, tensors_at(0))
            store, local = str(tmp_path / "store"), str(tmp_path / "local-a")
            group.worker(
                nats_url, namespace, "a", "--store", store, "--local-dir", local, "--echo-token-latency", "0.05",
                "--heartbeat", "5",
            )
            await client.wait_for_version(0, replicas=1, timeout=30)
            handle = await client.submit(long_job(600), exact_version=0, timeout=120)
            await asyncio.sleep(1.0)
            await client.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: (r := client.fleet.replica("a")) is not None and r.state == "activating", 20)
            group.kill("a")
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(NoCompatibleReplica):
                await handle.result(60)
            assert asyncio.get_running_loop().time() - t0 < 10.0
    finally:
        group.close()
