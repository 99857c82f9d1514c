"""The echo engine's session cache: what routing tests and benchmarks observe affinity through
(``cached_tokens``, the prefill it charges, ``cache_rebuilt`` after an activation)."""

from __future__ import annotations

from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.workers.engines import make_engine
from rollfleet.workers.engines.echo import EchoEngine

PROMPT = list(range(10, 30))


def turn(prompt: list[int], n: int = 1) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=6), n=n)


async def test_a_session_turn_is_charged_only_for_what_its_cache_does_not_hold() -> None:
    engine = make_engine("echo", prefill_s_per_token=1e-5)
    assert isinstance(engine, EchoEngine)
    first = await engine.generate("t1", turn(PROMPT), session_id="s")
    assert (first.cached_tokens, engine.prefill_tokens) == (0, len(PROMPT))
    context = PROMPT + first.outputs[0].token_ids + [1, 2, 3]
    second = await engine.generate("t2", turn(context), session_id="s")
    held = len(PROMPT) + 6 - 1  # as a real engine: the last output token's KV is never computed
    assert (second.cached_tokens, second.cache_rebuilt) == (held, False)
    assert engine.prefill_tokens == len(PROMPT) + len(context) - held
    plain = await engine.generate("p", turn(context))  # no session: the whole prompt, every time
    assert plain.cached_tokens == 0 and engine.prefill_tokens == len(PROMPT) + 2 * len(context) - held
    stats = engine.session_cache_stats()
    assert stats is not None and (stats.entries, stats.hits, stats.misses) == (1, 1, 1)
    assert stats.bytes == 4 * (len(context) + 6 - 1)


async def test_an_activation_makes_the_cache_stale_and_end_session_forgets_it() -> None:
    engine = EchoEngine()
    first = await engine.generate("t1", turn(PROMPT), session_id="s")
    await engine.pause()
    await engine.load_weights(None, ["w"], 1)
    await engine.resume()
    context = PROMPT + first.outputs[0].token_ids
    second = await engine.generate("t2", turn(context), session_id="s")
    assert (second.cached_tokens, second.cache_rebuilt) == (0, True)
    third = await engine.generate("t3", turn(context + second.outputs[0].token_ids), session_id="s")
    assert (third.cached_tokens, third.cache_rebuilt) == (len(context) + 5, False)
    await engine.end_session("s")
    fourth = await engine.generate("t4", turn(context + second.outputs[0].token_ids), session_id="s")
    assert (fourth.cached_tokens, fourth.cache_rebuilt) == (0, False)


async def test_n_samples_leave_a_branch_each_and_the_next_turn_continues_the_longest_match() -> None:
    engine = EchoEngine()
    first = await engine.generate("t1", turn(PROMPT, n=3), session_id="s")
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    chosen = first.outputs[1].token_ids
    second = await engine.generate("t2", turn(PROMPT + chosen + [7]), session_id="s")
    assert second.cached_tokens == len(PROMPT) + len(chosen) - 1
    stats = engine.session_cache_stats()
    assert stats is not None and stats.entries == 1 and stats.hits == 1
