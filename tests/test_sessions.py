"""Sessions against a real broker and real workers: turns stick to the replica holding their
context, move (once, bounded) when it is busy or dies, follow the session's version policy
across activations, are answered once each, and end on close or ttl."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import signal
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness import ProcessGroup, running_worker, wait_until, write_base_checkpoint
from harness.weights import tensors_at
from rollfleet.cli.status import collect_status, render_table
from rollfleet.schemas import Outcome, RolloutPayload, RolloutResult, SamplingParams, VersionConstraint
from rollfleet.schemas.errors import (
    Expired,
    Interrupted,
    InvalidRequest,
    NoCompatibleReplica,
    SessionConflict,
    UnknownSession,
)
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.trainer_client.sessions import version_policy
from rollfleet.trainer_client.sessions.turn_replica import fewest_held
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import CountingEcho


def turn_payload(context: list[int], max_tokens: int = 6) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=list(context), sampling=SamplingParams(max_tokens=max_tokens))


async def converse(session: Any, turns: int, *, env_tokens: int = 20, max_tokens: int = 6) -> list[RolloutResult]:
    """A multi-turn conversation: each turn's prompt is the whole context so far."""
    context = list(range(1, 30))
    results = []
    for turn in range(turns):
        result = await session.generate(turn_payload(context, max_tokens))
        results.append(result)
        context += result.outputs[0].token_ids + [100 + turn] * env_tokens
    return results


def answers_per_key(client: RolloutClient) -> dict[str, int]:
    seen: dict[str, int] = {}

    def observe(outcome: Outcome, _seq: int | None) -> None:
        seen[outcome.idempotency_key] = seen.get(outcome.idempotency_key, 0) + 1

    client.observe = observe
    return seen


async def test_turns_stick_to_the_replica_holding_their_context(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=EchoEngine()) as a,
        running_worker(nats_url, namespace, worker_id="b", engine=EchoEngine()) as b,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 2)
        sessions = [await client.session(min_version=0).open() for _ in range(6)]
        results = await asyncio.gather(*[converse(s, 6) for s in sessions])
        for turns in results:
            assert len({r.worker_id for r in turns}) == 1, [r.worker_id for r in turns]  # never moved
            assert all(r.cached_tokens > 0 for r in turns[1:])  # every later turn reused its context
            assert all(r.session_id == turns[0].session_id for r in turns)
        assert client.metrics.affinity_hits._value.get() == 6 * 5
        # (Where first turns land is the pulls' business: one replica's waiting request may take
        # them all; each session then sticks to whichever replica served its first turn.)
        # The registry says how many sessions each replica holds (rollfleet status shows it).
        for worker in (a, b):
            assert worker.registration is not None
            await worker.registration.write()

        def held() -> int:
            return sum(r.sessions for w in ("a", "b") if (r := client.fleet.replica(w)) is not None)

        await wait_until(lambda: held() == 6, timeout=5, what="6 sessions in the registry")
        # ... and `rollfleet status` shows them, a column per replica.
        snapshot = await collect_status(nats_url, namespace)
        assert sum(r["sessions"] for r in snapshot["replicas"]) == 6
        table = render_table(snapshot).splitlines()
        column = table[2].index("sessions")
        assert sum(int(line[column:].split()[0]) for line in table[3:5]) == 6
        for s in sessions:
            await s.close()  # each replica drops the contexts it held
        await wait_until(lambda: a.engine.session_cache_stats().entries + b.engine.session_cache_stats().entries == 0)


def test_a_first_turn_goes_to_the_replica_holding_the_fewest_sessions() -> None:
    held: Counter[str | None] = Counter({"a": 3, "b": 1, None: 7})  # (None: sessions not placed)
    assert fewest_held(["a", "b"], held) == "b"
    ties = Counter(fewest_held(["a", "b", "c"], Counter(), random.Random(seed)) for seed in range(60))
    assert set(ties) == {"a", "b", "c"}  # ties broken at random, not always the first


async def test_bursts_of_new_sessions_spread_evenly_over_the_fleet(nats_url: str, namespace: str) -> None:
    """Sessions whose first turn is on its way count where they were sent: three bursts of 12 new
    sessions on 2 replicas split 6/6 each (before, a burst saw only answered sessions, and went
    6/6, then 9/3, then 12/0)."""
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=EchoEngine()),
        running_worker(nats_url, namespace, worker_id="b", engine=EchoEngine()),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 2)
        splits = []
        for _burst in range(3):
            sessions = [await client.session(min_version=0).open() for _ in range(12)]
            results = await asyncio.gather(*[s.generate(turn_payload(list(range(1, 9)))) for s in sessions])
            splits.append(Counter(r.worker_id for r in results))
        assert splits == [Counter(a=6, b=6)] * 3, splits


