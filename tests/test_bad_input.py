"""Bad input on a jobs subject: answered InvalidRequest where possible, terminated, never wedging."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from harness import running_worker, wait_until
from rollfleet.broker import ensure_job_consumer
from rollfleet.schemas import (
    SCHEMA_VERSION,
    Names,
    Outcome,
    RolloutFailure,
    RolloutJob,
    RolloutPayload,
    SamplingParams,
    VersionConstraint,
    encode,
)
from rollfleet.schemas.bell_wire import bell_payload
from rollfleet.schemas.errors import InvalidRequest, UnsupportedSchema
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID
from rollfleet.trainer_client import RolloutClient, answers, requests
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


async def store_raw(client: RolloutClient, names: Names, data: bytes, headers: dict[str, str], worker_id: str) -> None:
    """Store bytes on min-0 as a (buggy or hostile) trainer would: the shared consumer, the job,
    the bell to the worker."""
    await ensure_job_consumer(client.js, names, "min", 0)
    await client.js.publish(names.job_subject("min", 0), data, headers=headers)
    await client.nc.publish(names.bell_subject(worker_id), bell_payload("min", 0))


CASES = {
    "not-msgpack": b"\xc1\x00{this is not messagepack",
    "wrong-type": encode(_job_dict(deadline="tomorrow")),
    "oversized": encode(_job_dict(payload={"prompt_token_ids": list(range(200_000))})),
    "impossible-sampling": encode(
        _job_dict(payload={"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 4, "top_p": 7.5}})
    ),
    # An extra nested far past the recursion limit (a one-element array in one in ...): decoding
    # it raised RecursionError in the worker's job task.
    "deep-extra": encode(_job_dict(payload={"prompt_token_ids": [1, 2], "extra": {"a": "MARK"}})).replace(
        b"\xa4MARK", b"\x91" * 100_000 + b"\x90"
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
        await store_raw(client, names, CASES[case], headers, worker.config.worker_id)

        async def answered() -> Outcome | None:
            async for _, outcome in answers.stored(client.js, names, "c", "bad-key"):
                return outcome
            return None

        # Answered where the reply address says (this client never issued the job, so it hands
        # the answer to no caller, but the job is not left to wedge or be redelivered).
        failure = await wait_until(answered, timeout=10, what="the bad job answered")
        assert isinstance(failure, RolloutFailure) and failure.code == "invalid_request" and not failure.retryable
        with pytest.raises(TimeoutError):
            await client.result("bad-key", timeout=0.5)
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
        await store_raw(client, names, b"garbage with no headers", {}, worker.config.worker_id)
        good = await client.submit(payload(), min_version=0)
        await good.result(10)

        async def gone() -> bool:
            return (await client.js.stream_info(names.jobs_stream)).state.messages == 0

        await wait_until(gone, timeout=5)
        assert worker.outcomes.get("invalid_request") == 1
        results = await client.js.stream_info(names.results_stream)
        assert results.state.messages == 1  # only the good job's result


async def test_a_job_of_a_newer_schema_is_answered_to_its_caller_at_once(
    nats_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer one schema ahead (a rolling upgrade): a retry policy this worker cannot decode,
    or a job it could decode but of a schema it does not know, is answered at once with a typed,
    non-retryable UnsupportedSchema that reaches the caller (not a wait until the deadline), and
    never run."""
    monkeypatch.setattr(requests, "RETRY_POLICIES", (*requests.RETRY_POLICIES, "teleport"))
    monkeypatch.setattr(requests, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    engine = CountingEcho()
    async with (
        running_worker(nats_url, namespace, engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        start = time.monotonic()
        unknown = await client.submit(payload(), min_version=0, retry_policy="teleport", timeout=60)  # type: ignore[arg-type]
        with pytest.raises(UnsupportedSchema, match=f"schema {SCHEMA_VERSION + 1}.*cannot decode retry_policy") as e:
            await unknown.result(5)
        assert not e.value.retryable
        newer = await client.submit(payload(), min_version=0, timeout=60)
        with pytest.raises(UnsupportedSchema, match=f"schema {SCHEMA_VERSION + 1}, newer than this worker's"):
            await newer.result(5)
        assert time.monotonic() - start < 8 and engine.calls == []


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
        # Nothing is coerced: a float version, a zero time-out, wrong types all say what is wrong.
        bad: list[tuple[dict[str, Any], str]] = [
            ({"exact_version": 1.7}, "exact_version must be an integer"),
            ({"min_version": True}, "min_version must be an integer"),
            ({"min_version": "3"}, "min_version must be an integer"),
            ({"min_version": 2**70}, r"min_version must be in \[0, 2\*\*63\)"),
            ({"min_version": -1}, r"min_version must be in"),
            ({"max_staleness": 0.5}, "max_staleness must be an integer"),
            ({"min_version": 0, "timeout": 0}, "timeout must be > 0"),
            ({"min_version": 0, "timeout": -3}, "timeout must be > 0"),
            ({"min_version": 0, "timeout": float("nan")}, "timeout must be a finite number"),
            ({"min_version": 0, "timeout": "60"}, "timeout must be a finite number"),
            ({"min_version": 0, "deadline": 1.0}, "not in the future"),
            ({"min_version": 0, "idempotency_key": 5}, "idempotency_key must be a string"),
            ({"min_version": 0, "session_id": "a.b"}, "session_id"),
        ]
        for kwargs, message in bad:
            with pytest.raises(InvalidRequest, match=message):
                await client.submit(payload(), **kwargs)
        with pytest.raises(InvalidRequest, match="payload must be a RolloutPayload"):
            await client.submit({"prompt_token_ids": [1]}, min_version=0)  # type: ignore[arg-type]
        wrong_types = [
            RolloutPayload(prompt_token_ids=["a", "b"]),  # type: ignore[list-item]
            RolloutPayload(prompt_token_ids=[2**70]),
            RolloutPayload(prompt_token_ids=[1], sampling=SamplingParams(temperature="hot")),  # type: ignore[arg-type]
            RolloutPayload(prompt_token_ids=[1], sampling=None),  # type: ignore[arg-type]
            RolloutPayload(prompt_token_ids=[1], n="2"),  # type: ignore[arg-type]
        ]
        for wrong in wrong_types:
            with pytest.raises(InvalidRequest):
                await client.submit(wrong, min_version=0)
        deep: object = 1
        for _ in range(5_000):  # past the encoder's recursion: it raised RecursionError
            deep = [deep]
        with pytest.raises(InvalidRequest, match="nests deeper"):
            await client.submit(RolloutPayload(prompt_token_ids=[1], extra={"a": deep}), min_version=0)
        info = await client.js.stream_info(client.names.jobs_stream)
        assert info.state.messages == 0
        # An explicit time-out is the time-out (0.5 s here, not the 600 s default).
        handle = await client.submit(payload(), min_version=99, timeout=0.5)
        assert handle.job.deadline - handle.job.submitted_at == pytest.approx(0.5)


def test_cli_refuses_bad_worker_settings_in_one_line(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cases = [
        (["--capacity", "0"], "must be at least 1"),
        (["--capacity", "two"], "expected a whole number"),
        (["--local-dir", str(blocked / "sub")], "--local-dir"),
        (["--exact-drain", "-1"], "--exact-drain must be >= 0"),
        (["--echo-keyed"], "--echo-keyed keys its tokens by the weights it loads"),  # and no weights to load
    ]
    for args, message in cases:
        out = subprocess.run(
            [sys.executable, "-m", "rollfleet", "worker", "--nats", "nats://127.0.0.1:1", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (args, out.stderr)
        last = out.stderr.strip().splitlines()[-1]  # (argparse prints its usage first)
        assert last.startswith("rollfleet") and message in last and "Traceback" not in out.stderr, out.stderr
