"""A resumable job's lifecycle around its answer and its claim: what a run leaves behind, who
may fence it, and what a small broker limit does to it. Real worker processes, real signals, a
real nats-server; the job's records and claim are read back from the broker.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest

from harness import start_worker_process, terminate, wait_until
from rollfleet.broker import EmbeddedBroker, free_port
from rollfleet.broker.topology import TopologyConfig
from rollfleet.runtime import faults
from rollfleet.schemas import Claim, Names, claim_key
from rollfleet.schemas.progress import DoneRecord, TokenChunk, TokensRecord
from rollfleet.trainer_client import RolloutClient
from rollfleet.trainer_client.handle import RolloutHandle
from tests.deploy_helpers import BROKER_CONFIG, TEST_SECRETS
from tests.helpers import payload, progress_records

TOPO = TopologyConfig(ack_wait_s=1.0)
WORKER = ("--ack-wait", "1.0", "--checkpoint-tokens", "16", "--checkpoint-s", "0.2")


def _start(
    url: str, ns: str, wid: str, tmp: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return start_worker_process(url, ns, wid, *WORKER, *extra, log_path=tmp / f"{wid}.log", env=env)


async def _claim_value(client: RolloutClient, job_id: str) -> bytes | None:
    kv = await client.js.key_value(client.names.claims_bucket)
    try:
        return (await kv.get(claim_key(job_id))).value
    except nats.js.errors.KeyNotFoundError:
        return None


async def test_a_kill_between_answer_and_ack_still_rolls_up_and_releases(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """The holder is SIGKILLed after storing the answer, before acking the job: the redelivery finds
    the answer, acks without running, and rolls the job's records up into one done record and
    removes its claim (not left for the streams' and bucket's 24 h)."""
    a = _start(nats_url, namespace, "a", tmp_path, env=faults.env("kill", "worker:after-result-before-ack"))
    b = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=80), min_version=0, retry_policy="resume", idempotency_key="k", timeout=60
            )
            result = await handle.result(30)
            assert a.wait(10) == -signal.SIGKILL  # killed at the fault point, after storing it
            records = await progress_records(client.js, client.names, "c", handle.job_id)
            assert records and not any(isinstance(r, DoneRecord) for r in records)
            assert await _claim_value(client, handle.job_id) is not None
            b = _start(nats_url, namespace, "b", tmp_path)

            async def cleaned() -> bool:
                records = await progress_records(client.js, client.names, "c", handle.job_id)
                done = len(records) == 1 and isinstance(records[0], DoneRecord)
                return done and await _claim_value(client, handle.job_id) is None

            await wait_until(cleaned, timeout=15)
            assert len(result.outputs[0].token_ids) == 80 and result.worker_id == "a"
            assert "job already answered; acking" in (tmp_path / "b.log").read_text()
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)


async def _collect(client: RolloutClient, handle: RolloutHandle, chunks: list[TokenChunk]) -> None:
    async for chunk in client.stream(handle):
        chunks.append(chunk)


def _joined_once(chunks: list[TokenChunk], n: int) -> list[list[int]]:
    """Each sample's tokens as a consumer puts the chunks together; fails on a chunk that does not
    start where its sample stands (a gap, or a token given twice) or a rewind (none here)."""
    samples: list[list[int]] = [[] for _ in range(n)]
    for c in chunks:
        where = [(x.index, x.start, len(x.token_ids)) for x in chunks]
        assert not c.rewound and c.start == len(samples[c.index]), where
        samples[c.index] += c.token_ids
    return samples


async def test_a_stream_that_lags_the_answer_catches_up_from_it(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """The client opens the job's stream only once the answer is in: first while its holder is
    stopped between storing the answer and acking (every checkpoint still on the subject, in flight
    to the stream when it sees the answer), then after the redelivery has rolled the records up
    (only the done record left: all of it from the answer, ``streaming._rest``). Both times the
    chunks put together are the result's tokens and log-probs, each token once, one finish per
    sample. (``test_progress_replay`` tries ``_rest`` after every partial prefix.)"""
    slow = ("--echo-token-latency", "0.005")  # several checkpoints per sample
    a = _start(nats_url, namespace, "a", tmp_path, *slow, env=faults.env("pause", "worker:after-result-before-ack"))
    b = None
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=TOPO) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            job = payload(max_tokens=120)
            job = type(job)(prompt_token_ids=job.prompt_token_ids, sampling=job.sampling, n=2)
            handle = await client.submit(job, min_version=0, retry_policy="resume", idempotency_key="k", timeout=60)
            result = await handle.result(30)
            wanted = [out.token_ids for out in result.outputs]
            stored = await progress_records(client.js, client.names, "c", handle.job_id)
            assert len(stored) > 2 and not any(isinstance(r, DoneRecord) for r in stored)  # not rolled up
            for phase in ("checkpoints on the subject", "rolled up"):
                chunks = [c async for c in client.stream(handle)]
                assert _joined_once(chunks, 2) == wanted, phase
                lps = [[lp for c in chunks if c.index == i for lp in c.logprobs or []] for i in range(2)]
                assert lps == [out.logprobs for out in result.outputs], phase
                assert sorted(c.index for c in chunks if c.finish) == [0, 1], phase
                if phase == "rolled up":
                    assert [(c.start, len(c.token_ids)) for c in chunks] == [(0, 120), (0, 120)]  # all from the answer
                    break
                a.send_signal(signal.SIGKILL)
                a.wait(10)
                b = _start(nats_url, namespace, "b", tmp_path)

                async def rolled_up() -> bool:
                    records = await progress_records(client.js, client.names, "c", handle.job_id)
                    return len(records) == 1 and isinstance(records[0], DoneRecord)

                await wait_until(rolled_up, timeout=15)
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)


@pytest.fixture
def perm_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedBroker]:
    """The broker with the generated permissions (namespace ``run1``, workers ``w1`` and ``w2``)."""
    for name, value in TEST_SECRETS.items():
        monkeypatch.setenv(name, value)
    broker = EmbeddedBroker(
        store_dir=tmp_path / "store",
        config=BROKER_CONFIG / "auth" / "permissions.conf",
        log_file=tmp_path / "nats.log",
        extra_args=["-m", str(free_port())],
    ).start()
    try:
        yield broker
    finally:
        broker.stop()


def _as(url: str, user: str) -> str:
    return url.replace("nats://", f"nats://{user}:{TEST_SECRETS['ROLLFLEET_PASSWORD_' + user.upper()]}@")


async def test_a_rogue_worker_writing_a_running_jobs_claim_fences_nothing(
    perm_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """Worker user ``w2`` (within its permissions: it may write any claims key) learns the running
    resumable job's claim key from the progress stream's subjects and keeps overwriting the claim
    with a fresh one of its own, and deleting it. Its writes carry no MAC of the job id, so they
    are nobody's claim: the holder writes its own back and runs on, and the job is answered once,
    by that run alone, with no resume."""
    ns = "run1"
    names = Names(ns)
    async with await RolloutClient.connect(
        _as(perm_broker.url, "trainer"), namespace=ns, client_id="c", topology=TOPO
    ) as client:
        w1 = _start(_as(perm_broker.url, "w1"), ns, "w1", tmp_path, "--echo-token-latency", "0.01")
        rogue = await nats.connect(_as(perm_broker.url, "w2"), inbox_prefix=names.inbox_prefix("worker", "w2"))
        try:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=300), min_version=0, retry_policy="resume", idempotency_key="k", timeout=60
            )
            rjs = rogue.jetstream(timeout=5)

            async def subject() -> str | None:
                info = await rjs.stream_info(names.progress_stream, subjects_filter=">")
                return next(iter(info.state.subjects or {}), None)

            key = (await wait_until(subject, timeout=10)).rpartition(".")[2]
            assert key == claim_key(handle.job_id)  # what the progress stream tells every worker
            claims = await rjs.key_value(names.claims_bucket)
            writes, until = 0, time.monotonic() + 20  # (the job runs for about 3 s)
            while not handle.done() and time.monotonic() < until:
                if writes % 3 == 2:
                    await claims.delete(key)
                else:
                    await claims.put(key, Claim(f"w2:1-rogue{writes}", time.time()).encode())
                writes += 1
                await asyncio.sleep(0.1)
            result = await handle.result(1)
            out = result.outputs[0]
            assert writes > 20 and len(out.token_ids) == 300 and out.finish_reason == "length"
            assert result.worker_id == "w1" and result.resumes == 0 and result.kept_tokens == 0
            assert {s.replica for s in out.weight_versions} == {"w1"}
            assert "claim rewritten by someone else; written back" in (tmp_path / "w1.log").read_text()
        finally:
            await rogue.close()
            terminate(w1, 10.0, signal.SIGKILL)
    log = (tmp_path / "nats.log").read_text(errors="replace").lower()
    assert "violation" not in log  # the rogue stayed within a worker's permissions


async def test_checkpoints_are_split_below_a_small_message_limit(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """With a message limit of 64 KiB (``--max-msg-bytes``) and a checkpoint of 8,000 tokens with
    log-probs (about 100 kB as one record), the checkpoint goes in records that each fit: the
    job is answered at once, and its records, read back, are its tokens."""
    small = TopologyConfig(max_msg_bytes=64 * 1024, ack_wait_s=1.0)
    big = ("--max-msg-bytes", str(small.max_msg_bytes), "--checkpoint-tokens", "100000", "--checkpoint-s", "60")
    a = _start(nats_url, namespace, "a", tmp_path, *big)
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=small) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=8000), min_version=0, retry_policy="resume", idempotency_key="k", timeout=60
            )
            chunks: list[TokenChunk] = []
            streaming = asyncio.create_task(_collect(client, handle, chunks))  # reads the records as stored
            result = await handle.result(15)
            await asyncio.wait_for(streaming, 10)
            assert len(result.outputs[0].token_ids) == 8000 and result.resumes == 0
            assert _joined_once(chunks, 1) == [result.outputs[0].token_ids]
            log = (tmp_path / "a.log").read_text()
            assert "last checkpoint not stored" not in log
    finally:
        terminate(a, 10.0, signal.SIGKILL)


async def _stored_by(client: RolloutClient, job_id: str, replica: str, at_least: int) -> None:
    """Wait until ``replica`` has checkpointed at least ``at_least`` tokens of the job."""

    async def enough() -> bool:
        records = await progress_records(client.js, client.names, "c", job_id)
        spans = [
            s
            for r in records
            if isinstance(r, TokensRecord)
            for d in r.samples
            for s in d.spans
            if s.replica == replica
        ]
        return sum(s.end - s.start for s in spans) >= at_least

    await wait_until(enough, timeout=20)


async def test_a_resumable_job_outliving_max_deliver_is_stored_again_and_resumed(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """``max_deliver`` 2 (the default is 10): the job's first two holders are SIGKILLed mid-job, so the
    broker gives up on that message. The client stores the job again (the same job: its
    checkpoints are kept), and a third replica resumes it: answered once, its tokens made by the
    three replicas in order, every checkpointed token kept."""
    topo = TopologyConfig(ack_wait_s=1.0, max_deliver=2)
    slow = ("--echo-token-latency", "0.01")
    procs = [_start(nats_url, namespace, "r0", tmp_path, *slow)]
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topo) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(
                payload(max_tokens=400), min_version=0, retry_policy="resume", idempotency_key="k", timeout=60
            )
            for victim in range(2):
                await _stored_by(client, handle.job_id, f"r{victim}", 30)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait(10)
                procs.append(_start(nats_url, namespace, f"r{victim + 1}", tmp_path, *slow))
            records = await progress_records(client.js, client.names, "c", handle.job_id)
            stored = [t for r in records if isinstance(r, TokensRecord) for d in r.samples for t in d.token_ids]
            result = await handle.result(25)
            out = result.outputs[0]
            replicas = [s.replica for s in out.weight_versions]
            assert replicas == ["r0", "r1", "r2"] and result.resumes == 2 and len(out.token_ids) == 400
            assert out.token_ids[: len(stored)] == stored and result.kept_tokens == len(stored)  # none lost
            assert handle.moves == 1  # stored again once, when the broker gave up on its message
    finally:
        for p in procs:
            terminate(p, 10.0, signal.SIGKILL)


async def test_a_hand_back_deletes_only_the_claim_it_still_holds(nc: nats.NATS, namespace: str) -> None:
    """Two replicas' runners of one resumable job: the old holder hands it back after another run
    took the claim over (unnoticed: a hand-back can race the refresh that would have told it). The
    new holder's claim stays; a hand-back of the holder itself deletes it."""
    from rollfleet.broker.topology import ensure_topology
    from rollfleet.runtime.logs import get_logger
    from rollfleet.schemas import DEFAULT_LIMITS, RolloutJob, VersionConstraint
    from rollfleet.schemas.progress import open_claim
    from rollfleet.workers.engines.echo import EchoEngine
    from rollfleet.workers.job_runner import JobRunner
    from rollfleet.workers.served_version import ServedVersion
    from rollfleet.workers.worker_metrics import WorkerMetrics

    js, names = nc.jetstream(), Names(namespace)
    await ensure_topology(js, names, TOPO)
    claims = await js.key_value(names.claims_bucket)

    def runner(worker_id: str) -> JobRunner:
        return JobRunner(
            js, names, EchoEngine(), worker_id=worker_id, limits=DEFAULT_LIMITS, ack_wait_s=1.0,
            max_message_bytes=1 << 20, metrics=WorkerMetrics(worker_id, "echo"), log=get_logger("test"),
            served=ServedVersion(0), claims=claims,
        )  # fmt: skip

    old, new = runner("old"), runner("new")
    job = RolloutJob(
        job_id="job-1", idempotency_key="k", client_id="c", constraint=VersionConstraint("min", 0),
        payload=payload(), deadline=4e9, submitted_at=1.0, retry_policy="resume",
    )  # fmt: skip
    key = claim_key(job.job_id)
    await claims.put(key, new.claims.value(job))  # taken over by the new holder
    await old.claims.release(job, only_own=True)  # the old holder's hand-back
    held = open_claim(job.job_id, (await claims.get(key)).value)
    assert held is not None and held.worker_id == "new"
    await new.claims.release(job, only_own=True)
    with pytest.raises((nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError)):
        await claims.get(key)


