"""The rollout loop (``trainer_client.loop``) against real workers on a real broker (its decisions
alone, as sequences of events, are ``tests/test_loop_machine.py``): every consumed group within
the staleness bound by the tokens themselves (recomputed from the trainer's own bytes, not the
labels), seeded samples each on its own stream, groups whole or failed whole, tails continued,
worker SIGKILLs losing no group, a killed trainer's jobs reclaimed by its successor, and every
token the workers generated trained on or counted as waste."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from harness import ProcessGroup, running_worker, wait_until
from harness.weights import tensors_at, write_base_checkpoint
from reliability.adversary.truth import recompute, tensors_key
from rollfleet.broker.topology import TopologyConfig
from rollfleet.runtime.processes import terminate
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.trainer_client.loop import Batch, Group, LoopConfig, RolloutLoop
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import REPO, CountingEcho, stored_results

# -- the loop against real workers -----------------------------------------------------------


async def _prompts(count: int | None = None, start: int = 100) -> AsyncIterator[list[int]]:
    i = 0
    while count is None or i < count:
        yield [start + i, 7, 11]
        i += 1


def _identity_holds(loop: RolloutLoop, yielded: int) -> None:
    """The loop's counters agree with what it yielded and still holds: every token it received was
    trained on, is held, or is waste by cause; every group it yielded is counted."""
    t = loop.totals
    assert t["generated_tokens"] == t["tokens"] + _waste(loop) + loop.held_tokens, dict(t)
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
                    "rollfleet_loop_trained_tokens_total", {"client_id": "t", "loop": loop.loop_id}
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


@pytest.mark.parametrize(
    "stale", [pytest.param("drop", marks=pytest.mark.long), "requeue", pytest.param("keep", marks=pytest.mark.long)]
)  # (requeue in make test: it drops as drop does, and sends the prompts back)
async def test_groups_gone_stale_are_judged_by_their_tokens_and_the_policy(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher, stale: str
) -> None:
    """``max_staleness=0`` and two versions committed while the trainer waits for its batch, its
    groups generating: they go stale. By the versions their tokens were recomputed from, ``drop``
    and ``requeue`` hand out none of them (and count them as waste; ``requeue`` also sends their
    prompts back), while ``keep`` hands them out with their true staleness."""
    cfg = LoopConfig(
        group_size=2,
        batch_groups=2,
        max_staleness=0,
        stale=stale,
        sampling=SamplingParams(max_tokens=16),  # type: ignore[arg-type]
    )
    batches: list[Batch] = []
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with running_worker(
            nats_url, namespace, engine=EchoEngine(per_token_s=0.04, keyed=True), worker_id="a", capacity=4,
            store_dir=tmp_path / "store", local_dir=tmp_path / "local-a",
        ):  # fmt: skip
            await client.wait_for_version(0, replicas=1, timeout=30)
            async with RolloutLoop(client, _prompts(), cfg) as loop:
                for step in range(2):
                    asked = asyncio.ensure_future(loop.next_batch())
                    if step % 2 == 0:  # two commits while its groups generate (0.6 s each)
                        await wait_until(lambda: loop.in_flight > 0, what="groups generating")
                        for _ in range(2):
                            await client.publish_policy(publisher, tensors_at(client.latest_version + 1))
                    batch = await asked
                    assert batch is not None
                    batches.append(batch)
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
        # (The echo engine makes a job's samples one after another: the second may have been
        # stopped before its first token, and is then made at version 1 alone: no zero-width span.)
        assert [sp.version for sp in s.spans] in ([0, 1], [1]), s.spans
        assert _true_versions(g, i) == [sp.version for sp in s.spans]
        # Its last run began after every version-0 token (the replica may have activated version
        # 1 mid-run before the loop stopped it).
        made_at_0 = sum(sp.end - sp.start for sp in s.spans if sp.version == 0)
        assert s.continued_from >= made_at_0 and s.judged_version == 1
    assert [sp.version for sp in g.samples[0].spans] == [0, 1]
    # Each run that made a sample's tokens carries the coordinate the worker stored with its
    # answer, and where in the sample its tokens begin.
    for s in g.samples:
        assert [run.start for run in s.replay][-1] == s.continued_from and s.replay[0].start == 0
        for run, end in zip(s.replay, [*(r.start for r in s.replay[1:]), len(s.tokens)], strict=True):
            (stored,) = await stored_results(nats_url, namespace, "t", run.key)
            assert stored.replay is not None and run.coordinate == stored.replay
            assert stored.outputs[run.index].token_ids == s.tokens[run.start : end]
    # Judged by the tokens of its last run (version 1); its oldest tokens are one version old.
    assert g.staleness == 0 and g.token_staleness == 1


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


async def test_an_overtaken_tail_is_continued_at_the_new_version_keeping_its_tokens(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """The first prompt is long (200 tokens, 2 s); batches of short groups overtake it. With
    ``oversample=1`` the batch handed out after a commit stops it and continues it at the new
    version from its tokens so far: it is trained on whole (its spans tile both versions, every
    token recomputed from the trainer's bytes), nothing is thrown away, its prompt never re-queued."""

    async def prompts() -> AsyncIterator[RolloutPayload]:
        yield RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=200))
        for i in range(5):
            yield RolloutPayload(prompt_token_ids=[10 + i], sampling=SamplingParams(max_tokens=4))

    cfg = LoopConfig(group_size=1, batch_groups=2, max_staleness=8, oversample=1, max_in_flight=3)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with _keyed_worker(nats_url, namespace, tmp_path, "a", per_token_s=0.01, capacity=3):
            await client.wait_for_version(0, replicas=1, timeout=30)
            async with RolloutLoop(client, prompts(), cfg) as loop:
                groups = []
                first = await loop.next_batch()
                assert first is not None and [g.prompt.prompt_token_ids for g in first.groups] == [[10], [11]]
                groups += first.groups
                await client.publish_policy(publisher, tensors_at(1))
                await client.wait_for_version(1, replicas=1, timeout=30)
                async for batch in loop.batches():
                    groups += batch.groups
    long = next(g for g in groups if g.prompt.prompt_token_ids == [1, 2])
    s = long.samples[0]
    assert len(s.tokens) == 200 and [sp.version for sp in s.spans] == [0, 1], s.spans
    assert all(a.end == b.start for a, b in itertools.pairwise(s.spans)) and s.spans[-1].end == 200
    verdict = recompute(
        lambda v: tensors_key(tensors_at(v)),
        [1, 2],
        [s.tokens],
        [[(sp.version, sp.start, sp.end) for sp in s.spans]],
        seed=None,
    )
    assert not verdict.mismatches and verdict.checked == 200
    assert long.continued_at == 1 and 0 < s.continued_from < 200 and s.judged_version == 1
    assert loop.totals["continued"] == 1 and loop.totals["requeued"] == 0 and _waste(loop) == 0
    assert sorted(g.prompt.prompt_token_ids[0] for g in groups) == [1, 10, 11, 12, 13, 14]


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
            last = await loop.next_batch()  # the only group failed: a last batch says so
            assert last is not None and last.groups == [] and last.failed == loop.failed
            assert await loop.next_batch() is None
            assert [f.reason for f in loop.failed] == ["cancelled (deadline)"]
            assert engine.running == 0


