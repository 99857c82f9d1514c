"""Resumable generations (``retry_policy="resume"``): a generation outlives its worker.

Real worker processes SIGKILLed (and SIGSTOPped) mid-generation at random points; what the final
answer keeps is compared with what the dead run had checkpointed on the broker at the moment it
died, read back independently of the code under test's reader (``tests.helpers.progress_records``
decodes the records; the checks below recount them).
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
from pathlib import Path

import msgspec
import pytest

from harness import start_worker_process, terminate, wait_until
from rollfleet.broker.topology import TopologyConfig
from rollfleet.cli.status import collect_status, render_table
from rollfleet.schemas import RolloutResult
from rollfleet.schemas.errors import NoCompatibleReplica
from rollfleet.schemas.progress import DoneRecord, ResumeRecord, TokenChunk, TokensRecord
from rollfleet.trainer_client import RolloutClient
from rollfleet.trainer_client.handle import RolloutHandle
from tests.helpers import payload, progress_records

TOPO = TopologyConfig(ack_wait_s=1.0)
# Fast checkpoints so a kill at a random point has something to keep; fast claims (ack wait 1 s).
WORKER = ("--ack-wait", "1.0", "--checkpoint-tokens", "16", "--checkpoint-s", "0.2")


def _start(url: str, ns: str, wid: str, tmp: Path, *extra: str) -> subprocess.Popen[bytes]:
    return start_worker_process(url, ns, wid, *WORKER, *extra, log_path=tmp / f"{wid}.log")


def _stored_prefix(records: list) -> tuple[list[int], list[float]]:
    """Sample 0's tokens as the records store them (recounted here: deltas in order from offset 0)."""
    tokens: list[int] = []
    lps: list[float] = []
    for r in records:
        if isinstance(r, ResumeRecord):
            del tokens[r.kept[0] :], lps[r.kept[0] :]
        elif isinstance(r, TokensRecord):
            for d in r.samples:
                if d.index == 0:
                    assert d.start == len(tokens)
                    tokens += d.token_ids
                    lps += d.logprobs or []
    return tokens, lps


def _check_spans(result: RolloutResult, max_tokens: int) -> list[str]:
    """Spans tile the output exactly; the replicas that made it, in order."""
    out = result.outputs[0]
    at, replicas = 0, []
    for span in out.weight_versions:
        assert span.start == at and span.end > span.start, out.weight_versions
        at = span.end
        if not replicas or replicas[-1] != span.replica:
            replicas.append(span.replica)
    assert at == len(out.token_ids) == max_tokens
    assert out.logprobs is not None and len(out.logprobs) == max_tokens
    return replicas


async def _wait_stored(client: RolloutClient, job_id: str, at_least: int, timeout: float = 20.0) -> None:
    async def enough() -> bool:
        return len(_stored_prefix(await progress_records(client.js, client.names, "c", job_id))[0]) >= at_least

    await wait_until(enough, timeout=timeout)


async def _collect(client: RolloutClient, handle: RolloutHandle, chunks: list[TokenChunk]) -> None:
    """Stream the job into ``chunks`` as they come."""
    async for chunk in client.stream(handle):
        chunks.append(chunk)


def _joined(chunks: list[TokenChunk], n: int) -> list[list[int]]:
    """Each sample's tokens as a consumer of the stream puts them together (rewinds applied);
    fails on a chunk that does not start where the sample stands."""
    samples: list[list[int]] = [[] for _ in range(n)]
    for c in chunks:
        if c.rewound:
            del samples[c.index][c.start :]
            continue
        assert c.start == len(samples[c.index]), [(x.index, x.start, len(x.token_ids)) for x in chunks]
        samples[c.index] += c.token_ids
    return samples


async def _answers(client: RolloutClient, key: str) -> int:
    """Answer heads stored for a key (every one the broker holds, read one by one)."""
    import nats.js.errors

    subject, seq, count = client.names.results_of_key("c", key), 1, 0
    while True:
        try:
            msg = await client.js.get_msg(client.names.results_stream, seq=seq, subject=subject, next=True, direct=True)
        except nats.js.errors.NotFoundError:
            return count
        count, seq = count + 1, int(msg.seq) + 1