async def test_a_busy_sticky_replica_costs_one_bounded_wait_then_the_turn_moves(nats_url: str, namespace: str) -> None:
    busy = CountingEcho(per_token_s=0.05)
    async with (
        running_worker(nats_url, namespace, worker_id="a", capacity=1, engine=busy),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        seen = answers_per_key(client)
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with client.session(min_version=0, affinity_wait_s=0.5) as s:
            first = await s.generate(turn_payload([1, 2, 3]))
            assert first.worker_id == "a"
            hog = await client.submit(turn_payload([9], max_tokens=100), min_version=0)  # a's one slot, 5 s
            await wait_until(lambda: len(busy.calls) == 2, timeout=5)
            async with running_worker(nats_url, namespace, worker_id="b", engine=EchoEngine()):
                await wait_until(lambda: len(client.fleet.replicas()) == 2)
                t0 = time.monotonic()
                second = await s.generate(turn_payload([1, 2, 3, *first.outputs[0].token_ids, 7]))
                waited = time.monotonic() - t0
                assert second.worker_id == "b" and waited < 3.0  # not behind a's 5 s job
                assert s.replica == "b"  # the session moved with it
                await hog.result(15)
        fallbacks = client.metrics.affinity_fallbacks.labels(client_id="c", reason="not_taken_in_time")
        assert fallbacks._value.get() == 1
        await asyncio.sleep(0.3)
        assert seen[s.turn_key(1)] == 1  # answered once
        assert len(busy.calls) == 2  # a never ran the moved turn


async def test_a_steady_stream_of_turns_does_not_starve_shared_work(nats_url: str, namespace: str) -> None:
    """One replica with one slot; three sessions keep a turn waiting on its own subject at all
    times (turns go first there). A shared job stored meanwhile is still served once it has
    waited aging_s, not left to its deadline behind the turns."""
    engine = CountingEcho(per_token_s=0.02)
    async with (
        running_worker(nats_url, namespace, worker_id="a", capacity=1, engine=engine, aging_s=1.0),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        stop = asyncio.Event()
        turns = 0

        async def chat(i: int) -> None:
            nonlocal turns
            async with client.session(min_version=0, affinity_wait_s=60.0) as s:
                while not stop.is_set():
                    result = await s.generate(turn_payload([i, s.next_turn], max_tokens=10), timeout=30)  # 0.2 s
                    assert result.worker_id == "a"
                    turns += 1

        chats = [asyncio.create_task(chat(i)) for i in range(3)]
        try:
            await wait_until(lambda: turns >= 6, timeout=15)
            t0 = time.monotonic()
            shared = await client.submit(turn_payload([42], max_tokens=2), min_version=0, timeout=12)
            result = await shared.result(15)
            waited = time.monotonic() - t0
            turns_meanwhile = turns
        finally:
            stop.set()
            await asyncio.gather(*chats)
    assert result.worker_id == "a" and turns_meanwhile > 6  # the turns kept coming all along
    assert waited < 6.0, waited  # about a second of stall watch plus aging_s, not the 12 s deadline


@pytest.mark.parametrize("retry_policy", ["replayable", "at_most_once", "resume"])
async def test_sticky_replica_sigkilled_mid_turn_the_turn_is_answered_once(
    nats_url: str, namespace: str, tmp_path: Path, retry_policy: str
) -> None:
    """The sticky replica dies (SIGKILL) while generating a turn: the client notices (no
    responders to its probe), moves the same job to the shared subject, and the survivor serves it
    (replayable), continues it from the dead replica's checkpoints (resume) or answers Interrupted
    without running it (at_most_once). One answer either way."""
    group = ProcessGroup(tmp_path)
    slow = ("--echo-token-latency", "0.05", "--checkpoint-tokens", "8")
    try:
        group.worker(nats_url, namespace, "w1", *slow)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            seen = answers_per_key(client)
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            async with client.session(min_version=0, retry_policy=retry_policy, affinity_wait_s=1.0) as s:  # type: ignore[arg-type]
                first = await s.generate(turn_payload([1, 2, 3], max_tokens=2))
                assert first.worker_id == "w1"
                group.worker(nats_url, namespace, "w2", *slow)
                await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=30)
                turn = asyncio.ensure_future(s.generate(turn_payload([1, 2, 3, 4], max_tokens=60)))  # 3 s on w1
                await asyncio.sleep(1.0)
                assert not turn.done()
                group.procs["w1"].send_signal(signal.SIGKILL)
                t0 = time.monotonic()
                if retry_policy != "at_most_once":
                    second = await asyncio.wait_for(turn, 30)
                    assert second.worker_id == "w2" and len(second.outputs[0].token_ids) == 60
                    assert s.replica == "w2"
                    spans = second.outputs[0].weight_versions
                    if retry_policy == "resume":  # the tokens w1 checkpointed (8 per record) are kept
                        assert [x.replica for x in spans] == ["w1", "w2"] and second.kept_tokens >= 8
                        assert spans[0].end == second.kept_tokens and second.kept_tokens % 8 == 0
                else:
                    with pytest.raises(Interrupted):
                        await asyncio.wait_for(turn, 30)
                # The probe noticed, not the 30 s ack wait (a resumed turn also waits out the dead
                # holder's claim and reads its checkpoints: 12.5 s seen on a loaded suite).
                assert time.monotonic() - t0 < 20.0
                await asyncio.sleep(0.5)
                assert seen[s.turn_key(1)] == 1
                third = await s.generate(turn_payload([5, 6], max_tokens=2))  # the session goes on
                assert third.worker_id == "w2"
    finally:
        group.close()


async def test_sticky_replica_killed_between_turns_costs_no_wait(nats_url: str, namespace: str, tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    try:
        group.worker(nats_url, namespace, "w1")
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=30)
            async with client.session(min_version=0, affinity_wait_s=120.0) as s:
                assert (await s.generate(turn_payload([1]))).worker_id == "w1"
                group.worker(nats_url, namespace, "w2")
                await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=30)
                group.kill("w1")
                # Its bell found no responders: moved at once, not after the 120 s affinity wait.
                result = await asyncio.wait_for(s.generate(turn_payload([1, 2])), 30)
                assert result.worker_id == "w2"
    finally:
        group.close()