# -- the loop's defects, each from raw facts ---------------------------------------------------


class TokenCountingEcho(CountingEcho):
    """Counts every output token it generated (an aborted run's partial tokens included): the
    fleet's side of the accounting identity."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.generated = 0
        self.prompts: list[list[int]] = []

    async def generate(self, request_id: str, payload: RolloutPayload, *a: Any, **kw: Any) -> Any:
        self.prompts.append(list(payload.prompt_token_ids or []))
        out = await super().generate(request_id, payload, *a, **kw)
        self.generated += sum(len(c.token_ids) for c in out.outputs)
        return out


def _keyed_worker(
    nats_url: str, namespace: str, tmp_path: Path, name: str, *, per_token_s: float, capacity: int
) -> Any:
    return running_worker(
        nats_url, namespace, engine=EchoEngine(per_token_s=per_token_s, keyed=True), worker_id=name,
        capacity=capacity, store_dir=tmp_path / "store", local_dir=tmp_path / f"local-{name}",
    )  # fmt: skip


def _waste(loop: RolloutLoop) -> int:
    return sum(v for k, v in loop.totals.items() if k.startswith("waste_tokens_"))


async def test_a_split_seeded_group_is_the_direct_submits_samples(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """A seeded group split into n=1 jobs gives, sample by sample, the tokens a direct seeded
    submit of n=group_size gives on the same weights (each sample its own stream), all distinct."""
    sampling = SamplingParams(max_tokens=6, seed=7)
    cfg = LoopConfig(group_size=4, batch_groups=1, max_staleness=4, split_groups=True, sampling=sampling)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with _keyed_worker(nats_url, namespace, tmp_path, "a", per_token_s=0.0, capacity=4):
            await client.wait_for_version(0, replicas=1, timeout=30)
            direct = await client.submit(
                RolloutPayload(prompt_token_ids=[100, 7, 11], sampling=sampling, n=4), min_version=0
            )
            want = [o.token_ids for o in (await direct).outputs]
            async with RolloutLoop(client, _prompts(1), cfg) as loop:
                batch = await loop.next_batch()
    assert batch is not None and len(batch.groups) == 1
    got = [s.tokens for s in batch.groups[0].samples]
    assert got == want
    assert len({tuple(t) for t in got}) == 4


async def test_continued_seeded_samples_draw_their_own_streams(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """A seeded group of 4 stopped by a commit and continued: every token of every sample is the
    keyed engine's token for that sample's own stream (``sample_seed(seed, i)``) on the version
    its span names, recomputed from the trainer's bytes; the four samples are distinct."""
    cfg = LoopConfig(
        group_size=4, batch_groups=1, max_staleness=0, partial_rollout=True,
        sampling=SamplingParams(max_tokens=60, seed=11),
    )  # fmt: skip
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with _keyed_worker(nats_url, namespace, tmp_path, "a", per_token_s=0.02, capacity=4):
            await client.wait_for_version(0, replicas=1, timeout=30)
            async with RolloutLoop(client, _prompts(1), cfg) as loop:
                await wait_until(lambda: loop.in_flight == 1)
                await asyncio.sleep(0.4)  # some tokens made at version 0
                await client.publish_policy(publisher, tensors_at(1))
                batch = await loop.next_batch()
    assert batch is not None and loop.totals["continued"] >= 1
    g = batch.groups[0]
    verdict = recompute(
        lambda v: tensors_key(tensors_at(v)),
        g.payload.prompt_token_ids or [],
        [s.tokens for s in g.samples],
        [[(sp.version, sp.start, sp.end) for sp in s.spans] for s in g.samples],
        seed=11,
    )
    assert verdict.checked == g.tokens == 4 * 60 and not verdict.mismatches, verdict.mismatches
    assert {sp.version for s in g.samples for sp in s.spans} == {0, 1}
    assert len({tuple(s.tokens) for s in g.samples}) == 4