async def test_a_stream_whose_progress_the_broker_will_not_follow_comes_whole_from_the_answer(
    tmp_path: Path,
) -> None:
    """The broker does not make the stream's consumer (here it refuses the trainer that consumer
    outright; in a cluster electing, or a node cut off, its request times out: campaign seed 313,
    ``--cluster``, raised a raw ``nats.errors.TimeoutError`` out of ``client.stream``). The stream
    still ends with the result's tokens, whole, from the answer."""
    ns = "tsf"
    progress = Names(ns).progress_stream
    conf = tmp_path / "nats.conf"
    conf.write_text(
        "jetstream { max_file_store: 20GB }\n"  # (the jobs stream reserves its max_bytes, 4 GiB)
        "accounts { A { jetstream: enabled, users: [\n"
        '  { user: trainer, password: t, permissions: { publish: { allow: [">"], deny: [\n'
        f'    "$JS.API.CONSUMER.CREATE.{progress}", "$JS.API.CONSUMER.CREATE.{progress}.>" ] }}}} }}\n'
        "  { user: worker, password: w }\n"
        "] } }\n"
    )
    broker = EmbeddedBroker(store_dir=tmp_path / "store", config=conf, log_file=tmp_path / "nats.log").start()
    a = None
    try:
        url = broker.url
        a = _start(url.replace("nats://", "nats://worker:w@"), ns, "a", tmp_path, "--echo-token-latency", "0.005")
        async with await RolloutClient.connect(
            url.replace("nats://", "nats://trainer:t@"), namespace=ns, client_id="c", topology=TOPO
        ) as client:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, timeout=20)
            handle = await client.submit(payload(max_tokens=60), min_version=0, retry_policy="resume", timeout=60)
            chunks = [c async for c in client.stream(handle)]
            result = await handle.result(30)
            assert _joined_once(chunks, 1) == [result.outputs[0].token_ids]
            assert [(c.start, len(c.token_ids)) for c in chunks] == [(0, 60)]  # all from the answer
        assert "Violation" in (tmp_path / "nats.log").read_text(errors="replace")  # (it was refused)
    finally:
        if a is not None:
            terminate(a, 10.0)
        broker.stop()
