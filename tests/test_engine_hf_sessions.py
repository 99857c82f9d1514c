"""Sessions on the hf engine: a turn reuses its session's KV and prefills only the rest, and the
cache tries hard to be broken (activations, diverging prompts, concurrency, memory pressure, TTL,
end_session and abort mid-turn, n > 1). Every reused turn is checked against a full forward pass
of the live model over the whole context: greedy tokens are its argmax, log-probs its values.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from hf_helpers import CHANGED, perturbed, publish, wait_steps

from rollfleet.models import build_model_dir
from rollfleet.schemas import Completion, RolloutPayload, SamplingParams
from rollfleet.workers.engines.hf import HFEngine


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


P1 = tokens(40, 1)
ENV = tokens(30, 2)  # a tool's answer between turns


def turn(prompt: list[int], max_tokens: int = 12, n: int = 1, **sampling: object) -> RolloutPayload:
    sampling.setdefault("temperature", 0.0)
    return RolloutPayload(
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        n=n,
        extra={"ignore_eos": True},
    )


def assert_full_forward(engine: HFEngine, prompt: list[int], out: Completion, temperature: float = 0.0) -> None:
    """``out`` is what the live model gives for ``prompt`` with no cache at all."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    at = [len(prompt) - 1 + i for i in range(len(out.token_ids))]
    if temperature == 0.0:
        assert out.token_ids == [int(logits[j].argmax()) for j in at]
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    assert out.logprobs == pytest.approx([float(logp[j, t]) for j, t in zip(at, out.token_ids, strict=True)], abs=1e-4)


def kv_bytes(engine: HFEngine, n_tokens: int) -> int:
    cfg = engine.model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * n_tokens  # float32


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110 - state the engine's loop moves
            await asyncio.sleep(0.005)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return build_model_dir(tmp_path / "ckpt", preset="tiny", seed=1)


@pytest.fixture
async def make(ckpt: Path) -> AsyncIterator[Callable[..., HFEngine]]:
    engines: list[HFEngine] = []

    def factory(**options: object) -> HFEngine:
        eng = HFEngine(device="cpu", seed=0, **options)  # type: ignore[arg-type]
        engines.append(eng)
        return eng

    yield factory
    for eng in engines:
        await eng.close()


@pytest.fixture
async def engine(make: Callable[..., HFEngine], ckpt: Path) -> HFEngine:
    eng = make(max_batch=16)
    await eng.start(ckpt, version=0)
    return eng


async def activate(engine: HFEngine, ckpt: Path, version: int, names: list[str] = CHANGED) -> None:
    await engine.pause()
    if names:
        publish(ckpt, perturbed(engine, names, seed=version), shard=f"model-v{version}.safetensors")
    await engine.load_weights(ckpt, names, version=version)
    await engine.resume()


# -- reuse ---------------------------------------------------------------------------------------


async def test_a_turn_prefills_only_what_its_session_does_not_hold(engine: HFEngine) -> None:
    first = await engine.generate("t1", turn(P1), session_id="s")
    assert (first.cached_tokens, first.cache_rebuilt) == (0, False)
    await until(lambda: engine.session_cache_stats().entries == 1)  # the turn's rows went to its session
    held = len(P1) + len(first.outputs[0].token_ids) - 1  # the last output token was never fed back
    assert engine.session_cache_stats().bytes == kv_bytes(engine, held)
    p2 = P1 + first.outputs[0].token_ids + ENV
    before = engine.prefill_tokens
    second = await engine.generate("t2", turn(p2), session_id="s")
    assert second.cached_tokens == held and second.cache_rebuilt is False
    assert engine.prefill_tokens - before == len(p2) - held  # only the new tokens were computed
    assert_full_forward(engine, p2, second.outputs[0])
    stats = engine.session_cache_stats()
    assert (stats.hits, stats.misses, stats.rebuilds, stats.evictions) == (1, 1, 0, 0)
    # The same turn without a session prefills everything and gives the same tokens.
    before = engine.prefill_tokens
    plain = await engine.generate("plain", turn(p2))
    assert plain.cached_tokens == 0 and engine.prefill_tokens - before == len(p2)
    assert plain.outputs[0].token_ids == second.outputs[0].token_ids


async def test_a_prompt_diverging_inside_the_cached_prefix_reuses_only_the_common_part(engine: HFEngine) -> None:
    first = await engine.generate("t1", turn(P1), session_id="s")
    forked = P1[:17] + tokens(25, 3)  # a rewritten history: agrees on 17 tokens only
    second = await engine.generate("t2", turn(forked), session_id="s")
    assert second.cached_tokens == 17
    assert_full_forward(engine, forked, second.outputs[0])
    shorter = forked[:10]  # wholly inside what is cached: its last token is still prefilled
    third = await engine.generate("t3", turn(shorter), session_id="s")
    assert third.cached_tokens == 9
    assert_full_forward(engine, shorter, third.outputs[0])
    other = tokens(20, 4)
    fourth = await engine.generate("t4", turn(other), session_id="s")
    assert fourth.cached_tokens == 0
    assert_full_forward(engine, other, fourth.outputs[0])
    assert first.cached_tokens == 0 and engine.session_cache_stats().misses == 2


