"""Cancelling a job: withdrawn if nobody took it, stopped where it runs if a replica did, and
``cancel()`` says which (``trainer_client.cancelling``)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest
from nats.aio.msg import Msg

from harness import running_worker, wait_until
from rollfleet.schemas import Completion, RolloutResult, claim_key
from rollfleet.schemas.errors import Cancelled, Expired
from rollfleet.trainer_client import RolloutClient, answers
from rollfleet.trainer_client.cancelling import must_stop, next_cancel, on_leaving, outcome_of
from tests.helpers import CountingEcho, payload

LONG = 1500  # tokens; 15 s at 10 ms a token: far longer than any wait below


def _result(*finishes: str) -> RolloutResult:
    outs = [Completion(token_ids=[1], finish_reason=f) for f in finishes]  # type: ignore[arg-type]
    return RolloutResult(
        job_id="j", idempotency_key="k", client_id="c", outputs=outs, version_start=0, version_end=0,
        worker_id="w", engine="echo", queue_wait_s=0.0, generation_s=0.0, delivery_attempt=1, finished_at=0.0,
    )  # fmt: skip


async def test_an_engine_abort_reaches_only_a_request_generating_now() -> None:
    # Campaign 9, seed 389: an activation's drain aborted a resumable job's run before its engine
    # request began; the echo engine kept the mark, and the job's next run on that replica was
    # aborted at once and answered with an empty "abort" sample. Real engines ignore such an id.
    from rollfleet.workers.engines.echo import EchoEngine

    engine = EchoEngine(per_token_s=0.01)
    await engine.abort("job-1")  # nothing runs under that id
    out = await engine.generate("job-1", payload(max_tokens=5))
    assert [c.finish_reason for c in out.outputs] == ["length"] and len(out.outputs[0].token_ids) == 5
    running = asyncio.ensure_future(engine.generate("job-1", payload(max_tokens=500)))
    await asyncio.sleep(0.05)
    await engine.abort("job-1")  # generating now: stopped where it is
    out = await running
    assert out.outputs[0].finish_reason == "abort" and 0 < len(out.outputs[0].token_ids) < 500
    out = await engine.generate("job-1", payload(max_tokens=5))  # the mark ended with that request
    assert out.outputs[0].finish_reason == "length"


def test_only_a_job_removed_before_any_delivery_needs_no_stop() -> None:
    assert not must_stop(delivered=False, removed=True)
    assert must_stop(delivered=True, removed=True)  # running: deleted from the queue, still running
    assert must_stop(delivered=None, removed=True)  # the broker did not say: ask
    assert must_stop(delivered=False, removed=False)  # taken between the two looks


def test_what_the_cancel_did_is_read_from_the_answer() -> None:
    assert outcome_of(None) == "unknown"
    assert outcome_of(Cancelled("before it ran")) == "stopped"
    assert outcome_of(_result("length", "abort")) == "stopped"
    assert outcome_of(_result("length", "stop")) == "answered"
    assert outcome_of(Expired("late")) == "answered"


@pytest.mark.parametrize("policy", ["replayable", "at_most_once", "resume"])
async def test_a_running_job_cancelled_stops_frees_its_slot_and_is_answered_once(
    nats_url: str, namespace: str, policy: str
) -> None:
    engine = CountingEcho(per_token_s=0.01)
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=1, checkpoint_tokens=16),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        long = await client.submit(
            payload(max_tokens=LONG), min_version=0, idempotency_key="long", retry_policy=policy, timeout=6
        )
        queued = await client.submit(payload(max_tokens=4), min_version=0, idempotency_key="next")
        await wait_until(lambda: engine.running == 1, timeout=10, what="the long job running")
        await asyncio.sleep(0.5)
        assert await long.cancel() == "stopped"
        partial = await long.result(0)
        out = partial.outputs[0]
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < LONG
        # The slot is free: the queued job runs now, not after the 15 s the long one had left.
        assert len((await queued.result(8)).outputs[0].token_ids) == 4
        await asyncio.sleep(0.5)
        stored = [o async for _, o in answers.stored(client.js, client.names, "c", "long")]
    assert len(stored) == 1 and isinstance(stored[0], RolloutResult)
    assert stored[0].outputs[0].token_ids == out.token_ids  # the one answer is the partial one
    assert engine.calls.count(long.job_id) + sum(c.startswith(long.job_id + ".") for c in engine.calls) == 1


async def test_a_queued_job_cancelled_is_withdrawn_and_never_runs(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(per_token_s=0.01)
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=1),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        busy = await client.submit(payload(max_tokens=200), min_version=0, idempotency_key="busy")
        await wait_until(lambda: engine.running == 1, timeout=10, what="the first job running")
        waiting = await client.submit(payload(max_tokens=4), min_version=0, idempotency_key="waiting")
        assert await waiting.cancel() == "withdrawn"
        with pytest.raises(Cancelled):
            await waiting.result(0)
        await busy.result(10)
        await asyncio.sleep(0.5)  # (the slot is free again: had the job stayed queued, it would run now)
        stored = [o async for _, o in answers.stored(client.js, client.names, "c", "waiting")]
    assert stored == [] and waiting.job_id not in engine.calls


async def test_cancelling_a_job_already_answered_says_so(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho()),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        done = await client.submit(payload(max_tokens=3), min_version=0)
        result = await done.result(10)
        assert await done.cancel() == "answered" and await done.result(0) == result


def test_a_cancel_after_the_first_joins_it() -> None:
    # What a cancel did is decided once, by the first cancel of a handle: a second one, whether
    # it comes while the first runs or after it ended, returns the first one's outcome (a second
    # cancel of a withdrawn handle said "answered", since the handle was settled by then).
    assert next_cancel("none", settled=False) == "cancel"
    assert next_cancel("none", settled=True) == "answered"  # answered before any cancel
    assert next_cancel("deciding", settled=False) == "join"  # the first still deciding
    assert next_cancel("decided", settled=True) == "join"  # the first settled it (withdrawn, stopped)
    assert next_cancel("decided", settled=False) == "join"  # ("unknown": nothing came, yet decided)
    assert next_cancel("failed", settled=False) == "cancel"  # it raised, the broker away: ask again
    assert next_cancel("failed", settled=True) == "answered"


async def test_concurrent_cancels_of_a_queued_job_both_say_withdrawn_and_stop_nothing(
    nats_url: str, namespace: str
) -> None:
    # Two cancels at once of a queued job said "withdrawn" and "stopped": the second found the
    # job already removed, so it took the job for one a replica might hold and asked the fleet
    # to stop it. Both join the first cancel's decision; no stop is asked for a withdrawn job.
    engine = CountingEcho(per_token_s=0.01)
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=1),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        stops: list[bytes] = []

        async def heard(msg: Msg) -> None:
            stops.append(msg.data)

        sub = await client.nc.subscribe(client.names.cancel_subject(), cb=heard)
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        busy = await client.submit(payload(max_tokens=200), min_version=0, idempotency_key="busy")
        await wait_until(lambda: engine.running == 1, timeout=10, what="the first job running")
        waiting = await client.submit(payload(max_tokens=4), min_version=0, idempotency_key="waiting")
        assert await asyncio.gather(waiting.cancel(), waiting.cancel()) == ["withdrawn", "withdrawn"]
        assert await waiting.cancel() == "withdrawn"  # and after: the same outcome, not "answered"
        # A stop for the busy job marks where the subject's messages have all been read: any stop
        # sent for the withdrawn one went before it on the same connection.
        assert await busy.cancel() == "stopped"
        busy_stop = claim_key(busy.job_id).encode()
        await wait_until(lambda: busy_stop in stops, timeout=10, what="the busy job's stop heard")
        await sub.unsubscribe()
    assert stops == [busy_stop]  # none for the withdrawn job


def test_a_job_whose_caller_left_runs_on_only_under_the_callers_key() -> None:
    assert on_leaving(None) == "cancel"  # nobody can ask for it again
    assert on_leaving("step3/g0") == "run_on"  # a retry under the key gets its one answer


async def test_a_keyless_submit_cancelled_while_its_job_is_stored_leaves_nothing_running(broker: Any) -> None:
    """The Python door keeps the gateway's promise: the broker stalls (SIGSTOP) while a keyless
    job is being stored, and the caller's task is cancelled; the broker comes back and stores the
    job it had been sent. Nobody holds a handle or a key for it, so it must not run: the fleet
    ends with no job stored and no run left going, seen at the engine."""
    url = broker.url
    async with (
        running_worker(url, "ns", engine=(engine := CountingEcho(per_token_s=0.01)), capacity=1),
        await RolloutClient.connect(url, namespace="ns", client_id="left") as client,
    ):
        await (await client.submit(payload(max_tokens=1), min_version=0)).result()  # the subject's consumer declared
        before = (await client.js.stream_info(client.names.jobs_stream)).state.last_seq
        finished: list[int] = []
        generate = engine.generate

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            out = await generate(*args, **kwargs)
            finished.extend(len(o.token_ids) for o in out.outputs)
            return out

        engine.generate = recorded  # type: ignore[method-assign]
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            submitting = asyncio.ensure_future(client.submit(payload(max_tokens=LONG), min_version=0))
            # The job's message has left this process: the broker will store it when it wakes.
            await wait_until(lambda: client.nc.pending_data_size == 0 and client.nc.stats["out_msgs"] > 0,
                             timeout=10, what="the job sent to the stalled broker")  # fmt: skip
            await asyncio.sleep(0.2)
            submitting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await submitting
        finally:
            broker.proc.send_signal(signal.SIGCONT)

        async def stored_then_gone() -> bool:
            state = (await client.js.stream_info(client.names.jobs_stream)).state
            return state.last_seq > before and state.messages == 0

        await wait_until(stored_then_gone, timeout=20, what="the job stored, then gone")
        await wait_until(lambda: engine.running == 0, timeout=10, what="nothing running")
        assert all(n < LONG for n in finished), finished
        assert not client.unclaimed()


async def test_a_cancelled_job_whose_holder_is_gone_is_never_stored_again(nats_url: str, namespace: str) -> None:
    # Campaign seed 747108: a keyless session turn's HTTP caller left, so the gateway cancelled
    # its job; the replica holding it had died, so no answer came while the cancel waited, and
    # the session's watch, finding the holder gone, stored the job again: it ran 6 s for nobody.
    # Here a consumer takes the job and never answers (its holder gone); while the cancel waits,
    # the watch's requeue must store nothing.
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", fail_fast=False) as client:
        names = client.names
        stops: list[bytes] = []

        async def heard(msg: Msg) -> None:
            stops.append(msg.data)

        await client.nc.subscribe(names.cancel_subject(), cb=heard)
        handle = await client.submit(payload(max_tokens=LONG), min_version=0)
        holder = await client.js.pull_subscribe_bind(names.job_consumer("min", 0), names.jobs_stream)
        assert [m.data for m in await holder.fetch(1, timeout=10)] == [handle.data]  # taken, never answered
        cancel = asyncio.ensure_future(handle.cancel(timeout=2.0))
        stop = claim_key(handle.job_id).encode()
        await wait_until(lambda: stop in stops, timeout=10, what="the cancel's stop sent")
        assert not handle.done()  # (the cancel still waits for an answer: the watch's moment)
        assert not await client.placement.requeue(handle)
        assert await cancel == "unknown"
        with pytest.raises(Cancelled):
            await handle.result(0)
        assert (await client.js.stream_info(names.jobs_stream)).state.messages == 0
