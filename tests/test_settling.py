"""Whether an answer settles a request (``trainer_client.settling.Settler``), as plain decisions:
no broker, no processes. Each path an answer takes to a caller (the results stream, an answer that
came first, a stored answer, ``result(key)``) goes through these."""

from __future__ import annotations

import time

import pytest

from rollfleet.schemas import (
    Completion,
    Names,
    RolloutFailure,
    RolloutJob,
    RolloutPayload,
    RolloutResult,
    SamplingParams,
    VersionConstraint,
    VersionSpan,
)
from rollfleet.schemas.errors import ContractViolation, Expired, IdempotencyConflict
from rollfleet.trainer_client.answer_settling import Settler, check_same_request
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.own_job_ids import JobIds

KEY = "k1"


def _settler(latest: int | None = 7) -> tuple[Settler, JobIds, ClientMetrics]:
    metrics = ClientMetrics("c")
    settler = Settler(None, Names("ns"), "c", {}, metrics, lambda: latest)  # type: ignore[arg-type]
    settler.ids = JobIds("c", b"s" * 32)
    return settler, settler.ids, metrics


def _job(ids: JobIds, constraint: VersionConstraint, fingerprint: str = "fp") -> RolloutJob:
    payload = RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2))
    now = time.time()
    job_id = ids.issue(KEY)
    return RolloutJob(
        job_id=job_id,
        idempotency_key=KEY,
        client_id="c",
        constraint=constraint,
        payload=payload,
        deadline=now + 60,
        submitted_at=now,
        fingerprint=fingerprint,
    )


def _result(job: RolloutJob, start: int, end: int, **changes: object) -> RolloutResult:
    fields: dict[str, object] = {
        "job_id": job.job_id,
        "idempotency_key": KEY,
        "client_id": "c",
        "outputs": [
            Completion(
                token_ids=[5, 6], finish_reason="length", weight_versions=[VersionSpan(version=start, start=0, end=2)]
            )
        ],
        "version_start": start,
        "version_end": end,
        "worker_id": "w",
        "engine": "echo",
        "queue_wait_s": 0.0,
        "generation_s": 0.0,
        "delivery_attempt": 1,
        "finished_at": time.time(),
        "fingerprint": job.fingerprint,
        "constraint": job.constraint,
    }
    return RolloutResult(**(fields | changes))  # type: ignore[arg-type]


async def test_an_answer_of_the_request_settles_it_with_its_staleness() -> None:
    settler, ids, _ = _settler(latest=7)
    job = _job(ids, VersionConstraint("min", 3))
    handle = RolloutHandle(job, b"", None)  # type: ignore[arg-type]
    assert settler.settle(handle, _result(job, 4, 5))
    got = await handle
    assert (got.version_start, got.staleness) == (4, 3)


async def test_an_answer_to_a_job_this_client_never_issued_leaves_the_handle_waiting() -> None:
    settler, ids, _ = _settler()
    job = _job(ids, VersionConstraint("min", 0))
    handle = RolloutHandle(job, b"", None)  # type: ignore[arg-type]
    forged = _result(job, 0, 0, job_id="0" * 32)
    assert not settler.settle(handle, forged)
    assert not handle.done()
    # Known to be ours (the inbox checked the id already): then only the fingerprint counts.
    assert settler.settle(handle, forged, issued=True)
    assert handle.done()


async def test_an_answer_to_another_request_under_the_key_is_a_conflict() -> None:
    settler, ids, _ = _settler()
    job = _job(ids, VersionConstraint("min", 0), fingerprint="mine")
    handle = RolloutHandle(job, b"", None)  # type: ignore[arg-type]
    assert settler.settle(handle, _result(job, 0, 0, fingerprint="other"))
    with pytest.raises(IdempotencyConflict):
        await handle


async def test_a_result_outside_its_constraint_is_never_handed_over_and_is_counted() -> None:
    settler, ids, metrics = _settler()
    job = _job(ids, VersionConstraint("exact", 3))
    handle = RolloutHandle(job, b"", None)  # type: ignore[arg-type]
    assert settler.settle(handle, _result(job, 3, 4))  # an exact job that ran across an activation
    with pytest.raises(ContractViolation):
        await handle
    assert metrics.registry.get_sample_value("rollfleet_client_contract_violations_total", {"client_id": "c"}) == 1
    # By key alone (``result(key)``): checked against the constraint the answer carries.
    with pytest.raises(ContractViolation):
        settler.deliver(KEY, _result(job, 2, 2))
    assert settler.deliver(KEY, _result(job, 3, 3)).staleness == 4


async def test_a_failure_settles_as_its_typed_error() -> None:
    settler, ids, _ = _settler()
    job = _job(ids, VersionConstraint("min", 0))
    handle = RolloutHandle(job, b"", None)  # type: ignore[arg-type]
    failure = RolloutFailure(
        idempotency_key=KEY,
        client_id="c",
        code="expired",
        message="late",
        retryable=True,
        job_id=job.job_id,
        fingerprint="fp",
    )
    assert settler.settle(handle, failure)
    with pytest.raises(Expired) as raised:
        await handle
    assert raised.value.retryable
    with pytest.raises(Expired):
        settler.deliver(KEY, failure)


def test_a_key_asked_again_must_be_the_same_request() -> None:
    ids = JobIds("c", b"s" * 32)
    job = _job(ids, VersionConstraint("min", 0), fingerprint="a")
    check_same_request(job, "a")
    with pytest.raises(IdempotencyConflict):
        check_same_request(job, "b")
