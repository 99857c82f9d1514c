"""``schemas.progress.Replay``: the one reading of a resumable job's progress records, shared by
the worker that resumes a job and the trainer that streams it. Every record that does not
continue the job's output exactly where it stands is refused with ``CorruptCheckpoint``."""

from __future__ import annotations

import pytest

from rollfleet.schemas import Completion, RolloutResult, VersionSpan, decode, encode
from rollfleet.schemas.errors import CorruptCheckpoint, InvalidRequest
from rollfleet.schemas.progress import (
    MAC_HEADER,
    DoneRecord,
    ProgressRecord,
    Replay,
    ResumeRecord,
    SampleDelta,
    TokensRecord,
    record_mac,
    sealed,
)


def delta(start: int, n: int, *, index: int = 0, version: int = 0, replica: str = "a", **kw) -> SampleDelta:
    return SampleDelta(
        index=index,
        start=start,
        token_ids=list(range(start, start + n)),
        logprobs=[-0.5] * n,
        spans=[VersionSpan(version=version, start=start, end=start + n, replica=replica)],
        **kw,
    )


def tokens(*deltas: SampleDelta, run: str = "r1") -> TokensRecord:
    return TokensRecord(run=run, samples=list(deltas))


def fresh(n: int = 2, max_tokens: int = 50) -> Replay:
    return Replay(n, max_tokens, logprobs=True)


def test_records_round_trip_and_rebuild_the_output_with_spans_per_replica() -> None:
    replay = fresh()
    for record in [
        tokens(delta(0, 10), delta(0, 4, index=1)),
        tokens(delta(10, 5)),
        ResumeRecord(run="r2", worker_id="b", kept=[15, 4]),
        tokens(delta(15, 5, replica="b", version=1), delta(4, 2, index=1, replica="b", finish="stop"), run="r2"),
    ]:
        replay.apply(decode(encode(record), ProgressRecord))
    s0, s1 = replay.samples
    assert s0.token_ids == list(range(20)) and s0.finish is None and s1.finish == "stop"
    assert s0.spans == [
        VersionSpan(version=0, start=0, end=15, replica="a"),
        VersionSpan(version=1, start=15, end=20, replica="b"),
    ]
    assert replay.kept == [20, 6] and replay.tokens == 26 and replay.runs == ["r1", "r2"]


def test_a_resume_keeping_less_rewinds_and_tokens_then_continue_from_there() -> None:
    replay = fresh(1)
    replay.apply(tokens(delta(0, 10)))
    chunks = replay.apply(ResumeRecord(run="r2", worker_id="b", kept=[0], reason="corrupt"))
    assert [(c.start, c.rewound) for c in chunks] == [(0, True)] and replay.kept == [0]
    replay.apply(tokens(delta(0, 3, replica="b"), run="r2"))
    assert replay.samples[0].spans == [VersionSpan(version=0, start=0, end=3, replica="b")]


@pytest.mark.parametrize(
    ("records", "says"),
    [
        ([tokens(delta(0, 5)), tokens(delta(7, 5))], "gap or an overlap"),
        ([tokens(delta(0, 5)), tokens(delta(3, 5))], "gap or an overlap"),
        ([tokens(delta(0, 5, index=2))], "sample 2 of a job with 2"),
        ([tokens(delta(0, 51))], "over the job's max_tokens"),
        ([tokens(SampleDelta(index=0, start=0, token_ids=[1, 2], logprobs=[0.0]))], "log-probs"),
        ([tokens(SampleDelta(index=0, start=0, token_ids=[1, 2], logprobs=[0.0, 0.0]))], "version spans"),
        ([tokens(SampleDelta(index=0, start=0, token_ids=[-1], logprobs=[0.0]))], "negative token"),
        ([tokens(delta(0, 5, finish="stop")), tokens(delta(5, 1))], "after sample 0 finished"),
        ([tokens(delta(0, 5)), ResumeRecord(run="r", worker_id="b", kept=[6, 0])], "keeps 6 tokens"),
        ([ResumeRecord(run="r", worker_id="b", kept=[0])], "for 1 samples"),
        ([DoneRecord(run="r"), tokens(delta(0, 1))], "after the job's done record"),
    ],
)
def test_records_that_do_not_continue_the_output_are_refused(records: list, says: str) -> None:
    replay = fresh()
    with pytest.raises(CorruptCheckpoint, match=says) as info:
        for record in records:
            replay.apply(record)
    assert not info.value.retryable and info.value.code == "corrupt_checkpoint"


def test_undecodable_and_mistyped_records_are_typed_errors() -> None:
    for data in (b"\xc1", encode({"type": "tokens", "run": 5, "samples": []}), encode({"type": "nope"})):
        with pytest.raises(InvalidRequest):
            decode(data, ProgressRecord, what="progress record")


def test_a_record_is_the_jobs_only_with_its_mac_over_its_exact_bytes() -> None:
    """The MAC is keyed by the job id (which only the job's replicas and client know): another
    job's key, a flipped byte, a missing or made-up header all fail; the right one passes."""
    data = encode(tokens(delta(0, 3)))
    mac = record_mac("job-1", data)
    assert sealed("job-1", data, {MAC_HEADER: mac})
    assert not sealed("job-2", data, {MAC_HEADER: mac})
    assert not sealed("job-1", data[:-1] + bytes([data[-1] ^ 1]), {MAC_HEADER: mac})
    assert not sealed("job-1", data, {}) and not sealed("job-1", data, None)
    assert not sealed("job-1", data, {MAC_HEADER: "0" * len(mac)})
    assert b"job-1" not in data  # a record names no job: reading one reveals no job id


