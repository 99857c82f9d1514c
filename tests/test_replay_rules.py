"""The replay coordinate's wire form and the pure decisions of a replay (milliseconds, no I/O)."""

from __future__ import annotations

import msgspec
import pytest

from rollfleet.schemas import (
    Completion,
    EngineBuild,
    ReplayCoordinate,
    RolloutResult,
    SamplingParams,
    VersionDigest,
    VersionSpan,
    decode_outcome,
    encode,
    prompt_digest,
)
from rollfleet.schemas.errors import NotReplayable
from rollfleet.schemas.replay_rules import (
    first_divergence,
    judge_replay,
    judge_segments,
    parts_differ,
    replay_request,
    replay_segments,
)

PROMPT = [5, 6, 7, 8]
DIGEST = bytes(range(8))
BUILD = EngineBuild("hf", "5.25.0", "2.13.0+cpu", "float32", "cpu", True)


def coordinate(seed: int | None = 40, build: EngineBuild = BUILD, digest: bytes = DIGEST) -> ReplayCoordinate:
    return ReplayCoordinate(
        prompt=prompt_digest(PROMPT),
        sampling=SamplingParams(max_tokens=4, seed=seed),
        versions=(VersionDigest(3, digest),),
        replica="hf0",
        build=build,
    )


def sample(tokens: list[int], logprobs: list[float], spans: list[VersionSpan] | None = None) -> Completion:
    spans = spans if spans is not None else [VersionSpan(version=3, start=0, end=len(tokens))]
    return Completion(token_ids=tokens, finish_reason="length", logprobs=logprobs, weight_versions=spans)


def result(*outputs: Completion, replay: ReplayCoordinate | None = None, resumes: int = 0) -> RolloutResult:
    return RolloutResult(
        job_id="j", idempotency_key="k", client_id="c", outputs=list(outputs), version_start=3, version_end=3,
        worker_id="hf0", engine="hf", queue_wait_s=0.0, generation_s=0.0, delivery_attempt=1, finished_at=0.0,
        replay=replay if replay is not None else coordinate(), resumes=resumes,
    )  # fmt: skip


A = sample([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0])
SPAN_4 = VersionSpan(version=4, start=1, end=2)
B = sample([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.5])


def test_a_result_round_trips_with_its_coordinate_and_one_stored_before_decodes_without() -> None:
    r = result(A, A)
    assert decode_outcome(encode(r)) == r
    old = msgspec.structs.asdict(r)
    del old["replay"]  # what a replica of the version before stored
    decoded = decode_outcome(msgspec.msgpack.encode({"type": "result", **old}))
    assert isinstance(decoded, RolloutResult) and decoded.replay is None


def test_parts_differ_names_each_part_and_never_the_replica() -> None:
    base = coordinate()
    assert parts_differ(base, msgspec.structs.replace(base, replica="hf9")) == ()
    assert parts_differ(base, coordinate(seed=41)) == ("seed",)
    assert parts_differ(base, coordinate(digest=b"\0" * 8)) == ("version_digest",)
    other = msgspec.structs.replace(BUILD, version="5.26.0")
    assert parts_differ(base, coordinate(build=other)) == ("engine_build",)
    assert parts_differ(base, coordinate(build=msgspec.structs.replace(BUILD, deterministic=False))) == (
        "deterministic",
    )
    assert parts_differ(base, msgspec.structs.replace(base, prompt=prompt_digest([5, 6, 7]))) == ("prompt",)


def test_first_divergence_compares_floats_by_their_bits() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([0.0, -1.0], [-0.0, -1.0]) == 0  # equal as numbers, not as bits
    assert first_divergence([float("nan")], [float("nan")]) is None
    assert first_divergence([-1.0, -2.0], [-1.0, -2.0000000000000004]) == 1