async def test_concurrent_sessions_and_plain_requests_share_batches_and_each_matches_a_full_forward(
    engine: HFEngine,
) -> None:
    prompts = {f"s{i}": tokens(8 + 9 * i, 10 + i) for i in range(6)}
    plain_prompt = tokens(33, 99)
    long_plain = asyncio.create_task(engine.generate("plain-long", turn(plain_prompt, max_tokens=120)))
    await wait_steps(engine, 3)
    firsts = await asyncio.gather(*(engine.generate(f"{s}-t1", turn(p), session_id=s) for s, p in prompts.items()))
    contexts = {
        s: p + r.outputs[0].token_ids + tokens(5 + 7 * i, 20 + i)
        for i, ((s, p), r) in enumerate(zip(prompts.items(), firsts, strict=True))
    }
    seconds = await asyncio.gather(
        *(engine.generate(f"{s}-t2", turn(c, max_tokens=16), session_id=s) for s, c in contexts.items()),
        engine.generate("plain-short", turn(plain_prompt[:9])),
    )
    for (s, context), first, second in zip(contexts.items(), firsts, seconds, strict=False):
        assert second.cached_tokens == len(prompts[s]) + len(first.outputs[0].token_ids) - 1, s
        assert_full_forward(engine, prompts[s], first.outputs[0])
        assert_full_forward(engine, context, second.outputs[0])
    assert_full_forward(engine, plain_prompt[:9], seconds[-1].outputs[0])
    assert_full_forward(engine, plain_prompt, (await long_plain).outputs[0])
    # Second turns were decoded together with each other and with the long request.
    together = [rids for _, _, rids in engine.step_log if "plain-long" in rids and sum("-t2" in r for r in rids) >= 3]
    assert together


async def test_a_sequence_joining_the_batch_prefills_only_itself(engine: HFEngine) -> None:
    """No session needed: a running sequence keeps its KV when another joins (nothing is re-prefilled)."""
    long_prompt = tokens(300, 5)
    running = asyncio.create_task(engine.generate("long", turn(long_prompt, max_tokens=80)))
    await wait_steps(engine, 5)
    before = engine.prefill_tokens
    joiner = tokens(11, 6)
    short = await engine.generate("short", turn(joiner, max_tokens=6))
    assert engine.prefill_tokens - before == len(joiner)
    assert_full_forward(engine, joiner, short.outputs[0])
    assert_full_forward(engine, long_prompt, (await running).outputs[0])


# -- activations -----------------------------------------------------------------------------------


async def test_an_activation_between_turns_rebuilds_the_session_on_the_new_weights(
    engine: HFEngine, ckpt: Path
) -> None:
    first = await engine.generate("t1", turn(P1), session_id="s")
    await until(lambda: engine.session_cache_stats().bytes > 0)
    await activate(engine, ckpt, 1)
    assert engine.session_cache_stats().bytes == 0  # stale KV is freed at the activation
    p2 = P1 + first.outputs[0].token_ids + ENV
    second = await engine.generate("t2", turn(p2), session_id="s")
    assert (second.cached_tokens, second.cache_rebuilt) == (0, True)
    assert second.version_start == second.version_end == 1
    assert_full_forward(engine, p2, second.outputs[0])  # on the new weights, from scratch
    p3 = p2 + second.outputs[0].token_ids + ENV
    third = await engine.generate("t3", turn(p3), session_id="s")
    assert third.cached_tokens == len(p2) + len(second.outputs[0].token_ids) - 1 and third.cache_rebuilt is False
    assert_full_forward(engine, p3, third.outputs[0])
    # An activation that changes no tensor leaves the KV valid.
    await activate(engine, ckpt, 2, names=[])
    p4 = p3 + third.outputs[0].token_ids + ENV
    fourth = await engine.generate("t4", turn(p4), session_id="s")
    assert fourth.cached_tokens == len(p3) + len(third.outputs[0].token_ids) - 1 and fourth.cache_rebuilt is False
    assert_full_forward(engine, p4, fourth.outputs[0])
    assert engine.session_cache_stats().rebuilds == 1


