"""Pauses (SIGSTOP/SIGCONT) of a worker or of the broker under a claimed job: a holder that was
only paused never answers a job it lost, and a holder the broker could not hear (the broker was
paused, not the holder) is not judged gone."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from harness import ProcessGroup, wait_until
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.topology import TopologyConfig
from rollfleet.schemas import RolloutResult, claim_key
from rollfleet.schemas.errors import Expired, Interrupted
from rollfleet.trainer_client import RolloutClient, answers
from rollfleet.workers.job_claim import (
    ClaimKeeper,
    ClaimWatch,
    judge_claim,
    proof_of_holding,
    verdict_write,
    watched_after,
)
from tests.helpers import payload

_SLOW = ("--ack-wait", "1", "--echo-token-latency", "0.05", "--capacity", "1")


async def _paused(proc: subprocess.Popen[bytes], seconds: float) -> None:
    proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)


async def _holder(client: RolloutClient, job_id: str) -> str:
    """The worker id named by the job's claim, once it is claimed."""
    claims = await client.js.key_value(client.names.claims_bucket)
    found: list[str] = []

    async def look() -> bool:
        try:
            found.append((await claims.get(claim_key(job_id))).value.decode().partition(":")[0])
        except Exception:
            return False
        return True

    deadline = asyncio.get_running_loop().time() + 20
    while not await look():
        assert asyncio.get_running_loop().time() < deadline, "job never claimed"
        await asyncio.sleep(0.05)
    return found[-1]


# -- the decision, in milliseconds --------------------------------------------------------------


def test_an_old_claim_is_a_gone_holder_only_after_it_was_watched_unchanged() -> None:
    now = 1000.0
    assert judge_claim(now - 0.5, now, stale_s=2.0, watched_s=0.0, confirm_s=1.0) == "held"
    # Old by the clock, but nobody has watched it with the broker answering: a broker pause looks so.
    assert judge_claim(now - 5.0, now, stale_s=2.0, watched_s=0.0, confirm_s=1.0) == "watch"
    assert judge_claim(now - 5.0, now, stale_s=2.0, watched_s=0.9, confirm_s=1.0) == "watch"
    assert judge_claim(now - 5.0, now, stale_s=2.0, watched_s=1.0, confirm_s=1.0) == "stopped"
    # Marked stopped by a client that found its process gone: no watching.
    assert judge_claim(0.0, now, stale_s=2.0, watched_s=0.0, confirm_s=1.0) == "stopped"


def test_watching_counts_only_time_the_broker_answered_and_the_claim_stood_still() -> None:
    assert watched_after(0.0, same=True, look_s=0.01, since_last_s=0.3, slow_s=0.3) == pytest.approx(0.3)
    assert watched_after(0.6, same=True, look_s=0.01, since_last_s=0.3, slow_s=0.3) == pytest.approx(0.9)
    # The claim moved: its holder wrote it; start over.
    assert watched_after(0.9, same=False, look_s=0.01, since_last_s=0.3, slow_s=0.3) == 0.0
    # A look the broker answered late: it stalled, and the holder's refreshes with it.
    assert watched_after(0.9, same=True, look_s=2.0, since_last_s=2.3, slow_s=0.3) == 0.0


def _watch() -> ClaimWatch:
    return ClaimWatch(stale_s=2.0, confirm_s=1.0, slow_s=0.3, give_up_at=100.0)


def test_a_delivery_judges_a_held_claim_stopped_only_after_watching_it_stand_still() -> None:
    watch, old = _watch(), 1000.0 - 5.0  # written 5 s ago: old by the clock
    looks = [
        (t, watch.judge(7, old, anybody_else=True, asked=t - 0.01, answered=t, now=1000.0))
        for t in (10.0, 10.3, 10.6, 10.9, 11.2)
    ]
    # The first look only starts the watch; then 0.3 s per look the broker answered promptly.
    assert [v for _, v in looks] == ["watch", "watch", "watch", "watch", "stopped"]
    assert watch.watched == pytest.approx(1.2)