@pytest.mark.parametrize("seed", [1, 2])
async def test_killed_twice_mid_generation_keeps_every_checkpointed_token(
    nats_url: str, namespace: str, tmp_path: Path, seed: int
) -> None:
    """One job, three replicas, two SIGKILLs at random points: the answer has exactly max_tokens
    tokens, each dead run's checkpointed prefix byte for byte, spans that name the three replicas in
    order, one answer for the key; the job's records are rolled up to one done record."""
    rng = random.Random(seed)
    max_tokens = 400
    procs = [_start(nats_url, namespace, "r0", tmp_path, "--echo-token-latency", "0.01")]
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=max_tokens), min_version=0, retry_policy="resume", idempotency_key="k", timeout=120
            )
            prefixes: list[tuple[list[int], list[float]]] = []
            for victim in range(2):
                before = len(prefixes[-1][0]) if prefixes else 0  # the victim stores past it first
                await _wait_stored(client, handle.job_id, before + 20 + rng.randrange(0, 60))
                await asyncio.sleep(rng.uniform(0.0, 0.3))  # between checkpoints, at a random token
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait(10)
                prefixes.append(_stored_prefix(await progress_records(client.js, client.names, "c", handle.job_id)))
                procs.append(_start(nats_url, namespace, f"r{victim + 1}", tmp_path, "--echo-token-latency", "0.01"))
            result = await handle.result(60)
            out = result.outputs[0]
            assert _check_spans(result, max_tokens) == ["r0", "r1", "r2"]
            for tokens, lps in prefixes:
                assert out.token_ids[: len(tokens)] == tokens and out.logprobs[: len(lps)] == lps
            assert result.kept_tokens == len(prefixes[-1][0]) and result.resumes == 2
            assert result.worker_id == "r2" and out.finish_reason == "length"
            # What the operator sees: the replica that finished it resumed one job, keeping those tokens.
            kept = f"1 ({result.kept_tokens}/0)"

            async def shown() -> bool:
                return any(
                    line.startswith("r2 ") and kept in line
                    for line in render_table(await collect_status(nats_url, namespace)).splitlines()
                )

            await wait_until(shown, timeout=10)
            assert await _answers(client, "k") == 1
            await wait_until(lambda: _rolled_up(client, handle.job_id), timeout=10, what="the records rolled up")
    finally:
        for p in procs:
            terminate(p, 10.0, signal.SIGKILL)


async def test_streamed_tokens_match_the_answer_across_a_resume(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """A client streaming the job while its worker is SIGKILLed: chunks arrive in order, contiguous,
    none twice and none rewound, and put together they are the answer's tokens and log-probs."""
    a = _start(nats_url, namespace, "a", tmp_path, "--echo-token-latency", "0.01")
    b = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=300), min_version=0, retry_policy="resume", idempotency_key="k", timeout=120
            )
            chunks: list[TokenChunk] = []
            streaming = asyncio.create_task(_collect(client, handle, chunks))
            await wait_until(lambda: sum(len(c.token_ids) for c in chunks) >= 60, timeout=20)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            seen_before_kill = sum(len(c.token_ids) for c in chunks)
            b = _start(nats_url, namespace, "b", tmp_path, "--echo-token-latency", "0.01")
            result = await handle.result(60)
            await asyncio.wait_for(streaming, 20)
            out = result.outputs[0]
            at, tokens, lps = 0, [], []
            for c in chunks:
                assert c.index == 0 and not c.rewound and c.start == at, [(c.start, len(c.token_ids)) for c in chunks]
                at += len(c.token_ids)
                tokens += c.token_ids
                lps += c.logprobs or []
            assert tokens == out.token_ids and lps == out.logprobs and len(tokens) == 300
            assert chunks[-1].finish == "length" and [c for c in chunks if c.finish] == [chunks[-1]]
            assert seen_before_kill >= 60 and _check_spans(result, 300) == ["a", "b"]
            assert len(chunks) > 3  # streamed as it went, not only at the end
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)