@pytest.mark.parametrize("reprefill", [True, False])
async def test_an_activation_mid_turn_never_leaves_old_kv_for_the_next_turn(
    make: Callable[..., HFEngine], ckpt: Path, reprefill: bool
) -> None:
    engine = make(reprefill_after_activation=reprefill)
    await engine.start(ckpt, version=0)
    task = asyncio.create_task(engine.generate("t1", turn(P1, max_tokens=60), session_id="s"))
    await wait_steps(engine, 10)
    await activate(engine, ckpt, 1)
    first = await task
    assert (first.version_start, first.version_end) == (0, 1)
    p2 = P1 + first.outputs[0].token_ids + ENV
    second = await engine.generate("t2", turn(p2), session_id="s")
    if reprefill:  # the running rows were rebuilt on the new weights: their KV is current
        assert second.cached_tokens == len(P1) + 60 - 1 and second.cache_rebuilt is False
    else:  # the rows kept KV of the old weights: never reused
        assert (second.cached_tokens, second.cache_rebuilt) == (0, True)
    assert_full_forward(engine, p2, second.outputs[0])


# -- bounds ----------------------------------------------------------------------------------------


async def test_memory_pressure_evicts_the_least_recently_used_session_never_a_turn_in_flight(
    make: Callable[..., HFEngine], ckpt: Path
) -> None:
    probe = make()
    await probe.start(ckpt, version=0)
    one = kv_bytes(probe, len(P1) + 12 - 1)  # what a first turn leaves
    engine = make(session_cache_bytes=int(3.5 * one))
    await engine.start(ckpt, version=0)
    prompts = {s: tokens(len(P1), seed) for seed, s in enumerate("abcdex")}
    firsts = {s: await engine.generate(f"{s}1", turn(prompts[s]), session_id=s) for s in "abcd"}
    await until(lambda: engine.session_cache_stats().evictions == 1)  # d's turn pushed out a, the oldest
    stats = engine.session_cache_stats()
    assert stats.entries == 3 and stats.bytes == 3 * one <= stats.max_bytes
    context = {s: prompts[s] + firsts[s].outputs[0].token_ids + ENV for s in "abcd"}
    a2_task = asyncio.create_task(engine.generate("a2", turn(context["a"], max_tokens=40), session_id="a"))
    await wait_steps(engine, engine.steps + 3)
    e1 = await engine.generate("e1", turn(prompts["e"]), session_id="e")  # evicts b while a's turn runs
    a2 = await a2_task
    assert a2.cached_tokens == 0  # a was evicted before this turn began...
    assert_full_forward(engine, context["a"], a2.outputs[0])  # ... and nothing since disturbed it
    # a's turn (2.4 first turns' worth) made room by evicting c then d, the least recently used.
    await until(lambda: engine.session_cache_stats().evictions == 4)
    stats = engine.session_cache_stats()
    assert stats.entries == 2 and stats.bytes == one + kv_bytes(engine, len(context["a"]) + 39) <= stats.max_bytes
    # A turn too large for the whole budget is not kept, and pushes nobody out for nothing.
    big = await engine.generate("x1", turn(tokens(200, 9)), session_id="x")
    await until(lambda: engine.session_cache_stats().evictions == 5)
    assert engine.session_cache_stats().bytes == stats.bytes and big.cached_tokens == 0
    # What is left is what the last turns of e and a left (taken together, before either adds back).
    a_context = context["a"] + a2.outputs[0].token_ids
    a3, e2 = await asyncio.gather(
        engine.generate("a3", turn(a_context), session_id="a"),
        engine.generate("e2", turn(prompts["e"] + e1.outputs[0].token_ids), session_id="e"),
    )
    assert (a3.cached_tokens, e2.cached_tokens) == (len(a_context) - 1, len(prompts["e"]) + 11)
    assert_full_forward(engine, a_context, a3.outputs[0])


async def test_idle_sessions_expire_after_their_ttl(make: Callable[..., HFEngine], ckpt: Path) -> None:
    engine = make(session_ttl_s=0.3)
    await engine.start(ckpt, version=0)
    first = await engine.generate("t1", turn(P1), session_id="s")
    p2 = P1 + first.outputs[0].token_ids + ENV
    second = await engine.generate("t2", turn(p2), session_id="s")  # within the TTL: reused
    assert second.cached_tokens > 0
    await until(lambda: engine._sessions._bytes > 0)
    await until(lambda: engine._sessions._bytes == 0, timeout=5)  # the idle engine frees it by itself
    assert engine.session_cache_stats().expirations == 1
    p3 = p2 + second.outputs[0].token_ids + ENV
    third = await engine.generate("t3", turn(p3), session_id="s")
    assert third.cached_tokens == 0 and third.cache_rebuilt is False
    assert_full_forward(engine, p3, third.outputs[0])


