"""The weight path through an object store: commit -> every replica serving, S3 against a directory.

Shape (issue 21): N ``rollfleet worker --engine echo --store <store>`` processes (echo: the engine
costs nothing, so what is timed is the weight path: notice, download, apply and verify, activate)
follow versions a trainer (this process) publishes with ``PolicyPublisher`` (1 % of every
tensor's elements changed, xor deltas) and commits. Two stores, in the same run and on the same
broker, alternated per version so the machine's drift hits both alike:

- a store directory on this machine's disk (the baseline: a shared filesystem), and
- an S3 bucket on a real S3 API server process (``moto_server``), through ``s3://``.

Reported per store: commit -> the last replica's ``activated_at`` (median over versions; the
headline, with the S3/directory ratio against the goal <= 1.5x), bytes each replica read per
version, and a late joiner's catch-up after 20 versions (a fresh local directory materialized to
the newest version, in this process) with keyframes every 10 versions and without any.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks._fleet import REPO, machine_load
from benchmarks.bench_activation import rl_step
from benchmarks.bench_convergence import Observer
from benchmarks.report import Row
from harness import spawn, stop_all, temp_broker, worker_command
from rollfleet.cli import local_s3 as s3
from rollfleet.models import build_model_dir, load_model_tensors, param_count
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.remote import materialize_from, open_store
from rollfleet.policy_store.store import version_dir_name
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

GOAL = 1.5  # S3 within 1.5x of the shared directory, commit -> all serving


@contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process's environment for a while (where obstore reads credentials)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def follow_fleet(
    url: str, server: s3.S3Server, base: Path, n: int, versions: int, tmp: Path
) -> dict[str, dict[str, float]]:
    """Per store kind: median all-activated seconds and bytes read per replica per version."""
    stores = {"dir": str(tmp / "store"), "s3": server.url("bench-" + uuid.uuid4().hex[:6])}
    env = {**server.env(), "ROLLFLEET_LOG_JSON": "1"}
    # The trainer reaches the bucket as the workers do: from its environment.
    with environ(env):
        return await _follow(url, stores, base, n, versions, tmp, env)


async def _follow(
    url: str, stores: dict[str, str], base: Path, n: int, versions: int, tmp: Path, env: dict[str, str]
) -> dict[str, dict[str, float]]:
    tensors = load_model_tensors(base)
    fleets: dict[str, tuple[PolicyPublisher, list[str], RolloutClient, Observer]] = {}
    procs = []
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in stores}
    try:
        for kind, store in stores.items():
            namespace = f"os{kind}" + uuid.uuid4().hex[:6]
            client = await RolloutClient.connect(url, namespace=namespace, client_id="trainer")
            observer = Observer(client)
            await observer.start()
            publisher = PolicyPublisher(store, base, keyframe_every=0, keep_last=4)
            await client.publish_policy(publisher, tensors)
            workers = [f"{kind}-{i}" for i in range(n)]
            for w in workers:
                args = ["--engine", "echo", "--store", store, "--local-dir", str(tmp / w), "--heartbeat", "0.5"]
                procs.append(spawn(worker_command(url, namespace, w, *args), tmp / f"{w}.log", env=env, cwd=REPO))
            fleets[kind] = (publisher, workers, client, observer)
        for _, _, client, _ in fleets.values():
            await client.wait_for_version(0, replicas=n, timeout=600)
        gen = torch.Generator().manual_seed(0)
        for version in range(1, versions + 1):
            rl_step(tensors, gen)
            order = list(fleets) if version % 2 else list(reversed(fleets))
            for kind in order:
                publisher, workers, client, observer = fleets[kind]
                record = await asyncio.to_thread(publisher.publish, tensors)  # written (uploaded): not timed
                committed_at = time.time()
                await client.commit_version(record)
                await observer.wait(workers, version, timeout=600)
                acts = [observer.activated[(w, version)][0] for w in workers]
                samples[kind].append(
                    {
                        "all_s": max(a.activated_at for a in acts) - committed_at,
                        "first_s": min(a.activated_at for a in acts) - committed_at,
                        "prepare_s": max(a.prepare_s for a in acts),
                        "bytes": statistics.mean(a.wire_bytes for a in acts),
                    }
                )
                print(f"  {kind} v{version}: all serving {samples[kind][-1]['all_s']:.4f} s", flush=True)
    finally:
        stop_all(procs, timeout=30)
        for publisher, _, client, observer in fleets.values():
            observer.close()
            publisher.close()
            await client.close()
    return {
        kind: {k: statistics.median(s[k] for s in rows) for k in rows[0]} | {"each": [s["all_s"] for s in rows]}  # type: ignore[dict-item]
        for kind, rows in samples.items()
    }


def late_joiner(server: s3.S3Server, base: Path, versions: int, keyframe_every: int, tmp: Path) -> dict[str, float]:
    """Catch-up of a fresh replica after ``versions`` versions, from each store kind."""
    tensors = load_model_tensors(base)
    gen = torch.Generator().manual_seed(1)
    stores = {"dir": str(tmp / f"late-store-{keyframe_every}"), "s3": server.url(f"late-{keyframe_every}")}
    pubs = {k: PolicyPublisher(s, base, keyframe_every=keyframe_every, keep_last=None) for k, s in stores.items()}
    for pub in pubs.values():
        pub.publish(tensors)
    for _ in range(versions):
        rl_step(tensors, gen)
        for pub in pubs.values():
            pub.publish(tensors)
    out: dict[str, float] = {}
    if keyframe_every:  # the newest keyframe's download alone: ours against one plain GET per file
        out |= download_rate(stores["s3"], versions // keyframe_every * keyframe_every, tmp)
    for kind, store in stores.items():
        local = tmp / f"late-{kind}-{keyframe_every}"
        t0 = time.perf_counter()
        result = materialize_from(open_store(store), local, versions)
        out[kind] = time.perf_counter() - t0
        out[f"{kind}_applied"] = len(result.applied)
        shutil.rmtree(local, ignore_errors=True)
    for pub in pubs.values():
        pub.close()
    return out


def download_rate(url: str, version: int, tmp: Path) -> dict[str, float]:
    """MB/s of ``Bucket.download`` (parallel ranged reads, journaled) against one plain GET per file."""
    import obstore

    bucket = Bucket(url)
    t0 = time.perf_counter()
    _, stats = bucket.download(version, tmp / "rate")
    ours = time.perf_counter() - t0
    shutil.rmtree(tmp / "rate", ignore_errors=True)
    files = bucket.objects()[version]
    t0 = time.perf_counter()
    plain = sum(len(obstore.get(bucket._store, f"{version_dir_name(version)}/{f}").bytes()) for f in files)
    plain_s = time.perf_counter() - t0
    return {"ours_mb_s": stats.fetched / ours / 1e6, "plain_mb_s": plain / plain_s / 1e6, "mb": stats.fetched / 1e6}


async def run_async(preset: str, n: int, versions: int, late_versions: int) -> list[Row]:
    tmp = Path(tempfile.mkdtemp(prefix="rf-bench-os-"))
    server = s3.S3Server(tmp / "s3").start()
    try:
        base = build_model_dir(tmp / "base", preset=preset, seed=0, dtype="float32")
        with temp_broker("rf-bench-os-") as broker:
            print(f"object_store: {preset} N={n}, {versions} versions per store", flush=True)
            fleet = await follow_fleet(broker.url, server, base, n, versions, tmp)
        with environ(server.env()):
            late = {k: late_joiner(server, base, late_versions, k, tmp) for k in (10, 0)}
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    case = f"{preset} ({param_count(preset)} params) N={n}"
    ratio = fleet["s3"]["all_s"] / fleet["dir"]["all_s"]
    rows = [
        Row(
            "object_store/all-serving",
            case + " s3 vs directory",
            "s",
            fleet["s3"]["all_s"],
            fleet["dir"]["all_s"],
            "store directory",
            higher_is_better=False,
            target=f"<= {GOAL}x directory",
            met=ratio <= GOAL,
            extra={
                "s3_each_s": fleet["s3"]["each"],
                "dir_each_s": fleet["dir"]["each"],
                "s3_first_s": fleet["s3"]["first_s"],
                "dir_first_s": fleet["dir"]["first_s"],
                "s3_prepare_s": fleet["s3"]["prepare_s"],
                "dir_prepare_s": fleet["dir"]["prepare_s"],
            }
            | machine_load(),
        ),
        Row(
            "object_store/bytes-per-replica",
            case + " per version, s3 vs directory",
            "B",
            fleet["s3"]["bytes"],
            fleet["dir"]["bytes"],
            "store directory",
            higher_is_better=False,
        ),
    ]
    rate = late[10]
    rows.append(
        Row(
            "object_store/download",
            f"{preset} keyframe ({rate['mb']:.1f} MB), Bucket.download vs one plain GET per file",
            "MB/s",
            rate["ours_mb_s"],
            rate["plain_mb_s"],
            "plain GET",
        )
    )
    for k, res in late.items():
        label = f"keyframes every {k}" if k else "no keyframes"
        rows.append(
            Row(
                "object_store/late-joiner",
                f"{preset} after {late_versions} versions, {label}, s3 vs directory",
                "s",
                res["s3"],
                res["dir"],
                "store directory",
                higher_is_better=False,
                extra={"versions_applied": res["s3_applied"]},
            )
        )
    return rows


def run(quick: bool) -> list[Row]:
    if quick:
        return asyncio.run(run_async("tiny", 2, versions=2, late_versions=4))
    return asyncio.run(run_async("0.1b", 8, versions=4, late_versions=20))


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row.line())