@pytest.fixture
def publisher(tmp_path: Path) -> PolicyPublisher:
    return PolicyPublisher(tmp_path / "store", write_base_checkpoint(tmp_path / "base"), keep_last=None)


def follower(tmp_path: Path, name: str, **config: Any) -> dict[str, Any]:
    return {"store_dir": tmp_path / "store", "local_dir": tmp_path / f"local-{name}", "worker_id": name, **config}


_NONE = SimpleNamespace(active_version=-1)


@pytest.mark.parametrize("policy", ["pinned", "monotonic", "free"])
async def test_version_policies_hold_across_activations(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher, policy: str
) -> None:
    """Replica ``new`` follows the store (0, then 1, then 2); replica ``old`` stays at 0. Sessions
    run turns while versions are published: pinned turns all run at the first turn's version,
    monotonic turns never go back to an older version than the previous turn, and free turns
    (``max_staleness=1``) satisfy the constraint recomputed at each turn from the latest version,
    not the first turn's. Every turn reports its per-token versions."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with running_worker(
            nats_url, namespace, engine=EchoEngine(per_token_s=0.01), **follower(tmp_path, "new")
        ):
            await client.wait_for_version(0, replicas=1, timeout=20)
            constraint: dict[str, int] = {"max_staleness": 1} if policy == "free" else {"min_version": 0}
            sessions = [client.session(version_policy=policy, **constraint) for _ in range(4)]  # type: ignore[arg-type]
            for s in sessions:
                await s.open()
            turns: dict[str, list[RolloutResult]] = {s.session_id: [] for s in sessions}
            floors: dict[str, list[int]] = {s.session_id: [] for s in sessions}  # free: latest - 1 at submit
            # Every session's first turn runs on `new` (the only replica yet), so every session has
            # an activation to live through; `old` joins after, at version 0, for the policies to
            # keep turns off (monotonic) or on (pinned).
            for s in sessions:
                floors[s.session_id].append(0)
                turns[s.session_id].append(await s.generate(turn_payload([1, 2, 3], max_tokens=20)))
            late = contextlib.AsyncExitStack()
            await late.enter_async_context(
                running_worker(
                    nats_url, namespace, version=0, worker_id="old", engine=EchoEngine(per_token_s=0.01), capacity=1
                )
            )
            await client.wait_for_version(0, replicas=2, timeout=20)

            async def run(s: Any) -> None:
                context = [1, 2, 3, *turns[s.session_id][0].outputs[0].token_ids]
                # 0.2 s a turn: the versions land while they run. At least 12 turns, and on until
                # `new` serves version 2 and, for monotonic sessions, some turn has run past
                # version 0 (a loaded host activates slowly; the check below needs it), at most 60.
                done = turns[s.session_id]

                def settled() -> bool:
                    moved = policy != "monotonic" or any(r.version_end >= 1 for rs in turns.values() for r in rs)
                    return moved and (client.fleet.replica("new") or _NONE).active_version >= 2

                while len(done) < 12 or (len(done) < 60 and not settled()):
                    floors[s.session_id].append(max(0, (client.latest_version or 0) - 1))
                    r = await s.generate(turn_payload(context, max_tokens=20))
                    turns[s.session_id].append(r)
                    context += r.outputs[0].token_ids

            runs = asyncio.gather(*[run(s) for s in sessions])
            for version in (1, 2):
                await asyncio.sleep(0.3)
                await client.publish_policy(publisher, tensors_at(version))
            try:
                await asyncio.wait_for(runs, 60)
                for s in sessions:
                    await s.close()
            finally:
                await late.aclose()
    for results in turns.values():
        for r in results:  # the spans cover every token and agree with the reported range
            spans = r.outputs[0].weight_versions
            assert spans[0].start == 0 and spans[-1].end == len(r.outputs[0].token_ids)
            assert (spans[0].version, spans[-1].version) == (r.version_start, r.version_end)
        if policy == "pinned":
            pin = results[0].version_start
            assert all(r.version_start == r.version_end == pin for r in results), [
                (r.version_start, r.version_end) for r in results
            ]
        elif policy == "monotonic":
            for prev, nxt in itertools.pairwise(results):
                assert nxt.version_start >= prev.version_end
    if policy == "free":  # each turn by its own constraint: never below latest - 1 at its submit
        for sid, results in turns.items():
            assert all(r.version_start >= floor for r, floor in zip(results, floors[sid], strict=True))
        assert max(f for fl in floors.values() for f in fl) >= 1  # the floor did move
    if policy == "monotonic":  # the policy had something to hold: some session saw a newer version
        assert any(r.version_end >= 1 for results in turns.values() for r in results)


async def test_a_turn_asked_again_returns_its_stored_answer_also_after_a_restart(nats_url: str, namespace: str) -> None:
    engine = CountingEcho()
    async with running_worker(nats_url, namespace, worker_id="a", engine=engine):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            s = await client.session(min_version=0).open()
            first = await s.generate(turn_payload([1, 2]))
            again = await s.generate(turn_payload([1, 2]), turn=0)
            assert again.job_id == first.job_id and len(engine.calls) == 1
            sid = s.session_id
        # A restarted trainer (same client id) resumes the session from its record.
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            s = await client.resume_session(sid)
            assert s.next_turn == 1 and s.replica == "a"
            stored = await s.generate(turn_payload([1, 2]), turn=0, timeout=10)
            assert stored.job_id == first.job_id and stored.outputs == first.outputs
            assert len(engine.calls) == 1  # never generated twice
            nxt = await s.generate(turn_payload([1, 2, 3]))
            assert nxt.worker_id == "a" and len(engine.calls) == 2
            await s.close()


async def test_ttl_ends_the_session_and_cleans_up(nats_url: str, namespace: str) -> None:
    engine = EchoEngine()
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        # (3 s: the first turn and the looks below fit in it on a loaded host; make test run I saw
        # a 1 s session expire between its open and its first turn)
        s = await client.session(min_version=0, ttl=3.0).open()
        await s.generate(turn_payload([1, 2, 3]))
        assert engine.session_cache_stats().entries == 1
        kv = await client.js.key_value(client.names.sessions_bucket)
        key = client.names.session_key(s.session_id)
        assert (await kv.get(key)).value

        async def gone() -> bool:
            try:
                entry = await kv.get(key)
            except Exception:
                return True
            return not entry.value

        await wait_until(gone, timeout=10, what="the session record removed after its ttl")
        await wait_until(lambda: engine.session_cache_stats().entries == 0, timeout=5, what="the replica's cache")
        with pytest.raises(UnknownSession):
            await s.generate(turn_payload([1, 2, 3, 4]))
        with pytest.raises(UnknownSession):
            await client.resume_session(s.session_id)


async def test_closing_a_session_drops_its_context_on_the_replica(nats_url: str, namespace: str) -> None:
    engine = EchoEngine()
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        async with client.session(min_version=0) as s:
            await converse(s, 2)
            assert engine.session_cache_stats().entries == 1
        await wait_until(lambda: engine.session_cache_stats().entries == 0, timeout=5)


async def test_bad_session_input_gets_typed_errors(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=EchoEngine(per_token_s=0.02)),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        with pytest.raises(UnknownSession):
            await client.resume_session("never-opened")
        with pytest.raises(InvalidRequest):
            client.session("a/b")  # not a token
        with pytest.raises(InvalidRequest):
            client.session(version_policy="sometimes")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest):
            client.session(ttl=0)
        with pytest.raises(InvalidRequest):
            client.session(min_version=0, exact_version=0)
        async with client.session("s1", min_version=0, version_policy="monotonic") as s:
            with pytest.raises(SessionConflict, match="out of order"):
                await s.generate(turn_payload([1]), turn=3)
            with pytest.raises(InvalidRequest):
                await s.generate(turn_payload([1]), turn=-1)
            with pytest.raises(SessionConflict, match="other settings"):
                await client.session("s1", min_version=0, version_policy="pinned").open()
            running = asyncio.ensure_future(s.generate(turn_payload([1], max_tokens=50)))
            await asyncio.sleep(0.2)
            with pytest.raises(SessionConflict, match="still running"):
                await s.generate(turn_payload([1, 2]))
            await running
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="other") as other:
            async with client.session("s2", min_version=0):
                with pytest.raises(SessionConflict, match="belongs to client"):
                    await other.session("s2", min_version=0).open()
        with pytest.raises(NoCompatibleReplica):
            await (await client.session(min_version=5, version_policy="pinned").open()).generate(turn_payload([1]))


# -- the schedules an outside review combined (issue 19) -------------------------------------------


async def test_a_resumed_turn_left_on_a_stopped_replica_moves_at_once(nats_url: str, namespace: str) -> None:
    """Client A stores turn 1 on w1's own subject (w1 busy) and dies; w1 is stopped. Client B (the
    same client id) resumes the session and asks for turn 1 again: the resubmission is a duplicate
    of A's job, which still waits on w1's subject. B follows that job where it is, sees w1 gone
    and moves it: w2 answers in seconds, once (not after the 600 s deadline)."""
    busy = CountingEcho(per_token_s=0.05)
    w1_ctx = running_worker(nats_url, namespace, worker_id="w1", capacity=1, engine=busy)
    await w1_ctx.__aenter__()
    try:
        a = await RolloutClient.connect(nats_url, namespace=namespace, client_id="c")
        s = await a.session(min_version=0, affinity_wait_s=30.0).open()
        await wait_until(lambda: len(a.fleet.replicas()) == 1)
        assert (await s.generate(turn_payload([1, 2]))).worker_id == "w1"
        hog = await a.submit(turn_payload([9], max_tokens=40), min_version=0)  # w1's one slot, 2 s
        await wait_until(lambda: len(busy.calls) == 2, timeout=5)
        turn = asyncio.ensure_future(s.generate(turn_payload([1, 2, 3])))
        await wait_until(lambda: any(h.replica == "w1" for h in a._handles.values() if h is not hog), timeout=5)
        turn.cancel()
        await a.nc.close()  # A dies: no close, no record saved for turn 1
    finally:
        await w1_ctx.__aexit__(None, None, None)  # w1 stops (finishing the hog), never taking turn 1
    assert busy.calls[2:] == []
    async with (
        running_worker(nats_url, namespace, worker_id="w2", engine=CountingEcho()) as w2,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as b,
    ):
        seen = answers_per_key(b)
        await wait_until(lambda: [r.worker_id for r in b.fleet.replicas()] == ["w2"], timeout=10)
        resumed = await b.resume_session(s.session_id)
        assert resumed.next_turn == 1
        t0 = time.monotonic()
        result = await asyncio.wait_for(resumed.generate(turn_payload([1, 2, 3])), 20)
        assert result.worker_id == "w2" and time.monotonic() - t0 < 10.0
        assert len(w2.engine.calls) == 1  # type: ignore[attr-defined]
        await asyncio.sleep(0.3)
        assert seen[resumed.turn_key(1)] == 1


@pytest.mark.parametrize("retry_policy", ["replayable", "at_most_once"])
async def test_a_turn_on_a_gracefully_draining_replica_is_finished_there(
    nats_url: str, namespace: str, retry_policy: str
) -> None:
    """SIGTERM (as `docker compose --scale` down sends) while w1 runs a turn: w1 drains, finishing
    what it holds. The turn is not moved meanwhile: w1 answers it, w2 never runs it, and an
    at_most_once turn is not answered Interrupted."""
    e1, e2 = CountingEcho(per_token_s=0.05), CountingEcho()
    w1_ctx = running_worker(nats_url, namespace, worker_id="w1", engine=e1)
    w1 = await w1_ctx.__aenter__()
    stopping = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1)
            async with client.session(min_version=0, retry_policy=retry_policy, affinity_wait_s=0.5) as s:  # type: ignore[arg-type]
                assert (await s.generate(turn_payload([1], max_tokens=2))).worker_id == "w1"
                async with running_worker(nats_url, namespace, worker_id="w2", engine=e2):
                    await wait_until(lambda: len(client.fleet.replicas()) == 2)
                    turn = asyncio.ensure_future(s.generate(turn_payload([1, 2], max_tokens=60)))  # 3 s on w1
                    await wait_until(lambda: len(e1.calls) == 2, timeout=5)
                    stopping = asyncio.ensure_future(w1.stop())  # draining
                    result = await asyncio.wait_for(turn, 20)
                    assert result.worker_id == "w1" and len(result.outputs[0].token_ids) == 60
                    assert e2.calls == []
    finally:
        if stopping is not None:
            await stopping
        await w1_ctx.__aexit__(None, None, None)


async def test_a_turn_that_failed_before_it_was_stored_can_be_asked_again(nats_url: str, namespace: str) -> None:
    """No replica at all: turn 0 fails with NoCompatibleReplica before anything is stored, so its
    index is not spent; asked again once a replica is up, it runs."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        s = await client.session(min_version=0).open()
        with pytest.raises(NoCompatibleReplica):
            await s.generate(turn_payload([1]))
        assert s.next_turn == 0
        async with running_worker(nats_url, namespace, worker_id="a"):
            await wait_until(lambda: len(client.fleet.replicas()) == 1)
            result = await asyncio.wait_for(s.generate(turn_payload([1]), turn=0), 10)
            assert result.worker_id == "a" and s.next_turn == 1


