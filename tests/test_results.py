"""Results of any size the limits admit reach the client; what cannot be stored is answered at
once with a typed error; a result outside its constraint is never handed to the caller."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from harness import ProcessGroup, running_worker, wait_until
from rollfleet.broker.topology import TopologyConfig
from rollfleet.runtime import faults
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
from rollfleet.trainer_client import RolloutClient
from tests.helpers import built_job

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
        subject = client.names.result_subject("c", "k", handle.job_id, "rogue")
        await client.js.publish(subject, encode(forged), headers={HDR_MSG_ID: "k"})
        with pytest.raises(ContractViolation):
            await handle.result(10)
        assert client.metrics.contract_violations._value.get() == 1
        # The same forged answer read back by key later is refused too.
        with pytest.raises(ContractViolation):
            await client.result("k", timeout=5)


SMALL = TopologyConfig(max_msg_bytes=64 * 1024, ack_wait_s=2.0)  # answers over ~48 KiB go in chunks
CHUNKED = RolloutPayload(prompt_token_ids=[3, 1, 4], sampling=SamplingParams(max_tokens=6_000), n=4)  # ~150 KB


async def test_a_rerun_after_a_kill_mid_chunks_is_answered_whole(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """w1 stores the first chunk of a large answer and is SIGKILLed; the job is run again by w2 at
    another version (other bytes). The answer that arrives is w2's, whole; the key asked again
    returns the same one; nothing is mixed with the dead run's chunks."""
    group = ProcessGroup(tmp_path)
    small = ("--max-msg-bytes", str(SMALL.max_msg_bytes), "--ack-wait", str(SMALL.ack_wait_s))
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=SMALL) as client:
            group.worker(nats_url, namespace, "w1", *small, env=faults.env("kill", "worker:mid-chunks"))
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            handle = await client.submit(CHUNKED, min_version=0, idempotency_key="big1", timeout=60)
            await asyncio.to_thread(group.procs["w1"].wait, 30)  # killed after its first chunk
            group.worker(nats_url, namespace, "w2", "--version", "1", *small)
            result = await handle.result(60)
            assert result.worker_id == "w2" and result.version_start == 1
            assert len(result.outputs) == 4 and all(len(o.token_ids) == 6_000 for o in result.outputs)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=SMALL) as again:
            assert (await again.result("big1", timeout=10)).job_id == result.job_id
            resubmitted = await (await again.submit(CHUNKED, min_version=0, idempotency_key="big1")).result(10)
            assert resubmitted.job_id == result.job_id and resubmitted.outputs == result.outputs
    finally:
        group.close()


async def test_keys_never_collide_with_other_keys_chunks(nats_url: str, namespace: str) -> None:
    """Keys that look like another key's chunk ids (``rollout`` chunked, then ``rollout:1``;
    ``sample:0`` answered, then ``sample`` chunked) are each answered, promptly."""
    async with (
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=SMALL) as client,
        running_worker(nats_url, namespace, topology=SMALL),
    ):
        small = RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=3))
        order = [("rollout", CHUNKED), ("rollout:1", small), ("rollout:2", CHUNKED), ("sample:0", small)]
        order += [("sample", CHUNKED), ("sample:1", CHUNKED)]
        for key, payload in order:
            result = await (await client.submit(payload, min_version=0, idempotency_key=key, timeout=20)).result(20)
            assert result.idempotency_key == key and len(result.outputs) == payload.n
            assert all(len(o.token_ids) == payload.sampling.max_tokens for o in result.outputs)


async def test_an_answer_is_accepted_only_from_the_replica_that_took_the_job(nats_url: str, namespace: str) -> None:
    """Forged answers are never handed out: one stored before the job was submitted (no
    fingerprint, or a guessed one with a job id the client never issued), one under another
    replica's subject, and a copy of the real answer re-stored by another replica afterwards
    (a re-ask still returns the original)."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", fail_fast=False) as client:
        payload = RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=3))
        # What a rogue replica can compute without a delivery: the key, the request, a job id of its own.
        probe, _ = built_job(payload, VersionConstraint("min", 0), "min:0")

        def forged(job_id: str, worker: str, fingerprint: str) -> RolloutResult:
            return RolloutResult(
                job_id=job_id,
                idempotency_key="k",
                client_id="c",
                outputs=[Completion(token_ids=[666], finish_reason="length")],
                version_start=0,
                version_end=0,
                worker_id=worker,
                engine="echo",
                queue_wait_s=0.0,
                generation_s=0.0,
                delivery_attempt=1,
                finished_at=time.time(),
                fingerprint=fingerprint,
            )

        for i, (job_id, worker, fingerprint) in enumerate(
            (
                (probe.job_id, "rogue", ""),  # no fingerprint
                (probe.job_id, "rogue", probe.fingerprint),  # the right fingerprint, a job id never issued
                (probe.job_id, "w-real", probe.fingerprint),  # claims to be the real replica, from another subject
            )
        ):
            subject = client.names.result_subject("c", "k", job_id, "rogue")
            await client.js.publish(subject, encode(forged(job_id, worker, fingerprint)), headers={HDR_MSG_ID: f"f{i}"})
        assert (await client.js.stream_info(client.names.results_stream)).state.messages == 3
        async with running_worker(nats_url, namespace, worker_id="w-real"):
            handle = await client.submit(payload, min_version=0, idempotency_key="k", timeout=30)
            result = await handle.result(20)
            assert result.worker_id == "w-real" and result.outputs[0].token_ids != [666]
            # A copy of the real answer re-stored under another replica's id, after the fact.
            copy = forged(handle.job_id, "rogue", handle.job.fingerprint)
            subject = client.names.result_subject("c", "k", handle.job_id, "rogue")
            await client.js.publish(subject, encode(copy), headers={HDR_MSG_ID: f"x:{handle.job_id}"})
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", fail_fast=False) as again:
        asked = await (await again.submit(payload, min_version=0, idempotency_key="k")).result(10)
        assert asked.worker_id == "w-real" and asked.job_id == result.job_id
        assert (await again.result("k", timeout=10)).worker_id == "w-real"