async def _rolled_up(client: RolloutClient, job_id: str) -> bool:
    """The job's progress records are rolled up into one done record. The worker writes it just
    after the answer (and its ack), so a read begun as the answer arrives may still see the records
    before it, and the done record after them (a loaded suite saw all six)."""
    records = await progress_records(client.js, client.names, "c", job_id)
    return len(records) == 1 and isinstance(records[0], DoneRecord)


async def test_a_stopped_worker_that_comes_back_stores_nothing(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """SIGSTOP the worker mid-generation until another replica has taken the job over, then SIGCONT
    it: the late run's checkpoints and answer are refused (it logs why), the answer is the resumed
    run's, keeping exactly what the stopped run had stored when it was taken over."""
    a = _start(nats_url, namespace, "slow", tmp_path, "--echo-token-latency", "0.01")
    b = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=600), min_version=0, retry_policy="resume", idempotency_key="k", timeout=120
            )
            await _wait_stored(client, handle.job_id, 50)
            a.send_signal(signal.SIGSTOP)
            b = _start(nats_url, namespace, "fast", tmp_path, "--echo-token-latency", "0.01")

            async def taken_over() -> bool:
                records = await progress_records(client.js, client.names, "c", handle.job_id)
                return any(isinstance(r, ResumeRecord) and r.worker_id == "fast" for r in records)

            await wait_until(taken_over, timeout=30)
            records = await progress_records(client.js, client.names, "c", handle.job_id)
            cut = next(i for i, r in enumerate(records) if isinstance(r, ResumeRecord))
            stored_by_slow, _ = _stored_prefix(records[:cut])
            a.send_signal(signal.SIGCONT)  # it wakes with its job taken: every write it tries is refused
            result = await handle.result(60)
            assert _check_spans(result, 600) == ["slow", "fast"]
            kept = next(s for s in result.outputs[0].weight_versions if s.replica == "slow")
            assert kept.end == len(stored_by_slow) == result.kept_tokens
            assert result.outputs[0].token_ids[: kept.end] == stored_by_slow
            assert result.worker_id == "fast" and await _answers(client, "k") == 1
            await wait_until(lambda: _rolled_up(client, handle.job_id), timeout=10, what="the records rolled up")

            def superseded() -> bool:
                return "job taken over by another run" in (tmp_path / "slow.log").read_text()

            await wait_until(superseded, timeout=20)
    finally:
        a.send_signal(signal.SIGCONT)
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)


async def test_an_exact_job_never_resumes_at_another_version(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """An exact-0 job's worker dies; the only replica left serves version 1: the job is answered
    NoCompatibleReplica (typed, retryable), and the version-1 replica never took it over."""
    a = _start(nats_url, namespace, "v0", tmp_path, "--echo-token-latency", "0.01")
    b = _start(nats_url, namespace, "v1", tmp_path, "--echo-token-latency", "0.01", "--version", "1")
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 2, timeout=20)
            handle = await client.submit(
                payload(max_tokens=600), exact_version=0, retry_policy="resume", idempotency_key="k", timeout=120
            )
            await _wait_stored(client, handle.job_id, 40)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            with pytest.raises(NoCompatibleReplica) as info:
                await handle.result(60)
            assert info.value.retryable
            records = await progress_records(client.js, client.names, "c", handle.job_id)
            assert records and not any(isinstance(r, ResumeRecord) for r in records)
            assert all(
                s.replica == "v0" for r in records if isinstance(r, TokensRecord) for d in r.samples for s in d.spans
            )
            assert "resuming" not in (tmp_path / "v1.log").read_text()
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        terminate(b, 10.0, signal.SIGKILL)