async def test_a_slow_source_stalls_neither_deadlines_nor_admission(nats_url: str, namespace: str) -> None:
    """The source gives a long prompt, then sleeps 2 s. The long group's 0.5 s deadline stops it
    while the source sleeps (its replica freed); the prompt that comes after the sleep is admitted
    then, with its own clock, and trained on, not killed as past a deadline it never had."""
    engine = CountingEcho(per_token_s=0.01)
    slept = asyncio.Event()

    async def prompts() -> AsyncIterator[RolloutPayload]:
        yield RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=1500))
        await asyncio.sleep(2.0)
        slept.set()
        yield RolloutPayload(prompt_token_ids=[3, 4], sampling=SamplingParams(max_tokens=4))

    cfg = LoopConfig(group_size=1, batch_groups=1, max_staleness=8, group_deadline_s=0.5, on_failure="report")
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=2),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, prompts(), cfg) as loop:
            await wait_until(lambda: len(loop.failed) == 1, timeout=10, what="the long group stopped at its deadline")
            assert not slept.is_set()  # stopped while the source still slept
            await wait_until(lambda: engine.running == 0, timeout=2, what="its replica freed")
            batch = await loop.next_batch()
    assert batch is not None and [g.prompt.prompt_token_ids for g in batch.groups] == [[3, 4]]
    assert [f.prompt.prompt_token_ids for f in loop.failed] == [[1, 2]]
    assert loop.failed[0].reason == "cancelled (deadline)"


