"""``schemas.progress.Replay``: the one reading of a resumable job's progress records, shared by
the worker that resumes a job and the trainer that streams it. Every record that does not
continue the job's output exactly where it stands is refused with ``CorruptCheckpoint``."""

from __future__ import annotations

import pytest

from rollfleet.schemas import VersionSpan, decode, encode
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
