"""Results of any size the limits admit reach the client; what cannot be stored is answered at
once with a typed error; a result outside its constraint is never handed to the caller."""

from __future__ import annotations

import time

import pytest

from rollfleet.broker.topology import TopologyConfig
from rollfleet.schemas import (
    Completion,
    RolloutPayload,
    RolloutResult,
    SamplingParams,
    VersionConstraint,
    encode,
    version_spans,
)
from rollfleet.schemas.errors import ContractViolation, ResultUnstorable
from rollfleet.schemas.names import HDR_MSG_ID
from rollfleet.testing import running_worker
from rollfleet.trainer_client import RolloutClient

# 16 samples of 32768 tokens with log-probs: about 7 MB, over the 4 MiB message limit.
HUGE = RolloutPayload(prompt_token_ids=[7, 8, 9], sampling=SamplingParams(max_tokens=32_768), n=16)


async def test_a_result_over_the_message_limit_arrives_whole(nats_url: str, namespace: str) -> None:
    async with running_worker(nats_url, namespace) as worker:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            t0 = time.monotonic()
            result = await (await client.submit(HUGE, min_version=0, idempotency_key="huge")).result(120)
            took = time.monotonic() - t0
            stored = await client.js.stream_info(client.names.results_stream)
    assert len(result.outputs) == 16 and all(len(o.token_ids) == 32_768 for o in result.outputs)
    assert result.outputs[3].token_ids[:3] == [(7 + 8 + 9 + 3 + i) % 32_000 for i in range(3)]
    assert stored.state.messages > 2  # chunks, then the head
    assert worker.jobs_done == 1 and worker.outcomes == {"ok": 1}, worker.outcomes  # run once, not ten times
    print(f"huge result: {stored.state.bytes} bytes stored in {stored.state.messages} messages, {took:.2f}s")
    # A restarted trainer reads the chunked answer back by key.
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as again:
        assert (await again.result("huge", timeout=10)).outputs == result.outputs


async def test_a_result_the_broker_refuses_is_answered_at_once_and_not_retried(nats_url: str, namespace: str) -> None:
    """The namespace's results stream takes messages of at most 64 KiB, but this worker believes
    4 MiB: its chunks are refused for good. The client hears so at once, not after ten reruns."""
    small = TopologyConfig(max_msg_bytes=64 * 1024)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=small) as client:
        async with running_worker(nats_url, namespace) as worker:
            big = RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=20_000), n=4)
            t0 = time.monotonic()
            with pytest.raises(ResultUnstorable) as caught:
                await (await client.submit(big, min_version=0)).result(30)
            took = time.monotonic() - t0
    assert caught.value.retryable is False
    assert worker.outcomes == {"result_unstorable": 1}  # run once
    assert took < 15, took


async def test_a_result_outside_its_constraint_is_never_handed_out(nats_url: str, namespace: str) -> None:
    """Defence in depth: a result stored for an exact-3 job but generated (in part) at version 4
    (a forged or buggy worker) is refused by the client, counted and logged."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", fail_fast=False) as client:
        handle = await client.submit(RolloutPayload(prompt_token_ids=[1]), exact_version=3, idempotency_key="k")
        forged = RolloutResult(
            job_id=handle.job_id,
            idempotency_key="k",
            client_id="c",
            outputs=[Completion(token_ids=[1, 2], finish_reason="length", weight_versions=version_spans([3, 4]))],
            version_start=3,
            version_end=3,  # the summary lies; the per-token spans do not
            worker_id="rogue",
            engine="echo",
            queue_wait_s=0.0,
            generation_s=0.0,
            delivery_attempt=1,
            finished_at=time.time(),
            fingerprint=handle.job.fingerprint,
            constraint=VersionConstraint("exact", 3),
        )
        await client.js.publish(client.names.result_subject("c", "k"), encode(forged), headers={HDR_MSG_ID: "k"})
        with pytest.raises(ContractViolation):
            await handle.result(10)
        assert client.metrics.contract_violations._value.get() == 1
        # The same forged answer read back by key later is refused too.
        with pytest.raises(ContractViolation):
            await client.result("k", timeout=5)