async def test_every_generated_token_is_trained_or_counted_as_waste(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """Partial rollouts on a one-slot replica: a group queued or running is stopped by a commit and
    continued; then ``close()`` while it is ready (every round of it) and another is in flight. The
    tokens the worker generated (counted in the engine) are exactly the tokens trained on plus the
    waste the loop counted, by cause."""
    engine = TokenCountingEcho(per_token_s=0.01, keyed=True)
    cfg = LoopConfig(
        group_size=2, batch_groups=1, max_staleness=1, partial_rollout=True, sampling=SamplingParams(max_tokens=50)
    )
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with running_worker(
            nats_url, namespace, engine=engine, worker_id="a", capacity=1,
            store_dir=tmp_path / "store", local_dir=tmp_path / "local-a",
        ):  # fmt: skip
            await client.wait_for_version(0, replicas=1, timeout=30)
            async with RolloutLoop(client, _prompts(), cfg) as loop:
                assert await loop.next_batch() is not None
                await client.publish_policy(publisher, tensors_at(1))
                await wait_until(lambda: loop.totals["continued"] >= 1, timeout=15, what="a group continued")
                await wait_until(lambda: loop.ready >= 1, timeout=15, what="a group ready at close")
            await wait_until(lambda: engine.running == 0, timeout=10, what="the worker idle")
    assert loop.totals["waste_tokens_unused"] > 0 and loop.held_tokens == 0
    assert engine.generated == loop.totals["tokens"] + _waste(loop), sorted(loop.totals.items())
    assert loop.totals["generated_tokens"] == engine.generated


async def test_a_source_that_raises_surfaces_at_once_and_keeps_its_groups(nats_url: str, namespace: str) -> None:
    """A source that raises with nothing in flight: ``next_batch()`` raises its error at once.
    One that raises after a group completed: the error first, then that group in a batch."""

    async def broken() -> AsyncIterator[list[int]]:
        await asyncio.sleep(0.5)  # (next_batch is waiting by then)
        raise ValueError("dataset unreadable")
        yield [1]  # (an async generator)

    async def one_then_broken() -> AsyncIterator[list[int]]:
        yield [5, 6]
        await asyncio.sleep(1.0)  # the group completes meanwhile
        raise ValueError("dataset unreadable")

    cfg = LoopConfig(group_size=2, batch_groups=2, max_staleness=8, sampling=SamplingParams(max_tokens=4))
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho(), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, broken(), cfg) as loop:
            with pytest.raises(ValueError, match="unreadable"):
                await asyncio.wait_for(loop.next_batch(), 10)
        async with RolloutLoop(client, one_then_broken(), cfg) as loop:
            with pytest.raises(ValueError, match="unreadable"):
                await asyncio.wait_for(loop.next_batch(), 10)
            batch = await asyncio.wait_for(loop.next_batch(), 10)
            assert batch is not None and [g.prompt for g in batch.groups] == [[5, 6]]
            assert await asyncio.wait_for(loop.next_batch(), 10) is None


@pytest.mark.parametrize(
    "field, value",
    [("max_in_flight", 0), ("oversample", -1), ("group_deadline_s", 0.0), ("job_timeout_s", -1.0),
     ("job_timeout_s", 0.0), ("activation_grace_s", -1.0), ("group_deadline_s", float("nan"))],
)  # fmt: skip
def test_a_loop_config_that_cannot_run_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        LoopConfig(**{field: value})
    assert caught.value.detail == field and field in caught.value.message