async def test_an_engine_without_token_reports_runs_in_checkpointed_segments(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """An engine that answers whole requests (as the HTTP engines, sglang and vllm, do) runs a resumable
    job in segments of --checkpoint-tokens, a checkpoint after each: a SIGKILL loses at most the
    segment in progress, and the next replica continues from the stored segments."""
    whole = ("--echo-token-latency", "0.01", "--echo-whole-requests")
    a = _start(nats_url, namespace, "a", tmp_path, *whole)
    b = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=200, logprobs=False), min_version=0, retry_policy="resume", idempotency_key="k"
            )
            await _wait_stored(client, handle.job_id, 48)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            records = await progress_records(client.js, client.names, "c", handle.job_id)
            assert all(len(d.token_ids) == 16 for r in records if isinstance(r, TokensRecord) for d in r.samples)
            stored, _ = _stored_prefix(records)
            b = _start(nats_url, namespace, "b", tmp_path, *whole)
            result = await handle.result(60)
            out = result.outputs[0]
            assert len(out.token_ids) == 200 and out.logprobs is None and out.finish_reason == "length"
            assert out.token_ids[: len(stored)] == stored and result.kept_tokens == len(stored) >= 48
            assert [s.replica for s in out.weight_versions] == ["a", "b"]
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)


def _bad_records(job_id: str) -> dict[str, list[tuple[bytes, str | None]]]:
    """Records to store on a job's subject, with the MAC each carries (None: none)."""
    from rollfleet.schemas import VersionSpan, encode
    from rollfleet.schemas.progress import SampleDelta, record_mac

    def tokens(start: int, n: int, version: int = 2, job: str = job_id) -> tuple[bytes, str]:
        delta = SampleDelta(
            index=0,
            start=start,
            token_ids=[31_999] * n,
            logprobs=[-1.0] * n,
            spans=[VersionSpan(version=version, start=start, end=start + n, replica="ghost")],
        )
        data = encode(TokensRecord(run="ghost:1", samples=[delta]))
        return data, record_mac(job, data)

    return {
        # sealed with the job's MAC, but not a continuation: the run starts over
        "gap": [tokens(0, 10), tokens(15, 10)],
        "version": [tokens(0, 10, version=1)],  # the job asks for min 2
        "undecodable-sealed": [(b"\xc1 not msgpack", record_mac(job_id, b"\xc1 not msgpack"))],
        # not the job's at all (no MAC, another job's MAC, garbage): ignored, nothing to fall back from
        "no-mac": [(tokens(0, 10)[0], None)],
        "other-job": [tokens(0, 10, job="someone-else")],
        "garbage": [(b"\xc1 not msgpack", None)],
    }


@pytest.mark.parametrize("bad", ["gap", "version", "undecodable-sealed", "no-mac", "other-job", "garbage"])
async def test_bad_records_never_reach_the_answer(nats_url: str, namespace: str, tmp_path: Path, bad: str) -> None:
    """Records on a job's subject that cannot be continued (sealed with the job's MAC, but a gap,
    tokens at a version the job does not allow, not MessagePack) make the worker generate from the
    first token, saying why in its log and counting what it regenerated; records that are not the
    job's (no MAC, another job's, garbage) are ignored and logged. Either way the answer keeps none
    of their tokens."""
    from rollfleet.schemas.progress import MAC_HEADER

    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
        # A frozen replica lets the job be submitted (the fleet is not empty) without running it
        # before the bad records are in; it is killed, and a fresh replica takes the job.
        a = _start(nats_url, namespace, "frozen", tmp_path, "--version", "2")
        w = None
        try:
            # Ready, not only registered: a replica still starting serves nothing (fail fast).
            await wait_until(lambda: [r.state for r in client.fleet.replicas()] == ["ready"], timeout=20)
            a.send_signal(signal.SIGSTOP)
            handle = await client.submit(
                payload(max_tokens=50), min_version=2, retry_policy="resume", idempotency_key="k", timeout=60
            )
            chunks: list[TokenChunk] = []
            streaming = asyncio.create_task(_collect(client, handle, chunks))  # sees the bad records too
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            subject = client.names.progress_subject("c", handle.job_id)
            for data, mac in _bad_records(handle.job_id)[bad]:
                headers = {MAC_HEADER: mac} if mac else None
                await client.js.publish(subject, data, stream=client.names.progress_stream, headers=headers)
            w = _start(nats_url, namespace, "w", tmp_path, "--version", "2")
            result = await handle.result(30)
            out = result.outputs[0]
            assert len(out.token_ids) == 50 and result.kept_tokens == 0 and result.resumes == 0
            assert {s.replica for s in out.weight_versions} == {"w"} and 31_999 not in out.token_ids
            # The stream: what a bad but sealed record had shown is rewound; the result is what it adds up to.
            await asyncio.wait_for(streaming, 10)
            assert _joined(chunks, 1) == [out.token_ids]
            assert any(c.rewound for c in chunks) == (bad in ("gap", "version"))
            log = (tmp_path / "w.log").read_text()
            sealed_bad = bad in ("gap", "version", "undecodable-sealed")
            assert ("stored progress not usable" in log) == sealed_bad
            assert ("progress record ignored" in log) == (not sealed_bad)
            expected = 10 if bad in ("gap", "version") else 0  # tokens read before the bad record
            await wait_until(
                lambda: any(r.worker_id == "w" and r.tokens_regenerated == expected for r in client.fleet.replicas()),
                timeout=10,
            )
        finally:
            terminate(a, 10.0, signal.SIGKILL)
            if w is not None:
                terminate(w, 10.0, signal.SIGKILL)


