"""A shared client id's instance (a gateway) whose results consumer the broker lost still hands
each waiting request its answer, when the answer was stored before the consumer was declared
again: an instance consumer starts at new answers, so the waiting handles look the stored ones up.

Found by the adversary (seed 446640): after a broker wipe a replica stored its answer into the
results stream declared again by another process, a moment before the gateway declared its own
consumer; the gateway held the request until its deadline and answered ``Expired``.
"""

from __future__ import annotations

import time

from rollfleet.schemas import Completion, RolloutPayload, RolloutResult, encode
from rollfleet.schemas.names import HDR_MSG_ID
from rollfleet.trainer_client import RolloutClient


def _answer(client_id: str, key: str, job_id: str, fingerprint: str, tokens: list[int]) -> RolloutResult:
    return RolloutResult(
        job_id=job_id,
        idempotency_key=key,
        client_id=client_id,
        outputs=[Completion(token_ids=tokens, finish_reason="length")],
        version_start=0,
        version_end=0,
        worker_id="w1",
        engine="echo",
        queue_wait_s=0.0,
        generation_s=0.0,
        delivery_attempt=1,
        finished_at=time.time(),
        fingerprint=fingerprint,
    )


async def _lose_consumer_then_answer(client: RolloutClient, keys: list[str], answered: list[str]) -> dict:
    payload = RolloutPayload(prompt_token_ids=[1, 2])
    handles = {key: await client.submit(payload, min_version=0, idempotency_key=key, timeout=60) for key in keys}
    # The broker loses this instance's consumer (a wipe, a deletion); a replica answers meanwhile.
    await client.js.delete_consumer(client.names.results_stream, client.inbox.consumer)
    for i, key in enumerate(answered):
        handle = handles[key]
        answer = _answer(client.client_id, key, handle.job_id, handle.job.fingerprint, [40 + i, 41 + i])
        subject = client.names.result_subject(client.client_id, key, handle.job_id, "w1")
        await client.js.publish(subject, encode(answer), headers={HDR_MSG_ID: f"a-{key}"})
    await client.restore_results_consumer()  # what a reconnect or a deletion advisory runs
    return handles


async def test_an_answer_stored_while_the_instance_consumer_was_missing_reaches_its_request(
    nats_url: str, namespace: str
) -> None:
    async with await RolloutClient.connect(
        nats_url, namespace=namespace, client_id="gw", shared=True, fail_fast=False
    ) as client:
        handles = await _lose_consumer_then_answer(client, ["k0", "k1", "k2"], ["k0", "k2"])
        first = await handles["k0"].result(10)
        third = await handles["k2"].result(10)
        assert first.outputs[0].token_ids == [40, 41] and first.job_id == handles["k0"].job_id
        assert third.outputs[0].token_ids == [41, 42] and third.job_id == handles["k2"].job_id
        # The request nobody answered still waits (it is not settled by someone else's answer).
        assert not handles["k1"].done()
        # An answer stored after the consumer is back arrives through the consumer, once.
        later = _answer("gw", "k1", handles["k1"].job_id, handles["k1"].job.fingerprint, [7])
        subject = client.names.result_subject("gw", "k1", handles["k1"].job_id, "w1")
        await client.js.publish(subject, encode(later), headers={HDR_MSG_ID: "b"})
        assert (await handles["k1"].result(10)).outputs[0].token_ids == [7]


async def test_a_client_of_its_own_id_gets_the_answer_from_its_consumer_declared_again(
    nats_url: str, namespace: str
) -> None:
    """The other half of the rule: a client id of one process re-declares a consumer that reads
    the stream from its start, so the same loss reaches it without a look-up."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t", fail_fast=False) as client:
        handles = await _lose_consumer_then_answer(client, ["k0"], ["k0"])
        assert (await handles["k0"].result(10)).outputs[0].token_ids == [40, 41]