async def test_failures_after_the_last_batch_are_handed_over(nats_url: str, namespace: str) -> None:
    """Every group fails: the run does not end as a dry source does; a last batch with no groups
    carries the failures."""
    cfg = LoopConfig(
        group_size=2, batch_groups=2, max_staleness=8, on_failure="report", sampling=SamplingParams(max_tokens=4)
    )
    async with (
        running_worker(nats_url, namespace, engine=FailsOn(100, per_token_s=0.001), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, _prompts(1), cfg) as loop:
            batches = [b async for b in loop.batches()]
    assert len(batches) == 1 and batches[0].groups == []
    assert [f.prompt for f in batches[0].failed] == [[100, 7, 11]]


async def test_a_second_loop_on_one_client_runs_with_metrics_of_its_own(nats_url: str, namespace: str) -> None:
    """An evaluation loop beside a training loop, then a loop after both closed, on one client:
    each runs, and the trained-tokens metric is labelled per loop."""
    cfg = LoopConfig(group_size=2, batch_groups=1, max_staleness=8, sampling=SamplingParams(max_tokens=4))
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho(), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        train_cfg = LoopConfig(**{**cfg.__dict__, "loop_id": "train"})
        eval_cfg = LoopConfig(**{**cfg.__dict__, "loop_id": "eval"})
        async with (
            RolloutLoop(client, _prompts(2), train_cfg) as train,
            RolloutLoop(client, _prompts(3, 200), eval_cfg) as ev,
        ):
            assert len([b async for b in train.batches()]) == 2
            assert len([b async for b in ev.batches()]) == 3
        async with RolloutLoop(client, _prompts(1, 300), train_cfg) as again:
            assert len([b async for b in again.batches()]) == 1
        registry = client.metrics.registry
        trained = {
            name: registry.get_sample_value("rollfleet_loop_trained_tokens_total", {"client_id": "t", "loop": name})
            for name in ("train", "eval")
        }
    assert trained == {"train": 3 * 2 * 4.0, "eval": 3 * 2 * 4.0}


async def test_rewards_that_are_not_numbers_fail_the_group(nats_url: str, namespace: str) -> None:
    """A NaN reward is no signal dynamic sampling may pass: the group is reported failed, naming it."""

    async def reward(group: Group) -> Sequence[float]:
        return [float("nan"), 1.0]

    cfg = LoopConfig(
        group_size=2, batch_groups=1, max_staleness=8, dynamic_sampling=True, on_failure="report",
        sampling=SamplingParams(max_tokens=4),
    )  # fmt: skip
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho(), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, _prompts(1), cfg, reward=reward) as loop:
            batches = [b async for b in loop.batches()]
    assert all(not b.groups for b in batches)
    assert len(loop.failed) == 1 and "reward" in loop.failed[0].reason and "nan" in loop.failed[0].reason


async def test_an_empty_prompt_is_reported_without_a_job(nats_url: str, namespace: str) -> None:
    engine = CountingEcho()

    async def prompts() -> AsyncIterator[Any]:
        yield ""
        yield []
        yield [9]

    cfg = LoopConfig(group_size=1, batch_groups=1, max_staleness=8, sampling=SamplingParams(max_tokens=4))
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, prompts(), cfg) as loop:
            seen = [g.prompt for b in [b async for b in loop.batches()] for g in b.groups]
    assert seen == [[9]] and len(engine.calls) == 1
    assert sorted(repr(f.prompt) for f in loop.failed) == ["''", "[]"]
    assert all(isinstance(f.error, InvalidRequest) for f in loop.failed)


async def test_a_trainer_taking_many_batches_per_version_is_served(nats_url: str, namespace: str) -> None:
    """Gradient accumulation: six batches at one version with ``max_staleness=0``. Each is handed
    over (the bound counts batches taken), none stale."""
    cfg = LoopConfig(group_size=1, batch_groups=1, max_staleness=0, sampling=SamplingParams(max_tokens=4))
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho(), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, _prompts(), cfg) as loop:
            for _ in range(6):
                assert await asyncio.wait_for(loop.next_batch(), 10) is not None
    assert loop.totals["batches"] == 6 and loop.totals["waste_groups_stale"] == 0


