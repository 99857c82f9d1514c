"""The rollout loop (``trainer_client.loop``): its rules as pure functions (milliseconds, the
admission bound as a property), then the loop against real workers on a real broker: every
consumed group within the staleness bound by the tokens themselves (recomputed from the
trainer's own bytes, not the labels), groups whole or failed whole, tails cancelled at once,
worker SIGKILLs losing no group, and the loop's counters agreeing with what it yielded."""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reliability.adversary.truth import recompute, tensors_key
from rollfleet.broker.topology import TopologyConfig
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.testing import ProcessGroup, running_worker, wait_until
from rollfleet.testing.weights import tensors_at, write_base_checkpoint
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.trainer_client import loop_rules as rules
from rollfleet.trainer_client.loop import Batch, Group, LoopConfig, RolloutLoop
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import CountingEcho

# -- the rules, pure -----------------------------------------------------------------------


def test_admission_room_is_the_bound_less_what_is_accepted_or_in_flight() -> None:
    for steps in range(4):
        for eta in range(3):
            for b in (1, 2, 5):
                bound = (steps + eta + 1) * b
                for accepted in range(bound + 3):
                    for flying in range(bound + 3):
                        room = rules.admission_room(
                            steps=steps, max_staleness=eta, batch_groups=b, accepted=accepted, in_flight=flying
                        )
                        assert room == max(0, bound - accepted - flying)
    assert rules.admission_room(steps=0, max_staleness=1, batch_groups=4, accepted=0, in_flight=0, oversample=2) == 10
    capped = rules.admission_room(steps=9, max_staleness=1, batch_groups=4, accepted=0, in_flight=3, max_in_flight=5)
    assert capped == 2


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 5),
    eta=st.integers(0, 3),
    steps=st.integers(1, 12),
    finishing=st.lists(st.integers(0, 9), min_size=1, max_size=40),
)
def test_admitting_by_the_bound_never_yields_a_stale_group_when_groups_finish_in_order(
    batch: int, eta: int, steps: int, finishing: list[int]
) -> None:
    """A simulated trainer: each tick admits what the rule allows at the current version, some
    groups finish (in admission order, any number per tick), and the trainer trains a batch
    whenever one is ready (then commits a version). Every consumed group was admitted at most
    ``eta`` versions before the version it is consumed at: the bound alone keeps it fresh."""
    version, admitted_at, in_flight, ready, accepted, consumed = 0, [], [], [], 0, 0
    tick = 0
    while consumed < steps * batch and tick < 10_000:
        room = rules.admission_room(
            steps=version, max_staleness=eta, batch_groups=batch, accepted=accepted, in_flight=len(in_flight)
        )
        for _ in range(room):
            admitted_at.append(version)
            in_flight.append(len(admitted_at) - 1)
        done = min(len(in_flight), max(1, finishing[tick % len(finishing)]))
        for _ in range(done):
            ready.append(in_flight.pop(0))
            accepted += 1
        while len(ready) >= batch:
            taken, ready = ready[:batch], ready[batch:]
            assert all(version - admitted_at[g] <= eta for g in taken), (version, [admitted_at[g] for g in taken])
            consumed += batch
            version += 1
        tick += 1
    assert consumed >= steps * batch


def test_staleness_is_measured_from_the_oldest_token_and_judged_by_policy() -> None:
    assert rules.staleness(5, [4, 3, 5]) == 2
    assert rules.staleness(2, [3]) == 0  # a replica ahead of the trainer's view
    assert not rules.too_stale(5, [4], 1) and rules.too_stale(5, [3], 1)
    assert [rules.on_stale(p) for p in ("drop", "requeue", "keep")] == ["drop", "requeue", "train"]


def test_new_groups_ask_for_the_latest_version_once_a_replica_serves_it() -> None:
    args = {"latest": 7, "first": 5, "max_staleness": 3}
    assert rules.submit_floor(**args, fresh_served=True, waited_s=99.0, grace_s=30.0) == 7
    assert rules.submit_floor(**args, fresh_served=False, waited_s=29.9, grace_s=30.0) is None  # wait
    assert rules.submit_floor(**args, fresh_served=False, waited_s=30.0, grace_s=30.0) == 5  # never below first