def test_a_claim_that_moves_or_a_broker_that_stalls_or_stays_silent_starts_the_watch_over() -> None:
    watch = _watch()
    judge = watch.judge
    assert judge(7, 995.0, anybody_else=True, asked=9.99, answered=10.0, now=1000.0) == "watch"
    assert judge(7, 995.0, anybody_else=True, asked=10.29, answered=10.3, now=1000.0) == "watch"
    assert watch.watched == pytest.approx(0.3)
    assert judge(8, 995.0, anybody_else=True, asked=10.59, answered=10.6, now=1000.0) == "watch"  # it moved
    assert watch.watched == 0.0
    assert judge(8, 995.0, anybody_else=True, asked=10.89, answered=10.9, now=1000.0) == "watch"
    assert judge(8, 995.0, anybody_else=True, asked=10.9, answered=12.9, now=1000.0) == "watch"  # a 2 s look
    assert watch.watched == 0.0
    assert judge(8, 995.0, anybody_else=True, asked=13.19, answered=13.2, now=1000.0) == "watch"
    watch.unanswered()  # a look the broker never answered
    assert (watch.watched, watch.seen) == (0.0, None)
    assert judge(8, 995.0, anybody_else=True, asked=13.49, answered=13.5, now=1000.0) == "watch"
    assert watch.watched == 0.0  # (the first look after silence only starts it again)


def test_a_fresh_claim_is_held_and_one_that_is_nobodys_or_this_processs_is_stopped() -> None:
    assert _watch().judge(7, 999.5, anybody_else=True, asked=9.99, answered=10.0, now=1000.0) == "held"
    assert _watch().judge(None, 0.0, anybody_else=True, asked=9.99, answered=10.0, now=1000.0) == "stopped"
    assert _watch().judge(7, 999.5, anybody_else=False, asked=9.99, answered=10.0, now=1000.0) == "stopped"
    assert _watch().judge(7, 0.0, anybody_else=True, asked=9.99, answered=10.0, now=1000.0) == "stopped"  # marked
    watch = _watch()
    assert not watch.given_up(99.9) and watch.given_up(100.0)


def test_a_stopped_verdict_is_written_as_a_takeover_or_marked_on_the_claim_judged() -> None:
    assert verdict_write(takeover=True, exists=True) == "take_over"
    assert verdict_write(takeover=True, exists=False) == "take_over"
    assert verdict_write(takeover=False, exists=True) == "mark_stopped"
    assert verdict_write(takeover=False, exists=False) == "create_stopped"


@pytest.mark.parametrize("ack_wait_s", [0.3, 2.0, 30.0])
def test_a_proof_of_holding_a_claim_runs_out_before_any_replica_may_write_over_it(ack_wait_s: float) -> None:
    """A holder's write of its claim, stamped ``stamp`` by its own clock, lands at some moment
    ``landed`` >= ``stamp``; its acknowledgement may come back any time later (a link stalled
    towards the holder). A taker whose clock runs far ahead (the claim old by the clock at once)
    and who looks every 0.05 s with the broker answering at once writes over it no sooner than
    ``confirm_s`` after its first look; the holder's proof has run out before that, however late
    the write landed and however late its acknowledgement arrived."""
    keeper = ClaimKeeper(
        None,  # type: ignore[arg-type]  # (its timings only: no bucket is read)
        worker_id="w", ack_wait_s=ack_wait_s, log=None, running=list, abort=print,
    )  # fmt: skip
    assert keeper.hold_s < keeper.confirm_s
    stamp = 1000.0
    for landed in (stamp, stamp + 0.5, stamp + 7.0):
        watch = ClaimWatch(keeper.stale_s, keeper.confirm_s, keeper.refresh_s, give_up_at=float("inf"))
        t, verdict = landed, "watch"
        while verdict == "watch":  # (the taker's looks, all after the write landed)
            t += 0.05
            verdict = watch.judge(7, stamp, anybody_else=True, asked=t - 0.001, answered=t, now=t + 10_000.0)
        assert verdict == "stopped" and t >= landed + keeper.confirm_s
        assert not proof_of_holding(stamp, t, hold_s=keeper.hold_s)
        assert proof_of_holding(stamp, stamp + keeper.hold_s * 0.99, hold_s=keeper.hold_s)