async def test_a_turn_answered_with_an_error_raises_it_again_when_asked_again(nats_url: str, namespace: str) -> None:
    """Turn 1 waits on its busy replica past its deadline: Expired. Asked again (this process, and
    a restarted one resuming the session), it raises Expired again at once instead of waiting."""
    busy = CountingEcho(per_token_s=0.05)
    async with running_worker(nats_url, namespace, worker_id="a", capacity=1, engine=busy):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1)
            s = await client.session(min_version=0, affinity_wait_s=60.0).open()
            await s.generate(turn_payload([1], max_tokens=2))
            hog = await client.submit(turn_payload([9], max_tokens=120), min_version=0)  # 6 s
            await wait_until(lambda: len(busy.calls) == 2, timeout=5)
            with pytest.raises(Expired):
                await s.generate(turn_payload([1, 2]), timeout=1.0)
            with pytest.raises(Expired):  # the stored answer, not a new wait for the turn
                await asyncio.wait_for(s.generate(turn_payload([1, 2]), turn=1), 10)
            assert s.next_turn == 2
            sid = s.session_id
            await hog.result(10)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            resumed = await client.resume_session(sid)
            with pytest.raises(Expired):
                await asyncio.wait_for(resumed.generate(turn_payload([1, 2]), turn=1), 10)