def test_the_group_closest_to_going_stale_is_consumed_first() -> None:
    assert rules.next_to_consume([5, 3, 4, 3]) == 1  # the oldest, the earliest completed of equals
    assert rules.next_to_consume([7]) == 0
    assert rules.judged_starts([2, 3], None) == [2, 3] and rules.judged_starts([2, 3], 5) == [5]
    # Stopped and continued once the next batch could not take it (the one at `latest` may be gone).
    assert [rules.must_continue(3, latest, 1) for latest in (3, 4, 5)] == [False, True, True]
    assert [rules.must_continue(3, latest, 0) for latest in (3, 4)] == [False, True]
    assert [rules.must_continue(3, latest, 2) for latest in (4, 5)] == [False, True]


def test_dynamic_sampling_filters_only_groups_without_signal() -> None:
    assert rules.uninformative([1.0, 1.0, 1.0]) and rules.uninformative([0.0])
    assert not rules.uninformative([0.0, 1.0]) and not rules.uninformative([])


def test_tails_are_groups_a_whole_batch_overtook_oldest_first() -> None:
    assert rules.tails([0, 1, 7, 9], [5, 6, 8], oversample=5) == [0, 1]
    assert rules.tails([3, 0, 1], [5, 6], oversample=2) == [0, 1]
    assert rules.tails([0, 1], [5, 6], oversample=0) == []
    assert rules.tails([7], [5, 6], oversample=3) == []  # admitted after the batch's first: not overtaken


def test_what_becomes_of_a_group_that_did_not_complete() -> None:
    assert rules.on_failure("requeue", "failed", 1, 3) == ("requeue", 1)
    assert rules.on_failure("requeue", "deadline", 3, 3) == ("report", 3)
    assert rules.on_failure("report", "failed", 1, 3) == ("report", 1)
    assert rules.on_failure("report", "tail", 2, 3) == ("requeue", 1)  # a tail's try does not count
    assert rules.on_failure("requeue", "closed", 1, 3)[0] == "forget"
    assert rules.past_deadline(0.0, 2.5, 2.0) and not rules.past_deadline(0.0, 1.5, 2.0)
    assert not rules.past_deadline(0.0, 1e9, None)
    assert rules.utilization([1, 2], [2, 2]) == 0.75 and rules.utilization([], []) is None


def test_a_bad_config_is_a_typed_error() -> None:
    for bad in ({"group_size": 0}, {"batch_groups": "2"}, {"max_staleness": -1}, {"stale": "later"}):
        with pytest.raises(InvalidRequest):
            LoopConfig(**bad)  # type: ignore[arg-type]


# -- the loop against real workers -----------------------------------------------------------


async def _prompts(count: int | None = None, start: int = 100) -> AsyncIterator[list[int]]:
    i = 0
    while count is None or i < count:
        yield [start + i, 7, 11]
        i += 1


def _identity_holds(loop: RolloutLoop, yielded: int) -> None:
    """The loop's counters agree with what it yielded and what it still holds: every admitted
    group completed, was filtered, failed, was cancelled, or is still in flight; every completed
    one was yielded, dropped as stale, or is still waiting in the buffer."""
    t = loop.totals
    not_completed = sum(t[f"waste_groups_{c}"] for c in ("tail", "filtered", "failed", "deadline", "closed"))
    assert t["admitted"] == t["completed"] + not_completed + loop.in_flight, dict(t)
    assert t["completed"] == yielded + t["waste_groups_stale"] + loop.ready, dict(t)
    assert t["groups"] == yielded


@pytest.fixture
def publisher(tmp_path: Path) -> PolicyPublisher:
    return PolicyPublisher(tmp_path / "store", write_base_checkpoint(tmp_path / "base"), keep_last=None)