# -- the processes --------------------------------------------------------------------------------


async def test_a_broker_paused_under_a_running_at_most_once_job_keeps_its_holders_answer(
    broker: EmbeddedBroker, namespace: str, tmp_path: Path
) -> None:
    """Item 9: nats-server is SIGSTOPped (2.5 s, again until it has redelivered the job: its
    redelivery races the holder's queued progress acks) while a 10 s at_most_once job runs; no
    process dies. The redelivery reaches the other replica with the claim older than its stale
    bound by the clock, yet the holder is alive and refreshes it once the broker is back: the
    answer is the holder's full result, not Interrupted."""
    assert broker.proc is not None
    group = ProcessGroup(tmp_path)
    topo = TopologyConfig(ack_wait_s=1.0)
    try:
        group.worker(broker.url, namespace, "a", *_SLOW)
        group.worker(broker.url, namespace, "b", *_SLOW)
        async with await RolloutClient.connect(broker.url, namespace=namespace, client_id="c", topology=topo) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=30)
            handle = await client.submit(
                payload(max_tokens=200), min_version=0, retry_policy="at_most_once", timeout=60
            )
            holder = await _holder(client, handle.job_id)
            consumer = client.names.job_consumer("min", 0)
            for _ in range(6):  # (under load a pause may end before the broker redelivers)
                await asyncio.sleep(0.5)
                await _paused(broker.proc, 2.5)
                await asyncio.sleep(0.3)
                info = await client.js.consumer_info(client.names.jobs_stream, consumer)
                if info.delivered.consumer_seq >= 2:
                    break
            else:
                pytest.skip("the broker never redelivered the job after a pause")
            try:
                result = await handle.result(30)
            except Interrupted as exc:
                pytest.fail(f"a live holder was judged gone after a broker pause: {exc}")
            assert isinstance(result, RolloutResult)
            assert result.worker_id == holder and len(result.outputs[0].token_ids) == 200
    finally:
        group.close()


@pytest.mark.parametrize("retry_policy", ["replayable", "at_most_once"])
async def test_a_paused_holder_of_a_sticky_turn_never_answers_it_once_moved(
    nats_url: str, namespace: str, tmp_path: Path, retry_policy: str
) -> None:
    """Item 8 (and a holder paused past the duplicate window): w1 is SIGSTOPped 5 s into a turn it
    holds; the turn moves and w2 runs it (replayable) or answers Interrupted (at_most_once). Once
    resumed, w1 learns from its claim (refreshed by revision) that it lost the turn: it stops
    generating and stores nothing, so the key has one answer even past the duplicate window (2 s
    here), and w1 answered nothing after the first turn."""
    topo = TopologyConfig(ack_wait_s=1.0, duplicate_window_s=2.0)
    group = ProcessGroup(tmp_path)
    try:
        group.worker(nats_url, namespace, "w1", *_SLOW)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            async with client.session(min_version=0, retry_policy=retry_policy, affinity_wait_s=1.0) as s:  # type: ignore[arg-type]
                first = await s.generate(payload([1, 2, 3], max_tokens=2))
                assert first.worker_id == "w1"
                group.worker(nats_url, namespace, "w2", *_SLOW)
                await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=30)
                turn = asyncio.ensure_future(s.generate(payload([1, 2, 3, 4], max_tokens=60)))  # 3 s on w1
                await asyncio.sleep(1.0)
                assert not turn.done()
                await _paused(group.procs["w1"], 5.0)
                if retry_policy == "replayable":
                    second = await asyncio.wait_for(turn, 30)
                    assert second.worker_id == "w2" and len(second.outputs[0].token_ids) == 60
                else:
                    with pytest.raises(Interrupted):
                        await asyncio.wait_for(turn, 30)
                await asyncio.sleep(3.0)  # w1 had 2 s of the turn left: what it would store is stored now
                stored = [o async for _, o in answers.stored(client.js, client.names, "c", s.turn_key(1))]
                assert [o.worker_id for o in stored] == ["w2"]
                w1 = client.fleet.replica("w1")
                assert w1 is not None and w1.jobs_done == 1  # the first turn only
                assert group.log_events("w1", "claim lost; this run stops and answers nothing")
    finally:
        group.close()


