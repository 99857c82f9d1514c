"""End to end through an object store: real ``rollfleet worker --engine hf --store s3://...``
processes follow versions a trainer publishes into a real S3 API server (``moto_server``); the
weights never touch a filesystem the trainer and the workers share."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from harness import start_worker_process, terminate, wait_until
from rollfleet.cli import local_s3 as s3
from rollfleet.models import build_model_dir, load_model_tensors
from rollfleet.policy_store.digest import weights_digest
from rollfleet.schemas import RolloutPayload, SamplingParams, VersionActivated, decode
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

pytestmark = [pytest.mark.slow, pytest.mark.skipif(s3.unavailable() is not None, reason=str(s3.unavailable()))]

JOB = RolloutPayload(
    prompt_token_ids=[5, 6, 7, 8],
    sampling=SamplingParams(max_tokens=96, temperature=1.0, seed=1),
    extra={"ignore_eos": True},
)


def rl_step(tensors: dict[str, torch.Tensor], gen: torch.Generator, density: float = 0.01) -> None:
    for t in tensors.values():
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * density)),), generator=gen)
        flat[idx] += torch.randn(len(idx), generator=gen).to(flat.dtype) * 0.05


async def digests(client: RolloutClient) -> dict[tuple[str, int], str]:
    """(worker, version) -> the digest of the live weights each activation (or start) announced."""
    sub = await client.js.pull_subscribe(client.names.versions_activated, stream=client.names.events_stream)
    out: dict[tuple[str, int], str] = {}
    try:
        while True:
            for m in await sub.fetch(100, timeout=0.5):
                a = decode(m.data, VersionActivated)
                out[(a.worker_id, a.version)] = a.weights_digest or ""
    except TimeoutError:
        pass
    await sub.unsubscribe()
    return out


async def test_workers_follow_a_bucket_exact_jobs_hold_and_a_late_joiner_catches_up(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    server = s3.S3Server(tmp_path / "s3").start()
    env = server.env()
    url = server.url("run")
    base = build_model_dir(tmp_path / "base", preset="tiny", seed=0)
    tensors = load_model_tensors(base)
    gen = torch.Generator().manual_seed(0)
    procs = []

    def worker(name: str) -> None:
        procs.append(
            start_worker_process(
                nats_url, namespace, name, "--engine", "hf", "--device", "cpu", "--store", url,
                "--local-dir", str(tmp_path / name), "--verify-live", "--capacity", "4",
                log_path=tmp_path / f"{name}.log", env=env,
            )
        )  # fmt: skip

    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            publisher = PolicyPublisher(url, base, keyframe_every=4, keep_last=3)
        sums: dict[int, str] = {}
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer") as client:
            assert (await client.publish_policy(publisher, tensors)).version == 0
            sums[0] = weights_digest(publisher.checksums)
            # Wrong credentials: the worker says so in one line and stops; the secret is never printed.
            secret = "not-the-secret-7Hq2Lw"
            bad = start_worker_process(
                nats_url, namespace, "bad", "--engine", "echo", "--store", url, "--local-dir", str(tmp_path / "bad"),
                log_path=tmp_path / "bad.log", env=server.env(secret=secret),
            )  # fmt: skip
            assert await asyncio.to_thread(bad.wait, 60) == 2
            said = (tmp_path / "bad.log").read_text()
            assert "rollfleet: error: " in said and "s3://rollfleet-weights/run" in said
            assert "SignatureDoesNotMatch" in said
            assert secret not in said and "Traceback" not in said, said
            worker("w0")
            await client.wait_for_version(0, replicas=1, timeout=90)
            # Exact jobs at the version about to be replaced, taken before the commit: each runs
            # entirely at its version, across the activation that follows.
            pinned = []
            for step in (1, 2):
                # One job: the registry's in_flight says it was taken (running, or answered) before
                # the commit, so it is not left to the orphan rule (with two, only one might be).
                handle = await client.submit(JOB, exact_version=step - 1, timeout=90)
                pinned.append(handle)
                await wait_until(lambda h=handle: h.done() or client.fleet.replicas()[0].in_flight >= 1, timeout=30)
                rl_step(tensors, gen)
                assert (await client.publish_policy(publisher, tensors)).version == step
                sums[step] = weights_digest(publisher.checksums)
                await client.wait_for_version(step, replicas=1, timeout=90)
            for handle in pinned:
                result = await handle.result(120)
                v = handle.job.constraint.version
                assert [(w.version, w.start, w.end) for w in result.outputs[0].weight_versions] == [(v, 0, 96)]
            for step in range(3, 11):  # ten versions in all, keyframes at 4 and 8, retention on
                rl_step(tensors, gen)
                await client.publish_policy(publisher, tensors)
                sums[step] = weights_digest(publisher.checksums)
            worker("late")  # starts after ten versions, from an empty local directory
            await client.wait_for_version(10, replicas=2, timeout=120)
            after = await client.submit(JOB, exact_version=10, timeout=60)
            assert (await after.result(120)).outputs[0].weight_versions[0].version == 10
            seen = await digests(client)
            assert seen[("w0", 10)] == sums[10]  # the live weights are the trainer's, byte for byte
            assert seen[("late", 10)] == sums[10]
            for step in (1, 2):
                assert seen[("w0", step)] == sums[step]

            # A corrupt object in the bucket: both replicas refuse the version (degraded, with the
            # reason) and keep serving 12; once the object is repaired, the next version goes
            # through, re-reading the repaired one rather than a cached bad copy.
            for _ in (11, 12):  # (12 is a keyframe: the bad version below must be a delta needed later)
                rl_step(tensors, gen)
                await client.publish_policy(publisher, tensors)
            await client.wait_for_version(12, replicas=2, timeout=120)
            rl_step(tensors, gen)
            record = await asyncio.to_thread(publisher.publish, tensors)
            s3c = server.client()
            [key] = [o["Key"] for o in s3c.list_objects_v2(Bucket=s3.BUCKET, Prefix="run/weight_v000013/")["Contents"]
                     if o["Key"].endswith(".safetensors")]  # fmt: skip
            good = s3c.get_object(Bucket=s3.BUCKET, Key=key)["Body"].read()
            bad = bytearray(good)
            bad[-3] ^= 0xFF
            s3c.put_object(Bucket=s3.BUCKET, Key=key, Body=bytes(bad))
            await client.commit_version(record)

            def both_degraded() -> bool:
                entries = [r for r in client.fleet.replicas() if r.worker_id in ("w0", "late")]
                return len(entries) == 2 and all(r.state == "degraded" for r in entries)

            await wait_until(both_degraded, timeout=60)
            for r in client.fleet.replicas():
                assert r.active_version == 12 and "13" in (r.degraded_reason or ""), r
            held = [await client.submit(JOB, exact_version=12, timeout=60) for _ in range(2)]
            for handle in held:
                assert (await handle.result(120)).outputs[0].weight_versions[0].version == 12
            s3c.put_object(Bucket=s3.BUCKET, Key=key, Body=good)
            rl_step(tensors, gen)
            await client.publish_policy(publisher, tensors)
            await client.wait_for_version(14, replicas=2, timeout=120)
            seen = await digests(client)
            assert seen[("w0", 14)] == seen[("late", 14)] == weights_digest(publisher.checksums)
        # The late joiner seeded from the newest keyframe (8) and applied 9 and 10; nothing cached stays.
        lines = (tmp_path / "late.log").read_text().splitlines()
        late_log = [json.loads(line) for line in lines if line.startswith("{")]
        caught = [e for e in late_log if e.get("event") == "caught up"]
        assert caught and caught[0].get("applied") == [8, 9, 10], caught
        assert sorted(p.name for p in (tmp_path / "late" / ".rollfleet-store").iterdir()) == [".rollfleet.lock"]
        kept = sorted(int(o["Key"].split("/")[1][8:]) for o in server.client().list_objects_v2(
            Bucket=s3.BUCKET, Prefix="run/")["Contents"] if o["Key"].endswith("index.json"))  # fmt: skip
        assert kept == [0, 12, 13, 14]  # retention: the base, the newest keyframe, what follows
        for name in ("w0", "late"):  # the repaired 13 was read again, not a cached bad copy
            events = [json.loads(x) for x in (tmp_path / f"{name}.log").read_text().splitlines() if x.startswith("{")]
            [act] = [e for e in events if e.get("event") == "activated" and e.get("version") == 14]
            assert act["versions_applied"] == [13, 14], act
    finally:
        for p in procs:
            terminate(p, 20.0, signal.SIGTERM)
        server.stop()
