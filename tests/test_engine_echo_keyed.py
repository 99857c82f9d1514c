"""The keyed echo engine: tokens that are a function of the weights it holds (issue 30).

Pure tests of the token function (milliseconds), and the engine in this process on a real
safetensors checkpoint: its tokens follow the bytes it loaded, not the version it is told.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.weights import tensors_at, write_base_checkpoint
from reliability.adversary.truth import recompute, tensors_key
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.workers.engines.echo import EchoEngine
from rollfleet.workers.engines.keyed import VOCAB, context_state, keyed_token, keyed_tokens, weights_key

KEY0 = bytes(range(32))
KEY1 = bytes(range(1, 33))


def _raw(tensors: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {n: t.tobytes() for n, t in tensors.items()}


def test_the_engine_key_and_the_oracles_own_key_agree_and_see_every_byte_and_name() -> None:
    tensors = tensors_at(0)
    assert weights_key(_raw(tensors)) == tensors_key(tensors)  # two implementations of one rule
    name = sorted(tensors)[1]
    flipped = {**tensors, name: tensors[name].copy()}
    flipped[name].reshape(-1)[-1] += 1.0
    assert weights_key(_raw(flipped)) != weights_key(_raw(tensors))
    renamed = {("x." + n if n == name else n): t for n, t in tensors.items()}
    assert weights_key(_raw(renamed)) != weights_key(_raw(tensors))
    assert weights_key(_raw(tensors_at(1))) != weights_key(_raw(tensors))


def test_tokens_depend_on_the_key_the_context_and_the_stream() -> None:
    prompt = [3, 1, 4, 1, 5]
    a = keyed_tokens(KEY0, prompt, 40, seed=None, sample=0, vocab=VOCAB)
    assert a == keyed_tokens(KEY0, prompt, 40, seed=None, sample=0, vocab=VOCAB)  # deterministic
    assert all(0 <= t < VOCAB for t in a)
    differs = [(x != y) for x, y in zip(a, keyed_tokens(KEY1, prompt, 40, seed=None, sample=0, vocab=VOCAB),
                                        strict=True)]
    assert sum(differs) >= 38  # other weights: other tokens (a collision is 1 in 32,000)
    # Every token depends on the whole context: another prompt of the same length, differing in
    # its first token only, has no token in common position after position (bar 1-in-32,000 odds).
    other = keyed_tokens(KEY0, [2, 1, 4, 1, 5], 40, seed=None, sample=0, vocab=VOCAB)
    assert sum(x == y for x, y in zip(a, other, strict=True)) <= 2
    tail = a[20:]  # ... even where it is continued from the same recent tokens
    assert keyed_tokens(KEY0, [2, 1, 4, 1, 5, *a[:20]], 20, seed=None, sample=0, vocab=VOCAB) != tail
    assert keyed_tokens(KEY0, prompt + a[:20], 20, seed=None, sample=0, vocab=VOCAB) == tail
    samples = [keyed_tokens(KEY0, prompt, 40, seed=None, sample=i, vocab=VOCAB) for i in range(3)]
    assert len({tuple(s) for s in samples}) == 3  # samples of one request differ
    assert keyed_tokens(KEY0, prompt, 40, seed=7, sample=0, vocab=VOCAB) != a  # a seed is another stream
    # A seeded sample i is the stream seed + i: a request sent alone with that seed continues it.
    assert keyed_tokens(KEY0, prompt, 40, seed=7, sample=2, vocab=VOCAB) == keyed_tokens(
        KEY0, prompt, 40, seed=9, sample=0, vocab=VOCAB
    )


@pytest.mark.parametrize(("seed", "sample"), [(None, 0), (None, 1), (11, 0)])
def test_a_resumed_generation_continues_the_same_function(seed: int | None, sample: int) -> None:
    """Resumed, a sample is sent alone (n=1, its index 0) with the prompt and its kept tokens
    as one prompt; the engine cannot tell where the prompt ended, and needs not."""
    prompt = [9, 8, 7]
    whole = keyed_tokens(KEY0, prompt, 30, seed=seed, sample=sample, vocab=VOCAB)
    kept = whole[:12]
    resumed_seed = None if seed is None else seed + sample  # (a seeded sample goes on its own stream)
    rest = keyed_tokens(KEY0, prompt + kept, 18, seed=resumed_seed, sample=0, vocab=VOCAB)
    assert kept + rest == whole
    # ... and what the oracle recomputes, token by token, from the answer as given, agrees.
    answer = [keyed_tokens(KEY0, prompt, 30, seed=seed, sample=i, vocab=VOCAB) for i in range(sample)] + [kept + rest]
    verdict = recompute(lambda v: KEY0, prompt, answer, [[[1, 0, 30]]] * len(answer), seed=seed)
    assert verdict.checked == 30 * len(answer) and verdict.mismatches == []


def test_an_unseeded_sample_resumed_before_its_first_token_is_not_flagged() -> None:
    """Sample 1 of an unseeded request, resumed with no token kept, is sent alone: the engine
    cannot know its index and makes it as sample 0. Not a mislabel; a seeded one has no excuse."""
    prompt = [4, 2]
    alone = keyed_tokens(KEY0, prompt, 12, seed=None, sample=0, vocab=VOCAB)
    spans = [[[0, 0, 12]], [[0, 0, 12]]]
    assert recompute(lambda v: KEY0, prompt, [alone, alone], spans, seed=None).mismatches == []
    seeded = keyed_tokens(KEY0, prompt, 12, seed=5, sample=0, vocab=VOCAB)
    assert len(recompute(lambda v: KEY0, prompt, [seeded, seeded], spans, seed=5).mismatches) == 1
    # Its first token is sample 0's or its own (sample 0's + 1); any other is still flagged.
    for first, flagged in ((alone[0], 0), ((alone[0] + 1) % VOCAB, 0), ((alone[0] + 2) % VOCAB, 1)):
        verdict = recompute(lambda v: KEY0, prompt, [alone[:1], [first]], [[[0, 0, 1]]] * 2, seed=None)
        assert len(verdict.mismatches) == flagged, first


def test_recompute_flags_tokens_of_other_weights_and_names_whose_they_are() -> None:
    prompt = [1, 2, 3]
    keys = {0: KEY0, 1: KEY1}
    first = keyed_tokens(KEY0, prompt, 10, seed=None, sample=0, vocab=VOCAB)
    rest = [keyed_token(KEY1, context_state(prompt + first), seed=None, sample=0, first=False, vocab=VOCAB)]
    tokens = first + rest
    good = recompute(keys.__getitem__, prompt, [tokens], [[[0, 0, 10], [1, 10, 11]]], seed=None, versions=[0, 1])
    assert good.checked == 11 and good.mismatches == []  # an activation between tokens 9 and 10
    off = recompute(keys.__getitem__, prompt, [tokens], [[[1, 0, 10], [1, 10, 11]]], seed=None, versions=[0, 1])
    assert [(m.version, m.start, m.end, m.bad, m.first, m.fits) for m in off.mismatches] == [(1, 0, 10, 10, 0, (0,))]
    short = recompute(keys.__getitem__, prompt, [tokens[:5]], [[[0, 0, 10]]], seed=None)
    assert len(short.mismatches) == 1  # a span over tokens the answer does not have
    skipped = recompute(keys.__getitem__, prompt, [tokens], [[[1, 0, 11]]], seed=None, keyed=lambda i, k: False)
    assert skipped.checked == 0 and skipped.skipped == 11 and not skipped.mismatches


async def test_the_engine_keys_its_tokens_by_the_bytes_it_holds_not_the_version_it_is_told(tmp_path: Path) -> None:
    ckpt = write_base_checkpoint(tmp_path / "ckpt")
    engine = EchoEngine(keyed=True)
    await engine.start(ckpt, 0)
    payload = RolloutPayload(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=16), n=2)
    v0 = weights_key(_raw(tensors_at(0)))
    out = await engine.generate("r0", payload)
    assert [c.token_ids for c in out.outputs] == [
        keyed_tokens(v0, [5, 6, 7], 16, seed=None, sample=i, vocab=VOCAB) for i in range(2)
    ]
    # The file changes on disk, but the engine reloads nothing (no tensor named as changed): it
    # still holds v0's bytes and says "v1". Its tokens say what it holds.
    from safetensors.numpy import save_file

    v1_tensors = tensors_at(1)
    save_file(v1_tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    await engine.pause()
    await engine.load_weights(ckpt, [], 1)
    await engine.resume()
    labelled = await engine.generate("r1", payload)
    assert [c.token_ids for c in labelled.outputs] == [c.token_ids for c in out.outputs]
    # Reloading what changed makes the tokens v1's, in the step loop too (a token latency).
    await engine.pause()
    await engine.load_weights(ckpt, sorted(v1_tensors), 1)
    await engine.resume()
    v1 = weights_key(_raw(v1_tensors))
    engine.per_token_s = 0.001
    stepped = await engine.generate("r2", payload)
    assert [c.token_ids for c in stepped.outputs] == [
        keyed_tokens(v1, [5, 6, 7], 16, seed=None, sample=i, vocab=VOCAB) for i in range(2)
    ]


async def test_a_keyed_engine_without_weights_is_refused_and_plain_echo_is_unchanged() -> None:
    with pytest.raises(InvalidRequest):
        await EchoEngine(keyed=True).start(None, 0)
    plain = EchoEngine()
    await plain.start(None, 0)
    out = await plain.generate("r", RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=3)))
    assert out.outputs[0].token_ids == [3, 4, 5]  # (sum(prompt) + i) % vocab, as before
