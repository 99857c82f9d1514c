"""One live client per client_id: a second is refused with a typed error, a restarted trainer
takes over within a short grace and gets what arrived while it was away."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import running_worker, terminate
from harness.link import LinkProxy
from rollfleet.broker import EmbeddedBroker
from rollfleet.schemas.errors import ClientIdInUse
from rollfleet.trainer_client import RolloutClient
from tests.helpers import REPO, payload


async def test_a_second_live_client_with_the_same_id_is_refused(nats_url: str, namespace: str) -> None:
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer") as first:
        with pytest.raises(ClientIdInUse) as caught:
            await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer")
        assert caught.value.retryable and "trainer" in caught.value.message
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="other"):
            pass  # another id is fine
        async with running_worker(nats_url, namespace):
            assert (await (await first.submit(payload(), min_version=0)).result(10)).outputs
    # Once the first has closed, the id is free again.
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer"):
        pass


async def test_clients_starting_together_cannot_both_win(nats_url: str, namespace: str) -> None:
    for _ in range(10):
        attempts = await asyncio.gather(
            *(RolloutClient.connect(nats_url, namespace=namespace, client_id="race") for _ in range(6)),
            return_exceptions=True,
        )
        winners = [c for c in attempts if isinstance(c, RolloutClient)]
        losers = [e for e in attempts if not isinstance(e, RolloutClient)]
        assert len(winners) == 1, attempts
        assert all(isinstance(e, ClientIdInUse) for e in losers), losers
        await winners[0].close()


_TRAINER = textwrap.dedent(
    """
    import asyncio, sys
    from rollfleet.schemas import RolloutPayload, SamplingParams
    from rollfleet.trainer_client import RolloutClient

    async def main():
        client = await RolloutClient.connect(sys.argv[1], namespace=sys.argv[2], client_id="trainer", fail_fast=False)
        await client.submit(RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=2)),
                            min_version=0, idempotency_key="left-behind")
        print("SUBMITTED", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_a_killed_trainer_is_replaced_at_once_and_its_results_are_kept(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, nats_url, namespace], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "SUBMITTED"
        with pytest.raises(ClientIdInUse):  # it is alive: refused
            await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer")
        terminate(child, 5.0, signal.SIGKILL)
        async with running_worker(nats_url, namespace):
            # Taken over within the grace a silent holder gets (it might be reconnecting), with no
            # lease to wait out; the dead trainer's result is there.
            async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer") as client:
                result = await client.result("left-behind", timeout=15)
                assert result.outputs[0].token_ids
    finally:
        terminate(child, 5.0, signal.SIGKILL)
        if child.stdout is not None:
            child.stdout.close()


async def test_a_live_client_reconnecting_keeps_its_id(broker: EmbeddedBroker, namespace: str) -> None:
    """A live client whose connection dropped is silent until it has reconnected: a second client
    with its id, starting meanwhile, is refused, not handed the id (campaign seed 126: a second
    client took a live trainer's id 50 ms before the trainer's reconnect completed; the trainer
    then stopped receiving its results)."""
    link = await LinkProxy("127.0.0.1", broker.port).start()
    try:
        url = f"nats://127.0.0.1:{link.port}"
        async with await RolloutClient.connect(url, namespace=namespace, client_id="trainer") as first:
            dropping = asyncio.create_task(link.drop(0.5))  # reset; every redial refused for 0.5 s
            await asyncio.sleep(0.05)
            with pytest.raises(ClientIdInUse):
                await RolloutClient.connect(broker.url, namespace=namespace, client_id="trainer")
            await dropping
            assert await first._lease.held()  # (still its own: no other live client answers)
    finally:
        await link.close()
