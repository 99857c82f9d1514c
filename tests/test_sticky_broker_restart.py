"""A sticky turn's live holder across a broker restart (a campaign's finding): the broker is
SIGKILLed and back at once, and the replica running an at_most_once turn reconnects a moment
after the trainer. Right after its own reconnect the trainer saw the holder's registry entry
stale (as every replica's is after an outage) and one probe unanswered (the holder had not
redialed yet), marked its claim stopped and moved the turn: the copy was answered
``Interrupted`` although the live holder finished it. The trainer now judges a holder only once
it has been connected longer than a replica needs to redial, and from repeated probes
(``placement_rules.HolderWatch``). Real broker, worker processes and signals; the holder's
link goes through ``LinkProxy``, which refuses its reconnects until the test lets it."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from harness import ProcessGroup, wait_until
from harness.link import LinkProxy
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.connection import redialed
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams
from rollfleet.trainer_client import RolloutClient, answers

HELD_S = 0.5  # the holder stays cut off this long after that probe (until the fix: judged gone by then)
TOKENS = 500  # 5 s at 10 ms a token: the turn runs through the outage and past the holder's return


def _turn(context: list[int], max_tokens: int) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=context, sampling=SamplingParams(max_tokens=max_tokens))


async def test_a_holder_that_redials_after_the_trainer_keeps_its_at_most_once_turn(tmp_path: Path) -> None:
    broker = EmbeddedBroker(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    link = await LinkProxy("127.0.0.1", broker.port).start()
    group = ProcessGroup(tmp_path)
    ns, slow = "restart", ("--echo-token-latency", "0.01")
    dropping: asyncio.Future[None] | None = None
    try:
        # (A heartbeat of 1 s: the trainer's grace after its reconnect is 2 s plus one, room for
        # the holder's own redial below under load.)
        group.worker(f"nats://127.0.0.1:{link.port}", ns, "w1", *slow, "--heartbeat", "1.0")
        async with await RolloutClient.connect(broker.url, namespace=ns, client_id="c") as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30, what="w1 registered")
            async with client.session(min_version=0, retry_policy="at_most_once", affinity_wait_s=1.0) as s:
                assert (await s.generate(_turn([1, 2, 3], 2))).worker_id == "w1"
                group.worker(broker.url, ns, "w2", *slow)  # where a moved turn would go
                await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=30, what="w2 registered")
                turn = asyncio.ensure_future(s.generate(_turn([1, 2, 3, 4], TOKENS)))
                await wait_until(
                    lambda: (r := client.fleet.replica("w1")) is not None and r.in_flight == 1,
                    timeout=10,
                    what="w1 running the turn",
                )
                trainer_back = redialed(client.nc)
                assert trainer_back is not None
                broker.kill()
                dropping = asyncio.ensure_future(link.drop(3600.0))  # w1 cannot redial until healed
                broker.start()  # same port, same store
                await asyncio.wait_for(trainer_back.wait(), 20)
                # The holder is still cut off when the trainer's probe finds its bell silent (the
                # view drops it): until the fix, the trainer judged it gone on that probe.
                await wait_until(lambda: client.fleet.replica("w1") is None, timeout=10, what="w1's bell silent")
                await asyncio.sleep(HELD_S)
                link.heal()  # w1 redials now (within its 0.5 s redial wait)
                result = await asyncio.wait_for(turn, 30)
                stored = [o async for _, o in answers.stored(client.js, client.names, "c", s.turn_key(1))]
    finally:
        if dropping is not None:
            dropping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dropping
        group.close()
        await link.close()
        broker.stop()
    assert isinstance(result, RolloutResult) and result.worker_id == "w1"
    assert len(result.outputs[0].token_ids) == TOKENS  # the live holder's whole run
    assert [(type(o).__name__, o.worker_id) for o in stored] == [("RolloutResult", "w1")]