@asynccontextmanager
async def _one_replica(broker: EmbeddedBroker, namespace: str, tmp_path: Path) -> AsyncIterator[RolloutClient]:
    """A client (``fail_fast`` off) of a fleet of one echo replica at v0, once it is registered."""
    group = ProcessGroup(tmp_path)
    try:
        group.worker(broker.url, namespace, "a", "--engine", "echo", "--version", "0")
        async with await RolloutClient.connect(
            broker.url, namespace=namespace, client_id="c", fail_fast=False
        ) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            yield client
    finally:
        group.close()


async def test_a_deadline_passing_while_the_broker_is_frozen_is_answered_at_once(
    broker: EmbeddedBroker, namespace: str, tmp_path: Path
) -> None:
    """A job whose deadline passes while the broker is frozen is answered ``Expired`` then, not
    once the broker answers again: the client's sweeps that ask the broker (an idle session closed
    here, whose record is deleted) run beside the deadlines, which need no broker. They held the
    deadlines up for as long as their requests took to time out (campaign seed 313, --cluster:
    a turn answered 7 s after its deadline while a node was cut off)."""
    assert broker.proc is not None
    async with _one_replica(broker, namespace, tmp_path) as client:
        for sid in ("s1", "s2", "s3"):  # each closed in turn, each close waiting on the broker
            await client.session(sid, ttl=0.5).generate(payload(max_tokens=2))  # (idle from now on)
        waiting = await client.submit(payload(), exact_version=7, timeout=2.0)  # nobody serves v7
        answered: list[str] = []

        async def watch() -> None:
            with contextlib.suppress(Exception):
                await waiting.result(30)
            answered.append("answered")

        watcher = asyncio.create_task(watch())
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(9.0)  # its deadline and grace pass (4 s), the sessions' ttl too
            answered.append("broker back")
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        with pytest.raises(Expired):
            await waiting.result(10)
        await watcher
        assert answered == ["answered", "broker back"], answered


async def test_a_turn_expiring_while_the_broker_is_frozen_is_answered_without_waiting_for_its_save(
    broker: EmbeddedBroker, namespace: str, tmp_path: Path
) -> None:
    """A session's turn answered ``Expired`` while the broker is frozen raises then: saving the
    session's record after it waits at most a second past the deadline, not for the broker's
    request to time out (campaign seed 313, --cluster: two turns answered 7-8 s late, each
    behind its record's save while a node was cut off)."""
    assert broker.proc is not None
    async with _one_replica(broker, namespace, tmp_path) as client:
        session = await client.session("frozen", exact_version=7, version_policy="free").open()  # nobody: v7
        answered: list[str] = []

        async def turn() -> None:
            with pytest.raises(Expired):
                await session.generate(payload(max_tokens=2), timeout=1.0)
            answered.append("answered")

        turning = asyncio.create_task(turn())
        await wait_until(lambda: session.next_turn == 1, timeout=10, what="the turn stored")
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            # Its deadline and the client's grace pass (3 s), then its save: 1 s at most, where
            # the broker's request would time out after 5 s (8 s, after the broker is back).
            await asyncio.sleep(7.0)
            answered.append("broker back")
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        await turning
        assert answered == ["answered", "broker back"], answered