async def test_a_pinned_session_the_fleet_left_says_so_and_a_held_replica_serves_it(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """A session pinned to v0; the only replica moves to v1. The next turn fails at once with an
    error that names the pin, is not retryable (every replica is past it), and spends no turn.
    A replica started with --hold-version 0 (the documented way) then serves the turn at v0."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with running_worker(nats_url, namespace, **follower(tmp_path, "new")):
            await client.wait_for_version(0, replicas=1, timeout=20)
            async with client.session(min_version=0, version_policy="pinned") as s:
                assert (await s.generate(turn_payload([1]))).version_start == 0
                await client.publish_policy(publisher, tensors_at(1))
                await client.wait_for_version(1, replicas=1, timeout=20)
                with pytest.raises(NoCompatibleReplica, match="pinned to version 0") as caught:
                    await s.generate(turn_payload([1, 2]))
                assert caught.value.retryable is False and "--hold-version 0" in caught.value.message
                assert s.next_turn == 1
                async with running_worker(nats_url, namespace, **follower(tmp_path, "held", hold_version=0)):
                    await wait_until(lambda: client.fleet.compatible(VersionConstraint("exact", 0)), timeout=20)
                    result = await s.generate(turn_payload([1, 2]))
                    assert result.worker_id == "held" and result.version_start == result.version_end == 0
                    # The held replica stays at 0 when more versions come.
                    await client.publish_policy(publisher, tensors_at(2))
                    await client.wait_for_version(2, replicas=1, timeout=20)
                    assert (await s.generate(turn_payload([1, 2, 3]))).version_end == 0


async def test_a_resumed_pinned_session_keeps_the_pin_of_the_turn_its_dead_client_stored(
    nats_url: str, namespace: str, tmp_path: Path, publisher: PolicyPublisher
) -> None:
    """Client A stores turn 0 of a pinned session at v0 and dies before it saves the session (so
    the pin is saved nowhere). v1 is committed; client B resumes the session and asks turn 0
    again: it gets A's stored answer at v0, and the session stays pinned there: turn 1 is served
    at v0 too (by a replica held at v0), not at B's own guess of a pin, v1."""
    async with contextlib.AsyncExitStack() as workers:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as a:
            await a.publish_policy(publisher, tensors_at(0))
            for name, held in (("held", {"hold_version": 0}), ("new", {})):
                worker = running_worker(nats_url, namespace, **follower(tmp_path, name, **held))
                await workers.enter_async_context(worker)
            await a.wait_for_version(0, replicas=2, timeout=20)
            s = await a.session(version_policy="pinned").open()
            sid, first = s.session_id, turn_payload([1])
            # What generate() does for turn 0, short of saving the session afterwards (A dies then).
            handle = await a.submit_turn(
                first, VersionConstraint("exact", 0), written=version_policy.written(s.record), key=s.turn_key(0),
                timeout=None, retry_policy="replayable", session_id=sid, replica=None, asked_at=time.time(),
            )  # fmt: skip
            assert (await handle.result(10)).version_end == 0
            a.sessions.pop(sid, None)  # (A's handle is gone with it; its close would delete the record)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as b:
            await b.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: (r := b.fleet.replica("new")) is not None and r.active_version == 1, 20)
            async with b.session(sid, version_policy="pinned") as resumed:
                assert resumed.next_turn == 0  # A never saved it
                again = await resumed.generate(first)
                assert again.job_id == handle.job_id and again.version_end == 0  # A's answer
                second = await resumed.generate(turn_payload([1, 2]))
    assert (second.version_start, second.version_end, second.worker_id) == (0, 0, "held")