async def test_consumed_groups_stay_within_the_bound_by_their_own_tokens(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """Two keyed replicas follow the store while the trainer commits a version per batch. Every
    token of every consumed group is recomputed from the trainer's bytes of the version its span
    names (a wrong label would show), and the staleness those spans give never exceeds the bound."""
    cfg = LoopConfig(group_size=3, batch_groups=3, max_staleness=1, sampling=SamplingParams(max_tokens=8))
    batches: list[Batch] = []
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        replicas = [
            running_worker(
                nats_url, namespace, engine=EchoEngine(per_token_s=0.01, keyed=True), worker_id=name, capacity=2,
                store_dir=tmp_path / "store", local_dir=tmp_path / f"local-{name}",
            )
            for name in ("a", "b")
        ]  # fmt: skip
        async with replicas[0], replicas[1]:
            await client.wait_for_version(0, replicas=2, timeout=30)
            async with RolloutLoop(client, _prompts(), cfg) as loop:
                async for batch in loop.batches(steps=5):
                    batches.append(batch)
                    await client.publish_policy(publisher, tensors_at(batch.version + 1))
                _identity_holds(loop, sum(len(b.groups) for b in batches))
                trained = client.metrics.registry.get_sample_value(
                    "rollfleet_loop_trained_tokens_total", {"client_id": "t"}
                )
                assert trained == loop.totals["tokens"] == sum(b.stats.tokens for b in batches)
    keys: dict[int, bytes] = {}

    def key_of(v: int) -> bytes:
        return keys.setdefault(v, tensors_key(tensors_at(v)))

    assert len(batches) == 5
    for batch in batches:
        assert len(batch.groups) == cfg.batch_groups and batch.stats.tokens == sum(g.tokens for g in batch.groups)
        for g in batch.groups:
            assert len(g.samples) == cfg.group_size
            verdict = recompute(
                key_of,
                g.payload.prompt_token_ids or [],
                [s.tokens for s in g.samples],
                [[(sp.version, sp.start, sp.end) for sp in s.spans] for s in g.samples],
                seed=None,
            )
            assert verdict.checked == g.tokens and not verdict.mismatches, verdict.mismatches
            assert batch.version - min(sp.version for s in g.samples for sp in s.spans) <= cfg.max_staleness
    assert max(b.version for b in batches) >= 4  # five versions were consumed at


@pytest.mark.parametrize("stale", ["drop", "requeue", "keep"])
async def test_groups_gone_stale_are_judged_by_their_tokens_and_the_policy(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher, stale: str
) -> None:
    """``max_staleness=0`` and a trainer that commits two versions per batch: groups made before
    the second commit go stale in the buffer. By the versions their tokens were recomputed
    from, ``drop`` and ``requeue`` hand out none of them (and count them as waste; ``requeue``
    also sends their prompts back), while ``keep`` hands them out with their true staleness."""
    cfg = LoopConfig(
        group_size=2,
        batch_groups=2,
        max_staleness=0,
        stale=stale,
        sampling=SamplingParams(max_tokens=8),  # type: ignore[arg-type]
    )
    batches: list[Batch] = []
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with running_worker(
            nats_url, namespace, engine=EchoEngine(per_token_s=0.01, keyed=True), worker_id="a", capacity=4,
            store_dir=tmp_path / "store", local_dir=tmp_path / "local-a",
        ):  # fmt: skip
            await client.wait_for_version(0, replicas=1, timeout=30)
            async with RolloutLoop(client, _prompts(), cfg) as loop:
                async for batch in loop.batches(steps=5):
                    batches.append(batch)
                    for _ in range(2):
                        await client.publish_policy(publisher, tensors_at(client.latest_version + 1))
                _identity_holds(loop, sum(len(b.groups) for b in batches))
    stalenesses = []
    for batch in batches:
        for g in batch.groups:
            served = [_true_versions(g, i) for i in range(len(g.samples))]
            truth = batch.version - min(min(v) for v in served)
            assert g.staleness == truth
            stalenesses.append(truth)
    if stale == "keep":
        assert max(stalenesses) > 0 and loop.totals["waste_groups_stale"] == 0
    else:
        assert max(stalenesses) == 0 and loop.totals["waste_groups_stale"] > 0
        assert (loop.totals["requeued"] > 0) == (stale == "requeue")


def _true_versions(group: Group, sample: int) -> list[int]:
    """The versions whose bytes (the trainer's own) make each span of ``sample``'s tokens."""
    s = group.samples[sample]
    found = []
    for span in s.spans:
        for v in range(span.version + 3):
            single = recompute(
                lambda _v, v=v: tensors_key(tensors_at(v)),
                group.payload.prompt_token_ids or [],
                [s.tokens if i == sample else [] for i in range(len(group.samples))],
                [[(v, span.start, span.end)] if i == sample else [] for i in range(len(group.samples))],
                seed=None,
            )
            if not single.mismatches:
                found.append(v)
                break
        else:
            raise AssertionError(f"no version makes span {span} of sample {sample}")
    return found


async def test_a_partial_rollout_continues_at_the_new_version_with_spans_tiling_both(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """``partial_rollout`` and ``max_staleness=0``: a group of two 100-token samples is still
    generating when the trainer commits version 1. The loop stops it and continues each sample
    at version 1 from its tokens so far: every sample has all its 100 tokens, spans that tile
    them with both versions, each span's tokens recomputed from the trainer's bytes of the
    version it names; nothing is wasted and the group is not dropped as stale."""
    cfg = LoopConfig(
        group_size=2, batch_groups=1, max_staleness=0, partial_rollout=True, sampling=SamplingParams(max_tokens=100)
    )
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with running_worker(
            nats_url, namespace, engine=EchoEngine(per_token_s=0.02, keyed=True), worker_id="a", capacity=4,
            store_dir=tmp_path / "store", local_dir=tmp_path / "local-a",
        ):  # fmt: skip
            await client.wait_for_version(0, replicas=1, timeout=30)
            async with RolloutLoop(client, _prompts(1), cfg) as loop:
                await wait_until(lambda: loop.in_flight == 1)
                await asyncio.sleep(0.5)  # ~25 tokens made at version 0
                await client.publish_policy(publisher, tensors_at(1))
                batch = await loop.next_batch()
    assert batch is not None and len(batch.groups) == 1
    g = batch.groups[0]
    assert g.continued_at == 1 and loop.totals["continued"] == 1
    assert sum(loop.totals[k] for k in loop.totals if k.startswith("waste_tokens")) == 0
    for i, s in enumerate(g.samples):
        assert len(s.tokens) == 100 and s.logprobs is not None and len(s.logprobs) == 100
        assert s.spans[0].start == 0 and s.spans[-1].end == 100
        assert all(a.end == b.start for a, b in itertools.pairwise(s.spans))  # they tile the tokens
        assert [sp.version for sp in s.spans] == [0, 1], s.spans
        assert _true_versions(g, i) == [0, 1]
    assert g.staleness == 1  # the fact: its oldest tokens are one version old


class FailsOn(CountingEcho):
    """Answers a typed, non-retryable error for prompts starting with ``bad``."""

    def __init__(self, bad: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.bad = bad

    async def generate(self, request_id: str, payload: RolloutPayload, *a: Any, **kw: Any) -> Any:
        if (payload.prompt_token_ids or [0])[0] == self.bad:
            raise InvalidRequest(f"prompt {self.bad} refused")
        return await super().generate(request_id, payload, *a, **kw)


@pytest.mark.parametrize("on_failure", ["report", "requeue"])
async def test_a_group_is_delivered_whole_or_failed_whole(nats_url: str, namespace: str, on_failure: str) -> None:
    """Split groups (a job per sample) of 4 prompts, one of which the engine refuses: that group
    is reported failed with its reason (after ``max_attempts`` tries when re-queued), never
    yielded in part; the other prompts each come back in exactly one whole group."""
    cfg = LoopConfig(
        group_size=3, batch_groups=1, max_staleness=8, split_groups=True, on_failure=on_failure,  # type: ignore[arg-type]
        max_attempts=2, sampling=SamplingParams(max_tokens=4),
    )  # fmt: skip
    seen: list[Group] = []
    failed = []
    async with (
        running_worker(nats_url, namespace, engine=FailsOn(102, per_token_s=0.005), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, _prompts(4), cfg) as loop:
            async for batch in loop.batches():
                seen += batch.groups
                failed += batch.failed
            assert failed == loop.failed[: len(failed)]
            failed = loop.failed  # (the last may fail after the last batch)
            _identity_holds(loop, len(seen))
    assert sorted(g.prompt[0] for g in seen) == [100, 101, 103]
    assert all(len(g.samples) == 3 and len(g.results) == 3 for g in seen)
    assert [f.prompt[0] for f in failed] == [102] and "refused" in failed[0].reason
    assert failed[0].attempts == (2 if on_failure == "requeue" else 1)
    assert loop.totals["waste_groups_failed"] == failed[0].attempts


async def test_an_overtaken_tail_is_cancelled_frees_its_replica_and_comes_back(nats_url: str, namespace: str) -> None:
    """The first prompt is long (1,500 tokens, 15 s); a batch of two short groups overtakes it,
    and with ``oversample=1`` the loop cancels it: the replica stops within a second (the
    engine's running count falls), its tokens are counted as tail waste, and its prompt is
    re-queued rather than lost."""
    engine = CountingEcho(per_token_s=0.01)

    async def prompts() -> AsyncIterator[RolloutPayload]:
        yield RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=1500))
        for i in range(3):
            yield RolloutPayload(prompt_token_ids=[10 + i], sampling=SamplingParams(max_tokens=4))

    cfg = LoopConfig(group_size=1, batch_groups=2, max_staleness=8, oversample=1, max_in_flight=3)
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=3),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, prompts(), cfg) as loop:
            batch = await loop.next_batch()
            assert batch is not None and sorted(g.prompt.prompt_token_ids for g in batch.groups) == [[10], [11]]
            await wait_until(lambda: loop.totals["waste_groups_tail"] == 1, timeout=5, what="the tail cancelled")
            # The long job stops (at most the requeued one runs again); the third short group
            # may still be on the replica for a moment on a loaded host, never for 15 s.
            await wait_until(lambda: engine.running <= 1, timeout=5, what="the cancelled tail stopped")
            assert 0 < loop.totals["waste_tokens_tail"] < 1500
            assert loop.totals["requeued"] == 1