def test_a_request_asks_for_the_samples_own_stream_at_its_version_in_deterministic_mode() -> None:
    req = replay_request(result(A, B), index=1)
    assert (req.version, req.sampling.seed, req.sampling.max_tokens) == (3, 41, 4)  # sample_seed(40, 1)
    assert (req.n, req.pick) == (1, 0)
    assert req.expected.build.deterministic and req.expected.versions == (VersionDigest(3, DIGEST),)


@pytest.mark.parametrize(
    ("built", "reason"),
    [
        (result(sample([1, 2], [-1.0, -1.0], [VersionSpan(version=3, start=0, end=1), SPAN_4])), "multi_span"),
        (result(A, resumes=1), "resumed"),
        (result(A, replay=coordinate(seed=None)), "unseeded"),
    ],
)  # fmt: skip
def test_what_cannot_be_replayed_is_refused_naming_why(built: RolloutResult, reason: str) -> None:
    with pytest.raises(NotReplayable) as err:
        replay_request(built, 0, prompt=PROMPT)  # (one request: a sample made in two is multi_span)
    assert err.value.reason == reason and not err.value.retryable


def test_an_unseeded_echo_sample_is_replayable_its_tokens_need_no_stream() -> None:
    echo = coordinate(seed=None, build=EngineBuild("echo", "0.1.0", deterministic=True))
    req = replay_request(result(A, A, A, replay=echo), 2)  # echo's samples go by their index: 3 again
    assert (req.sampling.seed, req.n, req.pick) == (None, 3, 2)
    with pytest.raises(NotReplayable):
        replay_request(msgspec.structs.replace(result(A), replay=None), 0)


def test_judging_a_replay_names_where_it_diverged_and_which_part_differs() -> None:
    original = result(A)
    req = replay_request(original, 0)
    served = msgspec.structs.replace(req.expected, replica="hf1")
    ok = judge_replay(req, A, A, served, original.replay)  # type: ignore[arg-type]
    assert ok.matched and ok.first_token is None and ok.differs == () and ok.replica == "hf1"
    drift = judge_replay(req, A, B, served, original.replay)  # type: ignore[arg-type]
    assert not drift.matched and (drift.first_token, drift.first_logprob) == (None, 3)
    # A replica with another build, a version re-created with other bytes: named even where every bit matched.
    other = msgspec.structs.replace(served, build=msgspec.structs.replace(served.build, torch="2.14.0"))
    assert judge_replay(req, A, A, other, original.replay).differs == ("engine_build",)  # type: ignore[arg-type]
    moved = msgspec.structs.replace(served, versions=(VersionDigest(3, b"\1" * 8),))
    assert judge_replay(req, A, A, moved, original.replay).differs == ("version_digest",)  # type: ignore[arg-type]
    store = judge_replay(req, A, A, served, original.replay, store_digest=b"\2" * 8)  # type: ignore[arg-type]
    assert not store.matched and store.differs == ("version_digest",)
    assert judge_replay(req, A, A, None, original.replay).differs == ("engine_build", "deterministic")  # type: ignore[arg-type]


def test_a_replay_asked_under_an_altered_coordinate_names_the_alteration() -> None:
    original = result(A)
    altered = coordinate(seed=7)
    req = replay_request(original, 0, altered)
    served = msgspec.structs.replace(req.expected, replica="hf0")
    out = judge_replay(req, A, B, served, original.replay)  # type: ignore[arg-type]
    assert out.differs == ("seed",) and not out.matched
    # An original generated batched that a deterministic replay does not reproduce: the mode is named.
    batched = coordinate(build=msgspec.structs.replace(BUILD, deterministic=False))
    req = replay_request(result(A, replay=batched), 0)
    out = judge_replay(req, A, B, msgspec.structs.replace(req.expected), batched)
    assert out.differs == ("deterministic",) and out.first_logprob == 3
    same = judge_replay(req, A, A, msgspec.structs.replace(req.expected), batched)
    assert same.matched  # bit for bit the same: the original's mode does not matter