async def test_a_resumed_session_whose_record_lost_a_stored_turn_moves_past_it(nats_url: str, namespace: str) -> None:
    """Client A stores turn 0 and its record never says so (A killed before saving; or the save
    lost with a broker store rolled back: campaign 12, seed 167). Client B resumes at turn 0 and
    asks it with another prompt: the index is taken, so B gets a SessionConflict naming it, the
    session moves past it, turn 0 asked again returns A's answer, and B's next turn is turn 1."""
    engine = CountingEcho()
    async with running_worker(nats_url, namespace, worker_id="a", engine=engine):
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as a:
            s = await a.session(min_version=0).open()
            sid = s.session_id
            handle = await a.submit_turn(
                turn_payload([1, 2]), VersionConstraint("min", 0), written=version_policy.written(s.record),
                key=s.turn_key(0), timeout=None, retry_policy="replayable", session_id=sid, replica=None,
                asked_at=time.time(),
            )  # fmt: skip
            first = await handle.result(10)
            a.sessions.pop(sid, None)  # (A's handle is gone with it; its close would delete the record)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as b:
            resumed = await b.resume_session(sid)
            assert resumed.next_turn == 0  # A never saved it
            with pytest.raises(SessionConflict) as caught:
                await resumed.generate(turn_payload([7, 7, 7]), timeout=10)
            assert "turn 0" in caught.value.message and "generate(turn=0)" in caught.value.message
            assert resumed.next_turn == 1
            again = await resumed.generate(turn_payload([7, 7, 7]), turn=0, timeout=10)
            assert again.job_id == first.job_id and again.outputs == first.outputs
            second = await resumed.generate(turn_payload([7, 7, 7]), timeout=10)
            assert second.idempotency_key == resumed.turn_key(1)
            assert len(engine.calls) == 2  # turn 0 was never generated again
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as c:
            assert (await c.resume_session(sid)).next_turn == 2  # the record says so now


