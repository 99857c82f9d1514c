"""The contract: messages round-trip, decode validates, names and errors are stable."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.schemas import (
    Completion,
    JobAddress,
    Names,
    ReplicaStatus,
    RolloutFailure,
    RolloutJob,
    RolloutJobWire,
    RolloutPayload,
    RolloutResult,
    SamplingParams,
    VersionActivated,
    VersionConstraint,
    VersionPublished,
    VersionRecord,
    check_job,
    decode,
    decode_event,
    decode_outcome,
    encode,
    error_from_code,
    key_token,
)
from rollfleet.schemas import errors as E


def _job(**kw: object) -> RolloutJob:
    base = dict(
        job_id="j1",
        idempotency_key="step1/g0/s0",
        client_id="trainer-0",
        constraint=VersionConstraint("min", 3),
        payload=RolloutPayload(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=8, temperature=0.7)),
        deadline=2e9,
        submitted_at=1.7e9,
    )
    base.update(kw)
    return RolloutJob(**base)  # type: ignore[arg-type]


def test_every_message_round_trips() -> None:
    result = RolloutResult(
        job_id="j",
        idempotency_key="k",
        client_id="c",
        outputs=[Completion(token_ids=[1, 2], finish_reason="length", logprobs=[-0.1, -0.2])],
        version_start=3,
        version_end=4,
        worker_id="w",
        engine="echo",
        queue_wait_s=0.1,
        generation_s=0.2,
        delivery_attempt=1,
        finished_at=1.0,
    )
    failure = RolloutFailure(idempotency_key="k", client_id="c", code="expired", message="late", retryable=True)
    status = ReplicaStatus(
        worker_id="w",
        state="ready",
        active_version=2,
        engine="echo",
        capacity=4,
        in_flight=1,
        heartbeat_at=1.0,
        heartbeat_interval_s=2.0,
        started_at=0.5,
    )
    record = VersionRecord(version=7, kind="delta", base_version=6, encoding="xor", checksum_format="xxh3-128")
    job = _job()
    assert decode(encode(job), RolloutJob) == job
    assert decode_outcome(encode(result)) == result
    assert decode_outcome(encode(failure)) == failure
    assert decode(encode(status), ReplicaStatus) == status
    assert decode(encode(record), VersionRecord) == record
    published = VersionPublished(record=record)
    activated = VersionActivated(
        worker_id="w",
        version=7,
        previous_version=6,
        prepare_s=1,
        pause_s=0.01,
        wire_bytes=10,
        density=0.01,
        activated_at=2.0,
    )
    assert decode_event(encode(published)) == published
    assert decode_event(encode(activated)) == activated


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"\xc1\xff not msgpack", "not valid MessagePack"),
        (encode({"job_id": 5}), "invalid field"),
        (encode({**msgspec.to_builtins(_job()), "deadline": "tomorrow"}), "deadline"),
        (encode({**msgspec.to_builtins(_job()), "constraint": {"kind": "max", "version": 1}}), "invalid field"),
    ],
)
def test_decode_rejects_bad_input_with_a_typed_error(data: bytes, fragment: str) -> None:
    with pytest.raises(E.InvalidRequest) as info:
        decode(data, RolloutJob)
    assert fragment in info.value.message
    assert info.value.retryable is False


def test_decode_rejects_oversized_before_parsing() -> None:
    with pytest.raises(E.InvalidRequest, match="over the limit"):
        decode(b"\x00" * 2000, RolloutJob, max_bytes=1000)


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (RolloutPayload(), "exactly one"),
        (RolloutPayload(prompt_token_ids=[1], prompt_text="x"), "exactly one"),
        (RolloutPayload(prompt_token_ids=[]), "empty"),
        (RolloutPayload(prompt_token_ids=[-1]), "non-negative"),
        (RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(temperature=-1)), "temperature"),
        (RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(temperature=float("nan"))), "temperature"),
        (RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(top_p=0)), "top_p"),
        (RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=0)), "max_tokens"),
        (RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(top_k=-2)), "top_k"),
        (RolloutPayload(prompt_token_ids=[1], n=0), "n must be"),
        (RolloutPayload(prompt_token_ids=list(range(40_000))), "over the limit"),
        (RolloutPayload(prompt_token_ids=[1], stream_offset=-1, sampling=SamplingParams(seed=1)), "stream_offset"),
        (RolloutPayload(prompt_token_ids=[1], stream_offset=40_000, sampling=SamplingParams(seed=1)), "stream_offset"),
        (RolloutPayload(prompt_token_ids=[1], stream_offset=3), "give sampling.seed"),
    ],
)
def test_impossible_payloads_are_invalid(payload: RolloutPayload, fragment: str) -> None:
    with pytest.raises(E.InvalidRequest, match=fragment):
        check_job(_job(payload=payload))


def test_a_stream_offset_is_a_replays_one_request_never_a_resumable_jobs() -> None:
    """A run that takes a resumable job over seeds its continuation anew, past no draws."""
    offset = RolloutPayload(prompt_token_ids=[1, 2], stream_offset=2, sampling=SamplingParams(seed=5))
    check_job(_job(payload=offset))
    with pytest.raises(E.InvalidRequest, match="resumable"):
        check_job(_job(payload=offset, retry_policy="resume"))


def test_constraints() -> None:
    assert VersionConstraint("min", 3).allows(3) and VersionConstraint("min", 3).allows(9)
    assert not VersionConstraint("min", 3).allows(2)
    assert VersionConstraint("exact", 3).allows(3) and not VersionConstraint("exact", 3).allows(4)


def test_replica_liveness_and_compatibility() -> None:
    s = ReplicaStatus(
        worker_id="w",
        state="ready",
        active_version=2,
        engine="echo",
        capacity=1,
        in_flight=0,
        heartbeat_at=100.0,
        heartbeat_interval_s=1.0,
        started_at=0.0,
        preparing_version=4,
    )
    assert s.is_live(now=102.0) and not s.is_live(now=104.0)
    assert s.can_serve(VersionConstraint("exact", 2))
    assert s.can_serve(VersionConstraint("exact", 4))  # preparing counts
    assert not s.can_serve(VersionConstraint("exact", 3))
    s.state = "draining"
    assert not s.can_serve(VersionConstraint("min", 0))


def test_a_follower_will_serve_every_committed_min_version_a_held_replica_only_its_own() -> None:
    """A replica following ``latest`` still preparing version 3 (a slow read) while 5 is committed
    will serve ``min 5``: refusing it (NoCompatibleReplica at once) refused jobs the fleet was
    about to take. Not past what is committed, nor on a replica held at its version, nor exact."""
    follower = ReplicaStatus(worker_id="f", state="activating", active_version=2, engine="echo", capacity=1,
                             in_flight=0, heartbeat_at=100.0, heartbeat_interval_s=1.0, started_at=0.0,
                             preparing_version=3)  # fmt: skip
    assert not follower.can_serve(VersionConstraint("min", 5))
    assert follower.will_serve(VersionConstraint("min", 5), latest=5)
    assert not follower.will_serve(VersionConstraint("min", 6), latest=5)
    assert not follower.will_serve(VersionConstraint("min", 5), latest=None)
    assert not follower.will_serve(VersionConstraint("exact", 5), latest=5)
    held = msgspec.structs.replace(follower, held_version=2, preparing_version=None, state="ready")
    assert not held.will_serve(VersionConstraint("min", 5), latest=5)
    assert held.will_serve(VersionConstraint("min", 2), latest=5)
    leaving = msgspec.structs.replace(follower, state="draining")
    assert not leaving.will_serve(VersionConstraint("min", 5), latest=5)


def test_names_are_built_from_the_namespace() -> None:
    n = Names("run1")
    assert n.jobs_stream == "RF_RUN1_JOBS" and n.results_stream == "RF_RUN1_RESULTS"
    assert n.job_subject("min", 3) == "rf.run1.jobs.min.3" and n.job_consumer("exact", 5) == "exact-5"
    assert n.parse_job_subject("rf.run1.jobs.exact.5") == ("exact", 5)
    assert n.parse_job_subject("rf.run1.jobs.max.5") is None
    assert n.policy_bucket == "RF_RUN1_POLICY" and n.fleet_bucket == "RF_RUN1_FLEET"
    head = n.result_subject("trainer-0", "a.b/c d", "job1", "w1")
    assert head.startswith("rf.run1.results.trainer-0.") and head.endswith(".job1.w1")
    assert n.parse_result_subject(head) == ("trainer-0", key_token("a.b/c d"), "job1", "w1")
    # Keys and odd job ids never add tokens: a head always has the same shape, chunks two more.
    assert n.parse_result_subject(n.result_subject("t", "a.b.c", "x.y*", "w")) is not None
    chunk = n.result_chunk_subject(head, "n0nce", 3)
    assert n.is_result_chunk(chunk) and not n.is_result_chunk(head) and n.parse_result_subject(chunk) is None
    assert n.results_of_key("trainer-0", "a.b/c d") == head.rsplit(".", 2)[0] + ".*.*"
    # A replica's notice that it found a job answered hangs below its own answer subject, one token
    # down: neither an answer head nor a chunk, so no wildcard that gathers answers takes it.
    notice = n.answered_notice_subject(head)
    assert notice.startswith(head + ".") and n.is_answered_notice(notice)
    assert n.parse_result_subject(notice) is None and not n.is_result_chunk(notice)
    assert not n.is_answered_notice(head) and not n.is_answered_notice(chunk)
    assert not n.is_answered_notice(n.result_subject("t", "k", "job", "answered"))  # a replica of that name
    with pytest.raises(E.InvalidRequest):
        n.result_subject("t", "k", "job", "bad.worker")
    # A worker's inbox is its own, below the role's.
    assert n.inbox_prefix("worker", "w1") == "_INBOX.run1.worker.w1"
    assert n.inbox_prefix("trainer") == "_INBOX.run1.trainer"
    assert n.parse_replica_job_subject(n.replica_job_subject("w1")) == "w1"
    assert n.parse_replica_job_subject(n.job_subject("min", 1)) is None
    for bad in ("Run1", "a.b", "", "x*"):
        with pytest.raises(E.InvalidRequest):
            Names(bad)
    with pytest.raises(E.InvalidRequest):
        n.results_filter("bad.client")


def test_errors_have_stable_codes_and_retryable_flags() -> None:
    expected = {
        "no_compatible_replica": (E.NoCompatibleReplica, True),
        "expired": (E.Expired, True),
        "interrupted": (E.Interrupted, True),
        "invalid_request": (E.InvalidRequest, False),
        "checksum_mismatch": (E.ChecksumMismatch, False),
        "lineage_mismatch": (E.LineageMismatch, False),
    }
    for code, (cls, retryable) in expected.items():
        err = error_from_code(code, "m")
        assert type(err) is cls and err.code == code and err.retryable is retryable
        assert isinstance(err, E.RollfleetError)
    assert type(error_from_code("something-new", "m")) is E.InternalError


def test_version_spans_merge_runs_and_round_trip() -> None:
    from rollfleet.schemas import version_spans

    assert version_spans([]) == []
    spans = version_spans([3, 3, 3, 4, 4, 6])
    assert [(w.version, w.start, w.end) for w in spans] == [(3, 0, 3), (4, 3, 5), (6, 5, 6)]
    c = Completion(token_ids=[1, 2, 3, 4, 5, 6], finish_reason="length", weight_versions=spans)
    assert decode(encode(c), Completion) == c
    # Engines that cannot tell send no spans, and the field costs nothing on the wire then.
    bare = Completion(token_ids=[1], finish_reason="stop")
    assert b"weight_versions" not in encode(bare)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["min", "exact"]),
    floor=st.integers(0, 4),
    start=st.integers(0, 4),
    end=st.integers(0, 4),
    spans=st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=3),
)
def test_served_within_is_every_token_allowed(kind: str, floor: int, start: int, end: int, spans: list) -> None:
    """The fast check agrees with its definition: every version a result reports is allowed."""
    from rollfleet.schemas import Completion, RolloutResult, VersionConstraint, VersionSpan, served_within

    outputs = [
        Completion(
            token_ids=[],
            finish_reason="length",
            weight_versions=[VersionSpan(version=v, start=i, end=i + 1) for i, v in enumerate(vs)],
        )
        for vs in spans
    ]
    result = RolloutResult(
        job_id="j", idempotency_key="k", client_id="c", outputs=outputs, version_start=start, version_end=end,
        worker_id="w", engine="echo", queue_wait_s=0.0, generation_s=0.0, delivery_attempt=1, finished_at=0.0,
    )  # fmt: skip
    constraint = VersionConstraint(kind, floor)  # type: ignore[arg-type]
    every = {start, end, *(v for vs in spans for v in vs)}
    assert served_within(constraint, result) == all(constraint.allows(v) for v in every)


def test_a_job_built_with_its_payload_encoded_once_is_the_job_workers_decode() -> None:
    """The client sends ``RolloutJobWire`` (payload pre-encoded): byte for byte what encoding the
    ``RolloutJob`` would give, so a worker decodes exactly the job the client holds."""
    from tests.helpers import built_job

    payload = RolloutPayload(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=9, seed=3), n=2)
    job, data = built_job(payload, VersionConstraint("min", 4), "staleness:1", trainer_version=5)
    assert data == encode(job)
    assert decode(data, RolloutJob) == job
    assert set(RolloutJob.__struct_fields__) == set(RolloutJobWire.__struct_fields__)
    assert RolloutJob.__struct_fields__ == RolloutJobWire.__struct_fields__  # same order: same bytes


def test_a_jobs_views_are_derived_from_the_job_so_a_new_field_reaches_them() -> None:
    """``RolloutJobWire`` and ``JobAddress`` are views of ``RolloutJob`` built from its fields
    (``struct_view``), not hand-kept copies: a field added to a struct is in its full view at once,
    with its default, and a partial view reads only its own fields, each optional."""
    import msgspec

    from rollfleet.schemas.messages import struct_view

    class Job(msgspec.Struct, kw_only=True):
        job_id: str
        payload: RolloutPayload
        added_later: int = 7
        tags: list[str] = msgspec.field(default_factory=list)

    wire = struct_view("JobWire", Job, types={"payload": msgspec.Raw})
    assert wire.__struct_fields__ == Job.__struct_fields__
    raw = encode(RolloutPayload(prompt_token_ids=[1]))
    sent = wire(job_id="j", payload=msgspec.Raw(raw))
    assert (sent.added_later, sent.tags) == (7, [])
    assert decode(encode(sent), Job) == Job(job_id="j", payload=RolloutPayload(prompt_token_ids=[1]))
    address = struct_view("Address", Job, only={"job_id": None})
    assert address.__struct_fields__ == ("job_id",)
    assert decode(encode(Job(job_id="j", payload=RolloutPayload())), address).job_id == "j"
    assert address().job_id is None
    # The real ones: a job's address reads from its bytes; a job from before ``schema`` is 1.
    job = RolloutJob(job_id="a", idempotency_key="k", client_id="c", constraint=VersionConstraint("min", 0),
                     payload=RolloutPayload(), deadline=1.0, submitted_at=0.0, fingerprint="f")  # fmt: skip
    got = decode(encode(job), JobAddress)
    assert (got.job_id, got.idempotency_key, got.client_id, got.fingerprint, got.schema) == ("a", "k", "c", "f", 2)
    assert decode(encode({"job_id": "a"}), JobAddress).schema == 1


def test_a_timeout_counts_from_when_the_caller_asked_not_from_when_the_job_is_built() -> None:
    """A session's turn reads the broker before its job is built (seconds, while the broker is
    frozen): its ``timeout`` counts from the call, so the caller is answered by then."""
    import time

    from tests.helpers import built_job

    payload = RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=2))
    asked = time.time() - 5.0
    job, _ = built_job(payload, VersionConstraint("min", 0), "min:0", timeout=8.0, asked_at=asked)
    assert job.deadline == asked + 8.0
    fresh, _ = built_job(payload, VersionConstraint("min", 0), "min:0", timeout=8.0)
    assert fresh.deadline > asked + 8.0 + 4.0  # without it: from now
    late, _ = built_job(payload, VersionConstraint("min", 0), "min:0", timeout=3.0, asked_at=asked)
    assert late.deadline < time.time()  # already past: answered Expired at once, not 3 s from now


def test_a_worker_decides_what_to_do_with_a_job_of_another_schema() -> None:
    """``decode_job``: a job of a newer schema is refused (UnsupportedSchema, naming the schema and
    the fields it cannot decode) even when it decodes; a value unknown at this schema is plain
    bad input; either way ``job_address`` still reads where the answer goes."""
    from rollfleet.schemas import SCHEMA_VERSION, decode_job, job_address

    wire = msgspec.to_builtins(_job(fingerprint="f1"))
    assert decode_job(encode(wire), max_bytes=1 << 20) == _job(fingerprint="f1")
    cases = [
        ({"schema": SCHEMA_VERSION + 1, "retry_policy": "teleport"}, E.UnsupportedSchema, ("retry_policy",)),
        ({"schema": SCHEMA_VERSION + 1}, E.UnsupportedSchema, ()),
        ({"retry_policy": "teleport"}, E.InvalidRequest, None),
    ]
    for changes, error, fields in cases:
        data = encode(wire | changes)
        with pytest.raises(error) as caught:
            decode_job(data, max_bytes=1 << 20)
        assert type(caught.value) is error and not caught.value.retryable
        if fields is not None:
            assert (caught.value.schema, caught.value.supported) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
            assert caught.value.fields == fields
        address = job_address(data)
        assert address is not None and (address.job_id, address.fingerprint) == ("j1", "f1")
        assert (address.client_id, address.idempotency_key) == ("trainer-0", "step1/g0/s0")
    assert job_address(b"\xc1 not messagepack") is None
    assert job_address(encode({"job_id": 7})) is None  # (then the headers address the answer)
    assert E.error_from_code("unsupported_schema", "m").retryable is False


def test_every_retry_policy_has_one_behaviour_and_the_rules_read_it() -> None:
    from typing import get_args

    from rollfleet.schemas.messages import RETRY_BEHAVIOUR, RetryPolicy, refuses_while_activating, version_allows

    assert set(RETRY_BEHAVIOUR) == set(get_args(RetryPolicy))
    # Only a policy whose holder's death ends the job (Interrupted) refuses a takeover; a policy
    # that checkpoints goes on from them; every policy but replayable claims.
    for policy, b in RETRY_BEHAVIOUR.items():
        assert b.takeover == (b.holder_gone != "interrupted"), policy
        assert b.checkpoints == (b.holder_gone == "resume"), policy
        assert b.claimed == (policy != "replayable"), policy
    # The claim rule: every claimed policy, every session turn, every exact job.
    for policy in RETRY_BEHAVIOUR:
        for kind in ("min", "exact"):
            for sid in (None, "s"):
                job = RolloutJob(
                    job_id="j", idempotency_key="k", client_id="c", constraint=VersionConstraint(kind, 1),
                    payload=RolloutPayload(prompt_token_ids=[1]), retry_policy=policy, session_id=sid,
                    deadline=1e10, submitted_at=1.0,
                )
                assert job.claimed == (policy != "replayable" or sid is not None or kind == "exact")
    # The version rule, once: exact N allows N alone, min N allows N and above.
    assert [v for v in range(5) if version_allows("exact", 2, v)] == [2]
    assert [v for v in range(5) if version_allows("min", 2, v)] == [2, 3, 4]
    assert refuses_while_activating("exact") and not refuses_while_activating("min")


@pytest.mark.parametrize("policy", ["replayable", "at_most_once", "resume"])
def test_only_a_job_whose_holder_death_ends_it_is_bounded_by_its_claims_lifetime(policy: str) -> None:
    from tests.helpers import built_job

    constraint = VersionConstraint("min", 0)
    ok, _ = built_job(RolloutPayload(prompt_token_ids=[1]), constraint, "min:0", retry_policy=policy,
                      timeout=100, max_timeout_s=100)
    assert ok.retry_policy == policy
    if policy == "at_most_once":
        with pytest.raises(E.InvalidRequest, match="may wait at most 100 s"):
            built_job(RolloutPayload(prompt_token_ids=[1]), constraint, "min:0", retry_policy=policy,
                      timeout=101, max_timeout_s=100)
    else:  # (a replayable or resumable job outliving its claim is run again, or goes on: fine)
        job, _ = built_job(RolloutPayload(prompt_token_ids=[1]), constraint, "min:0", retry_policy=policy,
                           timeout=101, max_timeout_s=100)
        assert job.deadline - job.submitted_at > 100


def test_a_retry_policy_this_version_does_not_know_is_treated_as_the_strictest() -> None:
    from rollfleet.schemas.messages import RETRY_BEHAVIOUR, retry_behaviour

    assert retry_behaviour("teleport") == RETRY_BEHAVIOUR["at_most_once"]
    assert all(retry_behaviour(p) == b for p, b in RETRY_BEHAVIOUR.items())


def test_a_claim_marked_stopped_reads_back_stopped_and_keeps_its_holder() -> None:
    from rollfleet.schemas.names import Claim

    held = Claim("w1:123-abcd", 1_700_000_000.25)
    assert not held.stopped and Claim.decode(held.encode()) == held
    stopped = held.as_stopped()
    assert stopped.stopped and stopped.holder == held.holder
    assert Claim.decode(stopped.encode()).stopped


def test_a_constraint_is_checked_once_as_written_and_resolved_against_the_newest_version() -> None:
    """``AskedConstraint``: the one check of a constraint from every door (the client's keywords,
    a session and its turns, the HTTP endpoint), its written form (what a fingerprint covers:
    a request asked again after a commit is the same request) and what it resolves to."""
    from rollfleet.schemas import ANY_VERSION, AskedConstraint
    from rollfleet.trainer_client.requests import asked_of

    assert AskedConstraint.of(max_staleness=2).resolve(10) == VersionConstraint("min", 8)
    assert AskedConstraint.of(max_staleness=20).resolve(10) == VersionConstraint("min", 0)
    assert AskedConstraint.of(max_staleness=1).resolve(None) == VersionConstraint("min", 0)
    assert AskedConstraint.of(exact_version=3).resolve(10) == VersionConstraint("exact", 3)
    assert AskedConstraint.of(min_version=3).written == "min:3" and ANY_VERSION.written == "min:0"
    assert AskedConstraint.of(max_staleness=1).written == "staleness:1"  # (not the version it resolves to)
    for bad in ({}, {"min_version": 1, "exact_version": 1}, {"min_version": 1.0}, {"exact_version": True},
                {"max_staleness": -1}, {"min_version": "3"}, {"exact_version": 2**63}):  # fmt: skip
        with pytest.raises(E.InvalidRequest):
            AskedConstraint.of(**bad)
    built = AskedConstraint("exact", 2)
    assert asked_of(built, None, None, None) is built
    with pytest.raises(E.InvalidRequest):
        asked_of(built, 2, None, None)  # (two ways at once)
    with pytest.raises(E.InvalidRequest):
        asked_of({"exact_version": 2}, None, None, None)  # (not the type)