async def test_a_forged_record_mid_job_neither_enters_the_answer_nor_stops_the_run(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """Someone who can write to the progress stream (a rogue worker) appends a well-formed record
    that continues the job's output, without the job's MAC, between two of the run's checkpoints:
    the run's next write is refused for the subject's sequence, it finds nothing of the job's in
    between, and goes on; the answer is the run's alone, and a stream of the job never shows it."""
    from rollfleet.schemas import VersionSpan, encode
    from rollfleet.schemas.progress import SampleDelta

    a = _start(nats_url, namespace, "a", tmp_path, "--echo-token-latency", "0.01")
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=300), min_version=0, retry_policy="resume", idempotency_key="k", timeout=60
            )
            chunks: list[TokenChunk] = []
            streaming = asyncio.create_task(_collect(client, handle, chunks))
            await _wait_stored(client, handle.job_id, 40)
            have, _ = _stored_prefix(await progress_records(client.js, client.names, "c", handle.job_id))
            n = 5
            forged = SampleDelta(
                index=0,
                start=len(have),
                token_ids=[31_999] * n,
                logprobs=[0.0] * n,
                spans=[VersionSpan(version=0, start=len(have), end=len(have) + n, replica="a")],
            )
            subject = client.names.progress_subject("c", handle.job_id)
            await client.js.publish(subject, encode(TokensRecord(run="rogue", samples=[forged])))
            result = await handle.result(30)
            await asyncio.wait_for(streaming, 10)
            out = result.outputs[0]
            assert 31_999 not in out.token_ids and len(out.token_ids) == 300 and result.resumes == 0
            assert out.token_ids == [(6 + i) % 32_000 for i in range(300)]  # the echo engine's, uninterrupted
            assert [t for c in chunks for t in c.token_ids] == out.token_ids
            assert "progress record ignored" in (tmp_path / "a.log").read_text()
            assert await _answers(client, "k") == 1
    finally:
        terminate(a, 10.0, signal.SIGKILL)


