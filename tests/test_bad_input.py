"""Bad input on a jobs subject: answered InvalidRequest where possible, terminated, never wedging."""

from __future__ import annotations

import msgspec
import pytest

from rollfleet.schemas import Names, RolloutJob, VersionConstraint, encode
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID
from rollfleet.testing import running_worker, wait_until
from rollfleet.trainer_client import RolloutClient
from tests.helpers import CountingEcho, payload


def _job_dict(**changes: object) -> dict:
    job = RolloutJob(
        job_id="bad-job",
        idempotency_key="bad-key",
        client_id="c",
        constraint=VersionConstraint("min", 0),
        payload=payload(),
        deadline=4e9,
        submitted_at=1.0,
    )
    return msgspec.to_builtins(job) | changes


CASES = {
    "not-msgpack": b"\xc1\x00{this is not messagepack",
    "wrong-type": encode(_job_dict(deadline="tomorrow")),
    "oversized": encode(_job_dict(payload={"prompt_token_ids": list(range(200_000))})),
    "impossible-sampling": encode(
        _job_dict(payload={"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 4, "top_p": 7.5}})
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_bad_job_is_answered_terminated_and_the_next_job_served(nats_url: str, namespace: str, case: str) -> None:
    engine = CountingEcho()
    names = Names(namespace)
    async with (
        running_worker(nats_url, namespace, engine=engine) as worker,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        headers = {HDR_MSG_ID: "bad-key", HDR_CLIENT_ID: "c"}
        await client.js.publish(names.job_subject("min", 0), CASES[case], headers=headers)
        with pytest.raises(InvalidRequest) as info:
            await client.result("bad-key", timeout=10)
        assert not info.value.retryable
        good = await client.submit(payload(), min_version=0)
        assert (await good.result(10)).worker_id == worker.config.worker_id
        assert len(engine.calls) == 1  # the bad job never reached the engine

        async def gone() -> bool:  # terminated: not left in the work queue for redelivery
            return (await client.js.stream_info(names.jobs_stream)).state.messages == 0

        await wait_until(gone, timeout=5)
        assert worker.outcomes.get("invalid_request") == 1


async def test_bad_job_without_reply_address_is_terminated(nats_url: str, namespace: str) -> None:
    names = Names(namespace)
    async with (
        running_worker(nats_url, namespace) as worker,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await client.js.publish(names.job_subject("min", 0), b"garbage with no headers")
        good = await client.submit(payload(), min_version=0)
        await good.result(10)

        async def gone() -> bool:
            return (await client.js.stream_info(names.jobs_stream)).state.messages == 0

        await wait_until(gone, timeout=5)
        assert worker.outcomes.get("invalid_request") == 1
        results = await client.js.stream_info(names.results_stream)
        assert results.state.messages == 1  # only the good job's result


async def test_client_rejects_bad_requests_before_queueing(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        with pytest.raises(InvalidRequest, match="exactly one"):
            await client.submit(payload(), min_version=1, exact_version=1)
        with pytest.raises(InvalidRequest, match="top_p"):
            await client.submit(payload(top_p=2.0), min_version=0)
        with pytest.raises(InvalidRequest, match="retry_policy"):
            await client.submit(payload(), min_version=0, retry_policy="sometimes")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="over the limit"):
            await client.submit(payload(list(range(50_000))), min_version=0)
        info = await client.js.stream_info(client.names.jobs_stream)
        assert info.state.messages == 0