async def test_a_session_closed_through_another_handle_stays_closed(nats_url: str, namespace: str) -> None:
    """Handle B (a resume of the same id) closes the session while handle A has a turn running:
    A's turn is answered, but its save does not bring the record back, and A's next turn is
    refused; the session cannot be resumed."""
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=EchoEngine(per_token_s=0.05)),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        a = await client.session(min_version=0).open()
        await a.generate(turn_payload([1], max_tokens=2))
        b = await client.resume_session(a.session_id)
        running = asyncio.ensure_future(a.generate(turn_payload([1, 2], max_tokens=40)))  # 2 s
        await asyncio.sleep(0.5)
        await b.close()
        assert (await running).worker_id == "a"  # answered: it was running
        with pytest.raises(UnknownSession):
            await client.resume_session(a.session_id)
        with pytest.raises(UnknownSession):
            await a.generate(turn_payload([1, 2, 3]))


async def test_a_session_id_opened_again_after_a_close_is_a_new_session(nats_url: str, namespace: str) -> None:
    """Within the duplicate window, a session opened again under a closed one's id meets none of
    its answers: the same first prompt is generated afresh, another one is no conflict."""
    engine = CountingEcho()
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        async with client.session("again", min_version=0) as s:
            first = await s.generate(turn_payload([1, 2]))
        async with client.session("again", min_version=0) as s:
            second = await s.generate(turn_payload([1, 2]))
            assert second.job_id != first.job_id and len(engine.calls) == 2
        async with client.session("again", min_version=0) as s:
            third = await s.generate(turn_payload([7, 7, 7]))  # no IdempotencyConflict
            assert third.outputs != first.outputs and len(engine.calls) == 3