def _busy(client: RolloutClient) -> list[str]:
    return [r.worker_id for r in client.fleet.replicas() if r.in_flight > 0]


async def test_worker_sigkills_mid_batch_lose_no_group(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """Three worker processes; the two first seen generating are SIGKILLed while the first batch
    is being made. Every prompt of a finite source still comes back in exactly one whole group
    (the client re-runs the killed workers' replayable jobs), and the counters agree with what
    was yielded."""
    procs = ProcessGroup(tmp_path)
    cfg = LoopConfig(group_size=2, batch_groups=3, max_staleness=8, sampling=SamplingParams(max_tokens=100))
    seen: list[Group] = []
    topo = TopologyConfig(ack_wait_s=2.0)  # a killed worker's jobs come back after 2 s, not 30
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t", topology=topo) as client:
            for name in ("w1", "w2", "w3"):  # 100 tokens at 20 ms: 2 s a job
                args = ("--capacity", "3", "--echo-token-latency", "0.02", "--ack-wait", "2")
                procs.worker(nats_url, namespace, name, *args)
            await wait_until(lambda: len(client.fleet.replicas()) == 3, timeout=30, what="three workers")

            async def kill_two_busy() -> None:
                await wait_until(lambda: len(_busy(client)) >= 2, timeout=10, what="two workers busy")
                for name in _busy(client)[:2]:
                    procs.procs[name].send_signal(signal.SIGKILL)

            async with RolloutLoop(client, _prompts(9), cfg) as loop:
                killing = asyncio.create_task(kill_two_busy())
                async for batch in loop.batches():
                    seen += batch.groups
                await killing
                _identity_holds(loop, len(seen))
                assert not loop.failed
    finally:
        procs.close()
    assert sorted(g.prompt[0] for g in seen) == list(range(100, 109))
    assert all(len(g.samples) == 2 and all(len(s.tokens) == 100 for s in g.samples) for g in seen)
    assert any(r.delivery_attempt > 1 for g in seen for r in g.results)  # the kills hit running jobs


async def test_dynamic_sampling_drops_groups_without_signal_and_refills(nats_url: str, namespace: str) -> None:
    """A reward function scores every sample of even prompts alike: those groups are filtered
    (counted as waste), the batches are refilled from the source, and each yielded group has
    the rewards the function gave."""

    async def reward(group: Group) -> Sequence[float]:
        if group.prompt[0] % 2 == 0:
            return [1.0] * len(group.samples)
        return [float(i) for i in range(len(group.samples))]

    cfg = LoopConfig(group_size=2, batch_groups=2, max_staleness=8, dynamic_sampling=True)
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho(), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, _prompts(8), cfg, reward=reward) as loop:
            seen = [g async for b in loop.batches() for g in b.groups]
            _identity_holds(loop, len(seen))
    assert sorted(g.prompt[0] for g in seen) == [101, 103, 105, 107]
    assert all(g.rewards == [0.0, 1.0] for g in seen)
    assert loop.totals["waste_groups_filtered"] == 4


async def test_a_group_past_its_deadline_is_cancelled_and_reported(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(per_token_s=0.01)
    cfg = LoopConfig(
        group_size=1, batch_groups=1, max_staleness=8, group_deadline_s=0.5, on_failure="report",
        sampling=SamplingParams(max_tokens=1500),
    )  # fmt: skip
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=1),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, _prompts(1), cfg) as loop:
            assert await loop.next_batch() is None  # the only group failed: nothing to yield
            assert [f.reason for f in loop.failed] == ["cancelled (deadline)"]
            assert engine.running == 0