@pytest.mark.slow
async def test_hf_generation_resumes_on_another_replica(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """The hf engine (a tiny random model, sampled at temperature 1): a replica SIGKILLed mid-job;
    the answer keeps the dead run's checkpointed tokens and log-probs byte for byte and the other
    replica prefills them and samples the rest up to max_tokens."""
    from rollfleet.models.tiny import build_model_dir
    from rollfleet.schemas import RolloutPayload, SamplingParams

    model = build_model_dir(tmp_path / "model", preset="tiny", seed=0)
    hf = ("--engine", "hf", "--device", "cpu", "--model-dir", str(model))
    a = _start(nats_url, namespace, "a", tmp_path, *hf)
    b = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await client.wait_for_version(0, replicas=1, timeout=120)
            job = RolloutPayload(
                prompt_token_ids=[5, 6, 7, 8],
                sampling=SamplingParams(max_tokens=480, temperature=1.0),
                extra={"ignore_eos": True},
            )
            handle = await client.submit(job, min_version=0, retry_policy="resume", idempotency_key="k", timeout=180)
            await _wait_stored(client, handle.job_id, 64, timeout=60)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            stored, lps = _stored_prefix(await progress_records(client.js, client.names, "c", handle.job_id))
            assert 64 <= len(stored) < 480
            b = _start(nats_url, namespace, "b", tmp_path, *hf)
            result = await handle.result(120)
            out = result.outputs[0]
            assert _check_spans(result, 480) == ["a", "b"] and result.kept_tokens == len(stored)
            assert out.token_ids[: len(stored)] == stored and out.logprobs[: len(lps)] == lps
            assert all(lp <= 0.0 for lp in out.logprobs) and result.prompt_tokens == 4  # the job's prompt
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)


async def test_a_seeded_hf_job_resumed_after_a_kill_returns_samples_that_are_not_copies(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """Issue 30, item 4: a seeded job of n=4 on hf, its replica SIGKILLed mid-job. The resumed run
    sends each sample alone; each must go on drawing its own stream (seed 7 + i), not sample 0's
    (on the tiny random model one stream makes nearly the same tokens whatever the context)."""
    from rollfleet.models.tiny import build_model_dir
    from rollfleet.schemas import RolloutPayload, SamplingParams

    model = build_model_dir(tmp_path / "model", preset="tiny", seed=0)
    # Deterministic replicas (each request alone), so that each segment replays bit for bit.
    hf = ("--engine", "hf", "--device", "cpu", "--model-dir", str(model), "--deterministic")
    a = _start(nats_url, namespace, "a", tmp_path, *hf)
    b = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await client.wait_for_version(0, replicas=1, timeout=120)
            job = RolloutPayload(
                prompt_token_ids=[5, 6, 7, 8],
                sampling=SamplingParams(max_tokens=96, temperature=1.0, seed=7),
                n=4,
                extra={"ignore_eos": True},
            )
            handle = await client.submit(job, min_version=0, retry_policy="resume", idempotency_key="k", timeout=180)
            await _wait_stored(client, handle.job_id, 32, timeout=60)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            b = _start(nats_url, namespace, "b", tmp_path, *hf)
            result = await handle.result(120)
            # Each sample replayed segment by segment: the kept tokens as the first request made
            # them, then the continuation from the prompt and the kept tokens, seeded anew.
            replays = [await client.replay(result, job, index=i, timeout=120) for i in range(4)]
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)
    assert result.kept_tokens > 0
    seqs = [o.token_ids for o in result.outputs]
    assert all(len(s) == 96 for s in seqs)
    resumed_from = max(min(s.start for s in o.weight_versions if s.replica == "b") for o in result.outputs)
    assert resumed_from < 96
    for i in range(4):
        for j in range(i + 1, 4):
            after = list(zip(seqs[i][resumed_from:], seqs[j][resumed_from:], strict=True))
            same = sum(x == y for x, y in after)
            assert same < len(after) / 2, (i, j, same, len(after))
    assert result.replay is not None
    for i, (out, replayed) in enumerate(zip(result.outputs, replays, strict=True)):
        # The segments' bounds from the raw spans: where replica b's tokens begin.
        b_from = min(s.start for s in out.weight_versions if s.replica == "b")
        assert result.replay.restarts_of(i) == (b_from,)
        # (A sample with no token kept, deterministic replicas making samples one at a time, is
        # one segment: the resumed run's.)
        want = [(0, b_from), (b_from, 96 - b_from)] if b_from else [(0, 96)]
        assert [(seg.start, seg.tokens) for seg in replayed.segments or (replayed,)] == want
        assert replayed.matched, replayed  # every token and log-prob of every segment, bit for bit
    assert any(len(r.segments) == 2 for r in replays)  # (at least the first sample had tokens kept)