async def test_end_session_frees_its_cache_and_a_turn_running_meanwhile_keeps_nothing(engine: HFEngine) -> None:
    first = await engine.generate("t1", turn(P1), session_id="s")
    await until(lambda: engine.session_cache_stats().entries == 1)
    await engine.end_session("s")
    assert engine.session_cache_stats().entries == 0 and engine.session_cache_stats().bytes == 0
    p2 = P1 + first.outputs[0].token_ids + ENV
    task = asyncio.create_task(engine.generate("t2", turn(p2, max_tokens=60), session_id="s"))
    await wait_steps(engine, engine.steps + 3)
    await engine.end_session("s")  # mid-turn
    second = await task
    assert second.cached_tokens == 0 and len(second.outputs[0].token_ids) == 60
    await engine.generate("other", turn(tokens(9, 9), max_tokens=2))  # steps on: the turn's rows leave
    assert engine.session_cache_stats().entries == 0 and engine.session_cache_stats().bytes == 0
    p3 = p2 + second.outputs[0].token_ids + ENV
    third = await engine.generate("t3", turn(p3), session_id="s")
    assert third.cached_tokens == 0
    # The id can be used again: a new session under it caches as usual.
    fourth = await engine.generate("t4", turn(p3 + third.outputs[0].token_ids), session_id="s")
    assert fourth.cached_tokens == len(p3) + 11


async def test_an_aborted_turn_leaves_its_prefix_for_the_retry(engine: HFEngine) -> None:
    first = await engine.generate("t1", turn(P1), session_id="s")
    p2 = P1 + first.outputs[0].token_ids + ENV
    task = asyncio.create_task(engine.generate("t2", turn(p2, max_tokens=500), session_id="s"))
    await wait_steps(engine, engine.steps + 4)
    await engine.abort("t2")
    aborted = await task
    assert aborted.outputs[0].finish_reason == "abort" and aborted.cached_tokens == len(P1) + 11
    retry = await engine.generate("t2-retry", turn(p2), session_id="s")
    assert retry.cached_tokens == len(p2) - 1  # the whole prompt was computed before the abort
    assert_full_forward(engine, p2, retry.outputs[0])
    # A turn aborted before it ever ran takes nothing away from the session.
    await engine.pause()
    queued = asyncio.create_task(engine.generate("t3", turn(p2), session_id="s"))
    await asyncio.sleep(0.05)
    await engine.abort("t3")
    assert (await queued).outputs[0].token_ids == []
    await engine.resume()
    again = await engine.generate("t3-retry", turn(p2 + retry.outputs[0].token_ids), session_id="s")
    assert again.cached_tokens == len(p2) + 11


async def test_n_samples_of_a_session_turn_reuse_the_prefix_even_when_admitted_apart(
    make: Callable[..., HFEngine], ckpt: Path
) -> None:
    engine = make(max_batch=2)  # 3 samples: two start together, the third when a row frees
    await engine.start(ckpt, version=0)
    sampling = {"temperature": 1.0, "seed": 5}
    first = await engine.generate("t1", turn(P1, n=3, **sampling), session_id="s")
    plain = await engine.generate("p1", turn(P1, n=3, **sampling))
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in plain.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    chosen = first.outputs[2].token_ids  # the environment continues the third sample
    p2 = P1 + chosen + ENV
    before = engine.prefill_tokens
    second = await engine.generate("t2", turn(p2, n=3, temperature=1.0, seed=9), session_id="s")
    held = len(P1) + len(chosen) - 1
    assert second.cached_tokens == held
    assert engine.prefill_tokens - before == 2 * (len(p2) - held)  # once per admission, never the prefix
    for out in second.outputs:
        assert_full_forward(engine, p2, out, temperature=1.0)
    reference = await engine.generate("p2", turn(p2, n=3, temperature=1.0, seed=9))
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in reference.outputs]


async def test_a_model_whose_cache_cannot_be_split_into_rows_still_batches_correctly(tmp_path: Path) -> None:
    ckpt = build_model_dir(
        tmp_path / "sliding", preset="tiny", seed=3, use_sliding_window=True, sliding_window=8, max_window_layers=0
    )
    engine = HFEngine(device="cpu", seed=0)
    await engine.start(ckpt, version=0)
    try:
        alone = await engine.generate("alone", turn(P1, max_tokens=30))
        running = asyncio.create_task(engine.generate("a", turn(P1, max_tokens=30), session_id="s"))
        await wait_steps(engine, engine.steps + 5)
        joined = await engine.generate("b", turn(tokens(13, 4), max_tokens=5), session_id="s2")
        together = await running
        assert together.outputs[0].token_ids == alone.outputs[0].token_ids
        again = await engine.generate("a2", turn(P1 + together.outputs[0].token_ids), session_id="s")
        assert joined.cached_tokens == again.cached_tokens == 0  # sessions are not cached for such models
        assert engine.session_cache_stats().entries == 0
    finally:
        await engine.close()
