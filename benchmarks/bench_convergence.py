"""Fleet convergence: from a version's commit until all N worker processes serve it (N = 2 and 4).

A trainer (this process) publishes versions through ``PolicyPublisher`` (~1 % of every tensor's
elements changed, xor deltas) and commits each with ``RolloutClient.commit_version``, while N real
``rollfleet worker --engine hf`` processes (each with ``--store``, its own ``--local-dir`` and
``--verify-live``) are decoding a request each. Each worker's ``VersionActivated`` announcement
(``rf.<ns>.versions.activated``) says when it activated and splits its work into prepare (pull +
apply + verify + stage, while serving) and pause. Per commit we record:

- all activated: commit -> the last worker's ``activated_at`` (the headline),
- notice: commit -> the worker's registry entry shows ``preparing_version`` (seen by a watcher
  here), also derived as ``activated_at - prepare_s - pause_s - commit``,
- pull+apply (``prepare_s``) and pause (``pause_s``), the slowest worker's.

Baseline, in the same run: the same materialize + stage + pause/load/resume done directly in this
process on an idle engine, without the broker (the lower bound of one replica's activation).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats.errors
import torch

from benchmarks._fleet import REPO, machine_load
from benchmarks.bench_activation import rl_step
from benchmarks.report import Row
from harness import spawn, stop_all, temp_broker, worker_command
from rollfleet.models import build_model_dir, param_count
from rollfleet.models import load_model_tensors as load_tensors
from rollfleet.policy_store import materialize
from rollfleet.schemas import Names, ReplicaStatus, RolloutPayload, SamplingParams, VersionActivated, decode
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.workers.engines.hf import HFEngine

BASELINE = "in-process materialize+load"
# Decode tokens of the request each worker is serving across the activation (about a second or two).
INFLIGHT_TOKENS = {"tiny": 400, "0.1b": 40}


class Observer:
    """Timestamps, in this process, what the fleet says: activation announcements and registry changes."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.activated: dict[tuple[str, int], tuple[VersionActivated, float]] = {}
        self.preparing: dict[tuple[str, int], float] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> None:
        async def on_activated(msg: Any) -> None:
            a = decode(msg.data, VersionActivated)
            self.activated[(a.worker_id, a.version)] = (a, time.time())

        names = self.client.names
        await self.client.nc.subscribe(names.versions_activated, cb=on_activated)
        kv = await self.client.js.key_value(names.fleet_bucket)
        watcher = await kv.watch(">")

        async def watch() -> None:
            # A flag, not only the cancel: wait_for inside the watcher can swallow a cancellation.
            while not self._closed:
                try:
                    entry = await watcher.updates(timeout=30.0)
                except nats.errors.TimeoutError:
                    continue
                if entry is None or not entry.value or not entry.key.startswith(Names.REPLICA_PREFIX):
                    continue  # the bucket also holds client leases
                status = decode(entry.value, ReplicaStatus)
                if status.preparing_version is not None:
                    self.preparing.setdefault((status.worker_id, status.preparing_version), time.time())

        self._task = asyncio.create_task(watch())

    async def wait(self, workers: list[str], version: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any((w, version) not in self.activated for w in workers):
            if time.monotonic() > deadline:
                have = sorted(w for (w, v) in self.activated if v == version)
                raise TimeoutError(f"version {version}: only {have} activated within {timeout:.0f}s")
            await asyncio.sleep(0.002)

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()


async def direct_activation(engine: HFEngine, local: Path, store: Path, version: int) -> dict[str, float]:
    """The lower bound: one replica's materialize + stage + pause/load/resume, no broker, idle engine."""
    t0 = time.perf_counter()
    result = await asyncio.to_thread(materialize, local, store, version)
    await engine.prepare_weights(local, result.changed, result.version)
    t1 = time.perf_counter()
    await engine.pause()
    t2 = time.perf_counter()
    await engine.load_weights(local, result.changed, result.version)
    await engine.resume()
    t3 = time.perf_counter()
    return {"prepare_s": t1 - t0, "pause_s": t3 - t2, "total_s": t3 - t0}


async def bench_fleet(url: str, preset: str, n: int, versions: int, tmp: Path) -> list[Row]:
    base = build_model_dir(tmp / "base", preset=preset, seed=0, dtype="float32")
    store = tmp / "store"
    publisher = PolicyPublisher(store, base, keyframe_every=0, keep_last=None)
    tensors = load_tensors(base)
    gen = torch.Generator().manual_seed(0)
    namespace = "cv" + uuid.uuid4().hex[:8]
    workers = [f"hf-{i}" for i in range(n)]
    procs = []
    engine = HFEngine(device="cpu", seed=0)
    samples: list[dict[str, float]] = []
    direct: list[dict[str, float]] = []
    async with await RolloutClient.connect(url, namespace=namespace, client_id="trainer") as client:
        observer = Observer(client)
        await observer.start()
        try:
            await client.publish_policy(publisher, tensors)  # version 0
            # One torch thread per replica: N replicas share this machine's cores.
            env = {"OMP_NUM_THREADS": "1", "ROLLFLEET_LOG_JSON": "1"}
            for w in workers:
                args = ["--engine", "hf", "--device", "cpu", "--store", str(store), "--local-dir", str(tmp / w)]
                args += ["--verify-live", "--capacity", "4", "--heartbeat", "0.5"]
                procs.append(spawn(worker_command(url, namespace, w, *args), tmp / f"{w}.log", env=env, cwd=REPO))
            await client.wait_for_version(0, replicas=n, timeout=300)
            await asyncio.to_thread(materialize, tmp / "direct", store, 0)
            await engine.start(tmp / "direct", 0)
            long = RolloutPayload(
                prompt_token_ids=list(range(3, 19)),
                sampling=SamplingParams(max_tokens=INFLIGHT_TOKENS.get(preset, 40), temperature=1.0, seed=1),
                extra={"ignore_eos": True},
            )
            for version in range(1, versions + 1):
                rl_step(tensors, gen)
                record = await asyncio.to_thread(publisher.publish, tensors)  # files written: not timed
                # A request decoding on every worker across the activation.
                handles = [await client.submit(long, min_version=0) for _ in workers]
                await asyncio.sleep(0.3)
                committed_at = time.time()
                await client.commit_version(record)
                await observer.wait(workers, version, timeout=300)
                acts = {w: observer.activated[(w, version)] for w in workers}
                per = []
                for w, (a, received_at) in acts.items():
                    noticed = observer.preparing.get((w, version))
                    per.append(
                        {
                            "activated_s": a.activated_at - committed_at,
                            "received_s": received_at - committed_at,
                            "prepare_s": a.prepare_s,
                            "pause_s": a.pause_s,
                            "notice_derived_s": a.activated_at - a.prepare_s - a.pause_s - committed_at,
                            "notice_seen_s": (noticed - committed_at) if noticed is not None else float("nan"),
                        }
                    )
                digests = {a.weights_digest for a, _ in acts.values()}
                assert len(digests) == 1 and None not in digests, f"replicas serve different bytes: {digests}"
                samples.append(
                    {k: max(p[k] for p in per) for k in per[0]} | {"first_s": min(p["activated_s"] for p in per)}
                )
                await asyncio.gather(*(h.result(300) for h in handles))
                direct.append(await direct_activation(engine, tmp / "direct", store, version))
        finally:
            observer.close()
            await engine.close()
            stop_all(procs, timeout=30)
            publisher.close()

    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    dmed = {k: statistics.median(d[k] for d in direct) for k in direct[0]}
    params = param_count(preset)
    case = f"{preset} N={n}"
    extra: dict[str, object] = {
        "params": params,
        "workers": n,
        "versions": versions,
        "all_activated_s_each": [round(s["activated_s"], 4) for s in samples],
        "first_activated_s": round(med["first_s"], 4),
        "announcement_received_s": round(med["received_s"], 4),
        "notice_seen_s": round(med["notice_seen_s"], 4),
        "notice_derived_s": round(med["notice_derived_s"], 4),
        "prepare_s": round(med["prepare_s"], 4),
        "pause_s": round(med["pause_s"], 5),
        "worker_threads": 1,
        "inflight_tokens": INFLIGHT_TOKENS.get(preset, 40),
    } | machine_load()
    rows = [
        Row(
            "convergence/all-activated",
            case,
            "s",
            med["activated_s"],
            dmed["total_s"],
            BASELINE,
            higher_is_better=False,
            extra=extra,
        ),
        Row(
            "convergence/pull+apply",
            case + " slowest prepare_s",
            "s",
            med["prepare_s"],
            dmed["prepare_s"],
            BASELINE,
            higher_is_better=False,
        ),
        Row(
            "convergence/pause",
            case + " slowest pause_s",
            "s",
            med["pause_s"],
            dmed["pause_s"],
            BASELINE,
            higher_is_better=False,
        ),
        Row(
            "convergence/notice",
            case + " commit->preparing",
            "s",
            med["notice_seen_s"],
            extra={"derived_s": round(med["notice_derived_s"], 4)},
            higher_is_better=False,
        ),
    ]
    return rows


async def run_async(cases: list[tuple[str, int]], versions: int) -> list[Row]:
    rows: list[Row] = []
    with temp_broker("rf-bench-cv-") as broker:
        for preset, n in cases:
            tmp = Path(tempfile.mkdtemp(prefix=f"rf-bench-cv-{preset}-{n}-"))
            try:
                print(f"convergence: {preset} N={n}", flush=True)
                rows += await bench_fleet(broker.url, preset, n, versions, tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return rows


def run(quick: bool) -> list[Row]:
    if quick:
        return asyncio.run(run_async([("tiny", 2)], versions=2))
    return asyncio.run(run_async([("tiny", 2), ("tiny", 4), ("0.1b", 2), ("0.1b", 4)], versions=3))


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row.line())