async def test_a_moved_turn_whose_new_holder_dies_is_stored_again_at_once(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A turn moved to the shared subject (its replica busy) is taken there by w2, which is then
    SIGKILLed: the watch sees, from the turn's claim, that the process holding it is gone, marks
    the claim stopped and stores the job again; w1 serves it well before the broker would have
    redelivered it (ack_wait, 30 s)."""
    busy = CountingEcho(per_token_s=0.05)
    group = ProcessGroup(tmp_path)
    try:
        async with (
            running_worker(nats_url, namespace, worker_id="w1", capacity=1, engine=busy),
            await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
        ):
            seen = answers_per_key(client)
            await wait_until(lambda: len(client.fleet.replicas()) == 1)
            async with client.session(min_version=0, affinity_wait_s=0.5) as s:
                assert (await s.generate(turn_payload([1], max_tokens=2))).worker_id == "w1"
                hog = await client.submit(turn_payload([9], max_tokens=120), min_version=0)  # w1 slot, 6 s
                await wait_until(lambda: len(busy.calls) == 2, timeout=5)
                group.worker(nats_url, namespace, "w2", "--echo-token-latency", "0.05")
                await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=30)
                turn = asyncio.ensure_future(s.generate(turn_payload([1, 2], max_tokens=100)))  # 5 s on w2
                await wait_until(
                    lambda: (
                        client.metrics.affinity_fallbacks.labels(client_id="c", reason="not_taken_in_time")._value.get()
                        == 1
                    ),
                    timeout=10,
                )
                await asyncio.sleep(1.0)  # running on w2
                group.kill("w2")
                t0 = time.monotonic()
                result = await asyncio.wait_for(turn, 30)
                assert result.worker_id == "w1" and time.monotonic() - t0 < 20.0
                await hog.result(10)
                await asyncio.sleep(0.3)
                assert seen[s.turn_key(1)] == 1
    finally:
        group.close()