async def test_no_replica_at_the_latest_version_stops_no_group_twice(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """Partial rollouts; the trainer commits version 1 that no replica takes (the worker follows
    no store). After ``activation_grace_s`` new groups may run at version 0 again; a running group
    is not stopped and continued at the same version, again and again."""
    cfg = LoopConfig(
        group_size=1, batch_groups=1, max_staleness=1, partial_rollout=True, activation_grace_s=0.2,
        sampling=SamplingParams(max_tokens=150),
    )  # fmt: skip
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho(per_token_s=0.01), capacity=4),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as client,
    ):
        await client.publish_policy(publisher, tensors_at(0))
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with RolloutLoop(client, _prompts(1), cfg) as loop:
            await wait_until(lambda: loop.in_flight == 1)
            await client.publish_policy(publisher, tensors_at(1))
            batch = await asyncio.wait_for(loop.next_batch(), 20)
    assert batch is not None and len(batch.groups[0].samples[0].tokens) == 150
    assert loop.totals["continued"] == 0


_TRAINER = """
import asyncio, sys
from rollfleet.schemas import SamplingParams
from rollfleet.trainer_client import LoopConfig, RolloutClient, RolloutLoop

async def prompts():
    for i in range(int(sys.argv[3])):
        yield [100 + i, 7, 11]

async def main():
    client = await RolloutClient.connect(sys.argv[1], namespace=sys.argv[2], client_id="trainer")
    cfg = LoopConfig(group_size=2, batch_groups=2, max_staleness=2, loop_id="run1",
                     sampling=SamplingParams(max_tokens=40))
    async with RolloutLoop(client, prompts(), cfg) as loop:
        async for batch in loop.batches():
            while loop.in_flight == 0:  # (the source is read again once the batch freed room)
                await asyncio.sleep(0.01)
            print("BATCH", batch.step, loop.in_flight, flush=True)
            await asyncio.sleep(3600)  # the trainer is killed while it trains

asyncio.run(main())
"""


async def test_a_restarted_loop_reclaims_what_its_killed_predecessor_asked_for(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A trainer process running a named loop is SIGKILLed after its first batch, groups in flight.
    A trainer restarted with the same client id, loop id and prompts runs the source to its end:
    no prompt is generated twice (each first-round job ran once on the workers), every token the
    workers generated is what the restarted loop trained on or counted as waste, and nothing of
    the loop's is left unclaimed."""
    count = 8
    engines = [TokenCountingEcho(per_token_s=0.02) for _ in range(2)]
    async with (
        running_worker(nats_url, namespace, engine=engines[0], worker_id="a", capacity=2),
        running_worker(nats_url, namespace, engine=engines[1], worker_id="b", capacity=2),
    ):
        child = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, nats_url, namespace, str(count)],
            stdout=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
            assert line.startswith("BATCH 1") and int(line.split()[2]) > 0, line  # groups in flight
            terminate(child, 5.0, signal.SIGKILL)
        finally:
            terminate(child, 5.0, signal.SIGKILL)
            if child.stdout is not None:
                child.stdout.close()
        cfg = LoopConfig(
            group_size=2, batch_groups=2, max_staleness=1, loop_id="run1", sampling=SamplingParams(max_tokens=40)
        )
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer") as client:
            async with RolloutLoop(client, _prompts(count), cfg) as loop:
                seen = [g.prompt[0] for b in [b async for b in loop.batches()] for g in b.groups]
            await wait_until(lambda: all(e.running == 0 for e in engines), timeout=10, what="the workers idle")
            left = [k for k in client.unclaimed() if "run1" in k]
    ran = [p[0] for e in engines for p in e.prompts]
    assert sorted(seen) == list(range(100, 100 + count))
    assert sorted(ran) == list(range(100, 100 + count)), ran  # each prompt's job ran once
    generated = sum(e.generated for e in engines)
    assert generated == loop.totals["tokens"] + _waste(loop) == count * 2 * 40, str(
        (generated, sorted(loop.totals.items()))
    )
    assert left == []