def _answer(*samples: tuple[list[int], str]) -> RolloutResult:
    outs = [
        Completion(
            token_ids=ids,
            finish_reason=finish,  # type: ignore[arg-type]
            logprobs=[-0.5] * len(ids),
            weight_versions=[VersionSpan(version=0, start=0, end=len(ids), replica="a")],
        )
        for ids, finish in samples
    ]
    return RolloutResult(
        job_id="j", idempotency_key="k", client_id="c", outputs=outs, version_start=0, version_end=0,
        worker_id="a", engine="echo", queue_wait_s=0.0, generation_s=0.0, delivery_attempt=1, finished_at=0.0,
    )  # fmt: skip


@pytest.mark.parametrize("streamed", [(0, 0), (10, 0), (25, 7), (30, 12)])
def test_a_stream_that_lags_the_answer_takes_the_rest_from_it_each_token_once(streamed: tuple[int, int]) -> None:
    """``streaming._rest``, the end-of-job catch-up: a stream that read only part of the
    checkpoints when the answer came (nothing, some of each sample, all of one) ends with exactly
    the answer's tokens past what it yielded, with their log-probs, spans and finish: put together,
    the answer, each token once; nothing at all once the checkpoints carried everything."""
    from rollfleet.trainer_client.streaming import _rest

    answer = _answer((list(range(30)), "length"), (list(range(12)), "stop"))
    replay, chunks = fresh(), []
    for i, upto in enumerate(streamed):
        if upto:
            finish = answer.outputs[i].finish_reason if upto == len(answer.outputs[i].token_ids) else None
            chunks += replay.apply(tokens(delta(0, upto, index=i, finish=finish)))
    rest = _rest(replay, answer)
    assert not any(c.rewound for c in rest)
    joined: list[list[int]] = [[], []]
    for c in [*chunks, *rest]:
        assert c.start == len(joined[c.index])  # no gap, no token twice
        joined[c.index] += c.token_ids
    assert joined == [out.token_ids for out in answer.outputs]
    for c in rest:
        out = answer.outputs[c.index]
        assert c.logprobs == out.logprobs[c.start :] and c.finish == out.finish_reason
        assert c.spans == [VersionSpan(version=0, start=c.start, end=len(out.token_ids), replica="a")]
    assert len(rest) == sum(1 for i, upto in enumerate(streamed) if upto < len(answer.outputs[i].token_ids))


def test_a_stream_whose_checkpoints_differ_from_the_answer_rewinds_to_where_they_part() -> None:
    """Tokens streamed that the answer does not have (a run whose checkpoints were given up) are
    rewound from where they part, and the answer's tokens follow from there."""
    from rollfleet.trainer_client.streaming import _rest

    replay = fresh(1)
    replay.apply(tokens(SampleDelta(index=0, start=0, token_ids=[0, 1, 2, 99], logprobs=[0.0] * 4,
                                    spans=[VersionSpan(version=0, start=0, end=4, replica="a")])))  # fmt: skip
    rest = _rest(replay, _answer((list(range(8)), "length")))
    assert [(c.start, c.rewound, c.token_ids) for c in rest] == [(3, True, []), (3, False, [3, 4, 5, 6, 7])]


def test_a_resumable_jobs_claim_is_its_holders_only_with_the_jobs_mac() -> None:
    """A sealed claim reads back as its holder and time, for the job it was sealed for only; what
    any ``Claim`` reader sees of it (worker, time) is unchanged; a claim written by someone without
    the job id (none, another job's, a made-up one) or marked stopped since is nobody's."""
    from rollfleet.schemas import Claim
    from rollfleet.schemas.progress import open_claim, seal_claim

    claim = Claim("w1:42-abcd", 1_700_000_000.25)
    value = seal_claim("job-1", claim)
    assert open_claim("job-1", value) == claim
    assert Claim.decode(value).worker_id == "w1" and Claim.decode(value).refreshed == claim.refreshed
    assert open_claim("job-2", value) is None
    assert open_claim("job-1", claim.encode()) is None  # a plain claim (a rogue's, fresh as it likes)
    assert open_claim("job-1", value.replace(b"@1700000000.250", b"@1800000000.250")) is None  # moved on
    assert open_claim("job-1", Claim.decode(value)._replace(refreshed=0.0).encode()) is None  # marked stopped
    assert open_claim("job-1", None) is None and open_claim("job-1", b"garbage") is None


def test_the_broker_giving_up_on_a_message_names_its_sequence() -> None:
    from rollfleet.broker.topology import given_up_seq

    advisory = (
        b'{"type":"io.nats.jetstream.advisory.v1.max_deliver","id":"x","timestamp":"2026-01-01T00:00:00Z",'
        b'"stream":"RF_NS_JOBS","consumer":"min-0","stream_seq":17,"deliveries":10}'
    )
    assert given_up_seq(advisory) == 17
    assert given_up_seq(b"{}") is None and given_up_seq(b"not json") is None
    assert given_up_seq(b"[" * 100_000) is None  # deeply nested: refused, not a RecursionError