async def test_random_kills_across_many_jobs_never_lose_a_checkpointed_token(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """Eight resumable jobs (some with two samples) on three replicas; a random replica SIGKILLed four
    times at random moments and replaced. After every kill, every job's stored tokens are read:
    each such prefix must be a prefix of that job's answer (nothing ever checkpointed is lost or
    changed), and every job is answered once with every sample whole."""
    rng = random.Random(11)
    slow = ("--echo-token-latency", "0.005")
    procs = {f"w{i}": _start(nats_url, namespace, f"w{i}", tmp_path, *slow) for i in range(3)}
    dead: list[subprocess.Popen[bytes]] = []
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 3, timeout=20)
            handles = [
                await client.submit(
                    msgspec.structs.replace(payload([1, 2, i + 3], max_tokens=rng.randint(300, 600)), n=1 + i % 2),
                    min_version=0,
                    retry_policy="resume",
                    idempotency_key=f"k{i}",
                    timeout=180,
                )
                for i in range(8)
            ]
            seen: dict[str, list[list[list[int]]]] = {h.job_id: [] for h in handles}
            for kill in range(4):
                await asyncio.sleep(rng.uniform(0.4, 1.2))
                victim = rng.choice(sorted(procs))
                proc = procs.pop(victim)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                dead.append(proc)
                for h in handles:
                    records = await progress_records(client.js, client.names, "c", h.job_id)
                    samples: list[list[int]] = [[] for _ in range(h.job.payload.n)]
                    for r in records:
                        if isinstance(r, ResumeRecord):
                            for i, k in enumerate(r.kept):
                                del samples[i][k:]
                        elif isinstance(r, TokensRecord):
                            for d in r.samples:
                                assert d.start == len(samples[d.index])
                                samples[d.index] += d.token_ids
                    seen[h.job_id].append(samples)
                procs[f"{victim}-{kill}"] = _start(nats_url, namespace, f"{victim}-{kill}", tmp_path, *slow)
            results = await asyncio.gather(*(h.result(120) for h in handles))
            for h, result in zip(handles, results, strict=True):
                for i, out in enumerate(result.outputs):
                    assert len(out.token_ids) == h.job.payload.sampling.max_tokens and out.finish_reason == "length"
                    at = 0
                    for span in out.weight_versions:
                        assert span.start == at and span.end > at
                        at = span.end
                    assert at == len(out.token_ids)
                    for snapshot in seen[h.job_id]:
                        assert out.token_ids[: len(snapshot[i])] == snapshot[i]
                assert await _answers(client, h.idempotency_key) == 1
            assert sum(r.resumes for r in results) >= 1  # the schedule did interrupt some of them
    finally:
        for p in [*procs.values(), *dead]:
            terminate(p, 10.0, signal.SIGKILL)


@pytest.mark.parametrize("retry_policy", ["replayable", "at_most_once"])
async def test_a_job_that_is_not_resumable_streams_its_whole_result_at_the_end(
    nats_url: str, namespace: str, tmp_path: Path, retry_policy: str
) -> None:
    """No checkpoints for other retry policies: the stream is the result, one chunk per sample
    (two samples here), and nothing is stored on the job's progress subject."""
    a = _start(nats_url, namespace, "a", tmp_path, "--echo-token-latency", "0.002")
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            job = msgspec.structs.replace(payload(max_tokens=100), n=2)
            handle = await client.submit(job, min_version=0, retry_policy=retry_policy, idempotency_key="k")
            chunks: list[TokenChunk] = []
            await asyncio.wait_for(_collect(client, handle, chunks), 30)
            result = await handle.result(5)
            assert [(c.index, c.start, c.finish) for c in chunks] == [(0, 0, "length"), (1, 0, "length")]
            assert _joined(chunks, 2) == [out.token_ids for out in result.outputs]
            assert [c.logprobs for c in chunks] == [out.logprobs for out in result.outputs]
            assert await progress_records(client.js, client.names, "c", handle.job_id) == []
    finally:
        terminate(a, 10.0, signal.SIGKILL)