def test_a_resumed_sample_is_replayed_segment_by_segment_each_as_its_request_was_made() -> None:
    """Kept tokens [0, 2) made at version 3 by the first run (one request of the job's samples);
    the run that resumed it made [2, 4) at version 4 as a request of its own (a restart): the
    prompt and the two kept tokens forced, its stream seeded anew at its own seed."""
    spans = [VersionSpan(version=3, start=0, end=2, replica="a"), VersionSpan(version=4, start=2, end=4, replica="b")]
    made = sample([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], spans)
    coord = msgspec.structs.replace(coordinate(), versions=(VersionDigest(3, b""), VersionDigest(4, DIGEST)),
                                    restarts=((), (2,)))  # fmt: skip
    resumed = result(made, made, replay=coord, resumes=1)
    first, then = replay_segments(resumed, 1, prompt=PROMPT)
    assert (first.start, first.end, first.version, first.restart, first.prompt) == (0, 2, 3, False, tuple(PROMPT))
    assert (first.sampling.seed, first.sampling.max_tokens, first.n, first.pick) == (41, 2, 1, 0)
    assert (then.start, then.end, then.version, then.restart, then.prompt) == (2, 4, 4, True, (*PROMPT, 1, 2))
    assert (then.sampling.seed, then.sampling.max_tokens) == (41, 2)
    assert then.expected.prompt == prompt_digest([*PROMPT, 1, 2])
    assert then.expected.versions == (VersionDigest(4, DIGEST),)
    # Sample 0 had no restart: its tokens from 2 on ran on in one sampled stream across the
    # activation. On hf, replayed as that request was, its stream advanced past the 2 draws before.
    whole, across = replay_segments(resumed, 0, prompt=PROMPT)
    assert (whole.start, whole.end, whole.stream_offset) == (0, 2, 0)
    assert (across.start, across.end, across.version, across.restart) == (2, 4, 4, False)
    assert across.prompt == (*PROMPT, 1, 2)
    assert (across.sampling.seed, across.stream_offset, across.n, across.pick) == (40, 2, 1, 0)
    # An engine that takes no offset (vLLM, SGLang), or echo, whose tokens go by their place: refused, naming it.
    for engine in ("vllm", "sglang", "echo"):
        other = msgspec.structs.replace(coord, build=msgspec.structs.replace(BUILD, engine=engine))
        with pytest.raises(NotReplayable) as err:
            replay_segments(result(made, made, replay=other, resumes=1), 0, prompt=PROMPT)
        assert err.value.reason == "multi_span"
        assert f"past 2 tokens' draws, which {engine} does not" in err.value.message
    # Greedy: no stream to advance, so a segment at an activation is replayable from its tokens.
    greedy = msgspec.structs.replace(coord, sampling=SamplingParams(max_tokens=4, temperature=0.0))
    assert [r.start for r in replay_segments(result(made, replay=greedy), 0, prompt=PROMPT)] == [0, 2]
    with pytest.raises(NotReplayable) as needs:
        replay_segments(resumed, 1)  # a later segment needs the prompt's ids
    assert needs.value.reason == "prompt"
    # Unseeded, the continuation drew a seed of its own: refused, naming it.
    with pytest.raises(NotReplayable, match="no record keeps") as unseeded:
        replay_segments(result(made, made, replay=msgspec.structs.replace(coord, sampling=SamplingParams()), resumes=1),
                        1, prompt=PROMPT)  # fmt: skip
    assert unseeded.value.reason == "unseeded"
    # Judged per segment; the first diverging token is the first over all, an offset in the sample.
    ok = judge_replay(first, made, sample([1, 2], [-1.0, -2.0]), first.expected, coord)
    drift = judge_replay(then, made, sample([3, 9], [-3.0, -4.0]), msgspec.structs.replace(then.expected, replica="b2"),
                         coord)  # fmt: skip
    assert ok.matched and drift.differs == () and drift.first_token == 1 and drift.start == 2
    whole = judge_segments([ok, drift])
    assert not whole.matched and whole.first_token == 3 and whole.first_logprob is None
    assert whole.segments == (ok, drift) and whole.tokens == 4
