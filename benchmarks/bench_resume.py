"""Resumable generations (``retry_policy="resume"``): what checkpointing costs, and what it saves
when workers die.

Real ``rollfleet worker --engine hf`` processes (the tiny preset of ``rollfleet.models``, on the
CPU, one torch thread each) serve long jobs: ``max_tokens`` tokens with ``ignore_eos``, so every
job generates exactly ``max_tokens``, at temperature 1.0. Everything is measured in this run,
against ``retry_policy="replayable"`` (the same jobs, run again from the first token when their
worker dies) as the baseline:

1. No kills: the same batch, replayable and resume (the worker's default checkpoints: every 64
   tokens or 2 s) in alternating rounds on one fleet, after a warm-up round of each. Throughput
   (useful tokens / batch wall time, all rounds of a policy together); the broker bytes of
   checkpoint records per job (the workers' ``rollfleet_checkpoint_bytes_total``, the done record
   included) next to the size of the job's result.
2. Kills: a fresh fleet per policy (ack wait 1 s on the workers and the client), the batch
   submitted, and a ready worker SIGKILLed on a seeded schedule (the same times and picks for
   both policies). Each kill brings in a replacement at once (a new worker id) from a warm spare:
   a process started with the fleet that has imported torch and transformers and waits to be
   told its worker id (``python -m benchmarks.bench_resume spare GO``, then exactly the
   ``rollfleet worker`` CLI), so the fleet is back to its size in a second or two instead of the
   ~20 s a cold start takes on two busy cores. Right before each SIGKILL the victim's
   ``rollfleet_resumable_tokens_generated_total`` is scraped; what the final results keep of it is
   the sum of their spans naming the victim (``VersionSpan.replica``). Generated vs useful tokens
   sums that counter over every worker (victims at their kill, the rest at the end). The counter
   counts resumable jobs only, so replayable's total is not measured; its cost under the same
   kills is read from the batch wall time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from benchmarks._fleet import REPO, machine_load
from benchmarks.report import Row
from harness import cpu_seconds, spawn, stop_all, temp_broker, terminate, wait_until, worker_command
from harness.processes import CHILD_LOG_ENV
from rollfleet.broker.topology import TopologyConfig
from rollfleet.models import build_model_dir
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams, encode
from rollfleet.trainer_client import RolloutClient

BASELINE = "replayable"
TARGET_COST = 0.95  # resume's throughput without kills, as a fraction of replayable's
TARGET_KEPT = 0.90  # of the tokens a killed worker generated, the fraction the final results keep
KILL_ACK_WAIT_S = 1.0
PROMPT_TOKENS = 16
SEED = 7
WORKER_ENV = {"OMP_NUM_THREADS": "1"}  # the replicas share this machine's cores

GENERATED = "rollfleet_resumable_tokens_generated_total"
CHECKPOINTED = "rollfleet_tokens_checkpointed_total"
CHECKPOINT_BYTES = "rollfleet_checkpoint_bytes_total"
CHECKPOINTS = "rollfleet_checkpoints_total"
RESUMED = "rollfleet_resumed_jobs_total"
COUNTERS = (GENERATED, CHECKPOINTED, CHECKPOINT_BYTES, CHECKPOINTS, RESUMED)


@dataclass(frozen=True)
class Shape:
    workers: int
    capacity: int
    max_tokens: int
    jobs: int  # per no-kill round
    pairs: int  # no-kill rounds of each policy (alternating which goes first)
    kill_jobs: int  # the batch under kills
    kills: int  # at most (none once the batch is done)
    first_kill_s: tuple[float, float]  # after the first submit, uniform in this range
    kill_gap_s: tuple[float, float]  # between kills, uniform in this range


QUICK = Shape(
    workers=2, capacity=4, max_tokens=128, jobs=4, pairs=1, kill_jobs=16, kills=1,
    first_kill_s=(0.3, 0.4), kill_gap_s=(1.0, 1.0),
)  # fmt: skip
FULL = Shape(
    workers=3, capacity=4, max_tokens=512, jobs=24, pairs=4, kill_jobs=96, kills=4,
    first_kill_s=(1.5, 3.0), kill_gap_s=(3.0, 5.0),
)  # fmt: skip


# -- pieces ------------------------------------------------------------------------------------


def job_payload(i: int, max_tokens: int) -> RolloutPayload:
    prompt = [3 + (i * 7 + k) % 1000 for k in range(PROMPT_TOKENS)]  # (the tiny vocabulary has 1024)
    return RolloutPayload(
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        extra={"ignore_eos": True},  # every job generates exactly max_tokens
    )


def scrape(url: str) -> dict[str, float]:
    """The worker's counters of ``COUNTERS`` (summed over their labels)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def scrape_then_kill(url: str, proc: subprocess.Popen[bytes]) -> tuple[dict[str, float], float]:
    """Scrape the victim and SIGKILL it at once (in this thread: no event-loop hop between the
    two); the counters and the seconds from the scrape's start to the signal."""
    t0 = time.perf_counter()
    counters = scrape(url)
    proc.send_signal(signal.SIGKILL)
    gap = time.perf_counter() - t0
    proc.wait(10)
    return counters, gap


def add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in COUNTERS}


def check(results: list[RolloutResult], max_tokens: int, tag: str) -> None:
    """Every job generated exactly max_tokens; a resumable job's spans tile its output."""
    for r in results:
        for out in r.outputs:
            assert len(out.token_ids) == max_tokens and out.finish_reason == "length", (tag, r.job_id)
            at = 0
            for span in out.weight_versions:
                assert span.start == at and span.end > span.start, (tag, out.weight_versions)
                at = span.end
            assert not out.weight_versions or at == max_tokens, (tag, out.weight_versions)


def kept_by(results: list[RolloutResult], wid: str) -> int:
    """Output tokens of the results generated by ``wid`` (their spans naming it)."""
    return sum(
        span.end - span.start
        for r in results
        for out in r.outputs
        for span in out.weight_versions
        if span.replica == wid
    )


# -- warm spares ---------------------------------------------------------------------------------


def spare_main(go: Path) -> int:
    """A replacement worker kept warm: import what an hf worker imports, say so (``GO.warm``),
    wait for ``GO`` to hold the ``rollfleet`` CLI arguments, then run exactly that CLI."""
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from rollfleet.cli.main import main as cli_main
    from rollfleet.workers.engines import hf  # noqa: F401
    from rollfleet.workers.worker import Worker  # noqa: F401

    try:
        from transformers.models.qwen3 import modeling_qwen3  # noqa: F401  (the tiny preset's model)
    except ImportError:
        pass
    go.with_suffix(".warm").write_text(str(os.getpid()))
    while not go.exists():
        time.sleep(0.02)
    return cli_main(json.loads(go.read_text()))


@dataclass
class Spare:
    proc: subprocess.Popen[bytes]
    go: Path


# -- the fleet -----------------------------------------------------------------------------------


class Fleet:
    """Worker processes in numbered slots; a killed slot's replacement gets a new worker id."""

    def __init__(self, url: str, namespace: str, model: Path, tmp: Path, args: list[str]) -> None:
        self.url, self.namespace, self.model, self.tmp, self.args = url, namespace, model, tmp, args
        self.slots: list[str] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spares: list[Spare] = []
        self._next = 0

    def _argv(self, wid: str) -> list[str]:
        args = ["--engine", "hf", "--device", "cpu", "--model-dir", str(self.model), "--metrics-port", "0"]
        return worker_command(self.url, self.namespace, wid, "--heartbeat", "0.5", *args, *self.args)

    def _new_id(self) -> str:
        self._next += 1
        return f"{self.namespace[-4:]}-w{self._next - 1}"

    def start(self) -> str:
        """A worker started cold (``rollfleet worker``) in a new slot."""
        wid = self._new_id()
        env = CHILD_LOG_ENV | WORKER_ENV
        self.procs[wid] = spawn(self._argv(wid), self.tmp / f"{wid}.log", env=env, cwd=REPO)
        self.slots.append(wid)
        return wid

    def add_spares(self, n: int) -> None:
        for _ in range(n):
            go = self.tmp / f"{self.namespace}-spare{len(self.spares)}.go"
            cmd = [sys.executable, "-m", "benchmarks.bench_resume", "spare", str(go)]
            proc = spawn(cmd, go.with_suffix(".log"), env=CHILD_LOG_ENV | WORKER_ENV, cwd=REPO)
            self.spares.append(Spare(proc, go))

    async def wait_spares_warm(self, timeout: float = 300.0) -> None:
        def warm() -> bool:
            for s in self.spares:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"spare exited: {s.go.with_suffix('.log').read_text()[-2000:]}")
            return all(s.go.with_suffix(".warm").exists() for s in self.spares)

        await wait_until(warm, timeout=timeout, what="spares warm", interval=0.1)

    def replace(self, slot: int) -> str:
        """A new worker in ``slot``: a warm spare told its worker id (a cold start if none is left)."""
        wid = self._new_id()
        if not self.spares:
            env = CHILD_LOG_ENV | WORKER_ENV
            self.procs[wid] = spawn(self._argv(wid), self.tmp / f"{wid}.log", env=env, cwd=REPO)
        else:
            spare = self.spares.pop(0)
            tmp = spare.go.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._argv(wid)[3:]))  # (the arguments after "python -m rollfleet")
            tmp.rename(spare.go)
            self.procs[wid] = spare.proc
        self.slots[slot] = wid
        return wid

    def metrics_url(self, client: RolloutClient, wid: str) -> str | None:
        """Where a ready worker serves its metrics (on this machine; the registry names the host)."""
        status = client.fleet.replica(wid)
        if status is None or status.state != "ready" or not status.metrics_url:
            return None
        return f"http://127.0.0.1:{urlsplit(status.metrics_url).port}/metrics"

    async def wait_ready(self, client: RolloutClient, timeout: float = 300.0) -> None:
        def ready() -> bool:
            for wid in self.slots:
                if self.procs[wid].poll() is not None:
                    raise RuntimeError(f"worker {wid} exited: {(self.tmp / f'{wid}.log').read_text()[-2000:]}")
            return all(self.metrics_url(client, w) is not None for w in self.slots)

        await wait_until(ready, timeout=timeout, what="workers ready", interval=0.1)

    async def scrape_all(self, client: RolloutClient) -> dict[str, dict[str, float]]:
        out = {}
        for wid in self.slots:
            url = self.metrics_url(client, wid)
            out[wid] = await asyncio.to_thread(scrape, url) if url else dict.fromkeys(COUNTERS, 0.0)
        return out

    def cpu_s(self) -> float:
        """CPU seconds of the slots' worker processes so far."""
        return sum(cpu_seconds(self.procs[w].pid) for w in self.slots)

    def close(self) -> None:
        procs = [*self.procs.values(), *(s.proc for s in self.spares)]
        stop_all(procs, timeout=20)
        for proc in procs:
            terminate(proc, 5.0, signal.SIGKILL)


async def batch(
    client: RolloutClient, policy: str, jobs: int, max_tokens: int, tag: str
) -> tuple[list[RolloutResult], float]:
    """Submit ``jobs`` jobs and wait for their results: (results, seconds from the first submit)."""
    t0 = time.perf_counter()
    handles = [
        await client.submit(job_payload(i, max_tokens), min_version=0, retry_policy=policy, timeout=600)  # type: ignore[arg-type]
        for i in range(jobs)
    ]
    results = await asyncio.gather(*(h.result(600) for h in handles))
    wall = time.perf_counter() - t0
    check(results, max_tokens, tag)
    return results, wall


async def mixed_batch(client: RolloutClient, jobs: int, max_tokens: int) -> dict[str, list[float]]:
    """Jobs of both policies in one batch, alternating: each job's seconds from its submit to its
    result, per policy. Both see the same fleet, load and batch neighbours at the same moment, so
    the comparison does not depend on how busy the machine was in one round or another."""

    async def timed(h: Any, t0: float) -> float:
        await h.result(600)
        return time.perf_counter() - t0

    waits: list[tuple[str, Any]] = []
    for i in range(jobs):
        policy = ("replayable", "resume")[i % 2]
        t0 = time.perf_counter()
        h = await client.submit(job_payload(i, max_tokens), min_version=0, retry_policy=policy, timeout=600)  # type: ignore[arg-type]
        waits.append((policy, asyncio.ensure_future(timed(h, t0))))
    out: dict[str, list[float]] = {"replayable": [], "resume": []}
    for policy, task in waits:
        out[policy].append(await task)
    return out


# -- 1. no kills -------------------------------------------------------------------------------


async def steady(url: str, model: Path, tmp: Path, shape: Shape) -> list[dict[str, Any]]:
    namespace = "rsn" + uuid.uuid4().hex[:8]
    fleet = Fleet(url, namespace, model, tmp, ["--capacity", str(shape.capacity), "--max-batch", "32"])
    rounds: list[dict[str, Any]] = []
    async with await RolloutClient.connect(url, namespace=namespace, client_id="bench") as client:
        try:
            for _ in range(shape.workers):
                fleet.start()
            await fleet.wait_ready(client)
            # Warm-up, not measured: a round of each policy as measured (every length, and jobs
            # joining a running batch, seen once).
            for policy in ("replayable", "resume"):
                await batch(client, policy, shape.jobs, shape.max_tokens, "warm-up")
            for pair in range(shape.pairs):
                order = ("replayable", "resume") if pair % 2 == 0 else ("resume", "replayable")
                for policy in order:
                    before = await fleet.scrape_all(client)
                    cpu0 = fleet.cpu_s()
                    results, wall = await batch(client, policy, shape.jobs, shape.max_tokens, policy)
                    cpu = fleet.cpu_s() - cpu0
                    after = await fleet.scrape_all(client)
                    delta = {k: sum(after[w][k] - before[w][k] for w in fleet.slots) for k in COUNTERS}
                    tps = shape.jobs * shape.max_tokens / wall
                    rounds.append(
                        {
                            "policy": policy,
                            "wall_s": wall,
                            "tokens_per_s": tps,
                            "worker_cpu_s": cpu,
                            "generation_s_max": max(r.generation_s for r in results),
                            "queue_wait_s_max": max(r.queue_wait_s for r in results),
                            "result_bytes": statistics.mean(len(encode(r)) for r in results),
                            "per_worker": dict(Counter(r.worker_id for r in results)),
                        }
                        | delta
                    )
                    print(f"no kills, {policy}: {tps!r} tokens/s", flush=True)
            for _ in range(shape.pairs):
                latencies = await mixed_batch(client, shape.jobs, shape.max_tokens)
                rounds.append({"policy": "mixed", "latency_s": latencies})
                print(
                    f"no kills, mixed: mean latency { ({p: statistics.mean(v) for p, v in latencies.items()})!r}",
                    flush=True,
                )
        finally:
            fleet.close()
    return rounds


# -- 2. kills ------------------------------------------------------------------------------------


def kill_schedule(shape: Shape, seed: int) -> list[tuple[float, int]]:
    """(seconds after the first submit, a number that picks the victim among the ready workers)."""
    rng = random.Random(seed)
    at = rng.uniform(*shape.first_kill_s)
    out = []
    for _ in range(shape.kills):
        out.append((at, rng.randrange(1 << 30)))
        at += rng.uniform(*shape.kill_gap_s)
    return out


async def under_kills(url: str, model: Path, tmp: Path, shape: Shape, policy: str, seed: int) -> dict[str, Any]:
    namespace = "rsk" + uuid.uuid4().hex[:8]
    args = ["--capacity", str(shape.capacity), "--max-batch", "32", "--ack-wait", str(KILL_ACK_WAIT_S)]
    fleet = Fleet(url, namespace, model, tmp, args)
    topology = TopologyConfig(ack_wait_s=KILL_ACK_WAIT_S)
    kills: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    ready_after: dict[str, float] = {}
    watchers: list[asyncio.Task[None]] = []
    async with await RolloutClient.connect(url, namespace=namespace, client_id="bench", topology=topology) as client:

        async def note_ready(wid: str, since: float) -> None:
            await wait_until(lambda: fleet.metrics_url(client, wid) is not None, timeout=600, what=f"{wid} ready")
            ready_after[wid] = round(time.perf_counter() - since, 3)

        try:
            for _ in range(shape.workers):
                fleet.start()
            fleet.add_spares(shape.kills)
            await fleet.wait_ready(client)
            await fleet.wait_spares_warm()
            t0 = time.perf_counter()
            handles = [
                await client.submit(
                    job_payload(i, shape.max_tokens),
                    min_version=0,
                    retry_policy=policy,  # type: ignore[arg-type]
                    timeout=600,
                )
                for i in range(shape.kill_jobs)
            ]
            gathered = asyncio.ensure_future(asyncio.gather(*(h.result(600) for h in handles)))
            for at, pick in kill_schedule(shape, seed):
                left = t0 + at - time.perf_counter()
                if left > 0:
                    await asyncio.wait([gathered], timeout=left)
                if gathered.done():
                    break
                ready = [(i, w) for i, w in enumerate(fleet.slots) if fleet.metrics_url(client, w) is not None]
                if not ready:  # (every slot's worker still starting)
                    states = {w: getattr(client.fleet.replica(w), "state", None) for w in fleet.slots}
                    skipped.append({"at_s": round(time.perf_counter() - t0, 3), "states": states})
                    print(f"kills, {policy}: no ready worker at {skipped[-1]['at_s']} s: {states}", flush=True)
                    continue
                slot, victim = ready[pick % len(ready)]
                status = client.fleet.replica(victim)
                counters, gap = await asyncio.to_thread(
                    scrape_then_kill, fleet.metrics_url(client, victim) or "", fleet.procs[victim]
                )
                killed_at = time.perf_counter()
                replacement = fleet.replace(slot)
                watchers.append(asyncio.create_task(note_ready(replacement, killed_at)))
                kills.append(
                    {
                        "victim": victim,
                        "at_s": round(killed_at - t0, 3),
                        "in_flight_seen": status.in_flight if status else None,
                        "scrape_to_kill_ms": round(gap * 1000, 2),
                        "replacement": replacement,
                        "counters": counters,
                    }
                )
                print(f"kills, {policy}: killed {victim} at {kills[-1]['at_s']} s", flush=True)
            results: list[RolloutResult] = await gathered
            wall = time.perf_counter() - t0
            check(results, shape.max_tokens, f"kills/{policy}")
            rest = await fleet.scrape_all(client)
        finally:
            for task in watchers:
                task.cancel()
            fleet.close()
    total = dict.fromkeys(COUNTERS, 0.0)
    for kill in kills:
        total = add(total, kill["counters"])
        kill["generated"] = kill["counters"][GENERATED]
        kill["kept"] = kept_by(results, kill["victim"])
        kill["replacement_ready_s"] = ready_after.get(kill["replacement"])
    for counters in rest.values():
        total = add(total, counters)
    return {
        "wall_s": wall,
        "kills": kills,
        "skipped": skipped,
        "total": total,
        "resumes": sum(r.resumes for r in results),
        "kept_tokens": sum(r.kept_tokens for r in results),
        "delivery_attempt_max": max(r.delivery_attempt for r in results),
    }


# -- the rows ------------------------------------------------------------------------------------


async def run_async(shape: Shape) -> list[Row]:
    tmp = Path(tempfile.mkdtemp(prefix="rf-bench-resume-"))
    try:
        model = build_model_dir(tmp / "tiny", preset="tiny", seed=1)
        with temp_broker("rf-bench-resume-") as broker:
            print("resume: no kills", flush=True)
            steady_rounds = await steady(broker.url, model, tmp, shape)
            print("resume: kills, resume", flush=True)
            kr = await under_kills(broker.url, model, tmp, shape, "resume", SEED)
            print("resume: kills, replayable", flush=True)
            kp = await under_kills(broker.url, model, tmp, shape, "replayable", SEED)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows(shape, steady_rounds, kr, kp)


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def rows(shape: Shape, rounds: list[dict[str, Any]], kr: dict[str, Any], kp: dict[str, Any]) -> list[Row]:
    def of(policy: str) -> list[dict[str, Any]]:
        return [r for r in rounds if r["policy"] == policy]

    useful = shape.jobs * shape.max_tokens
    tput = {p: len(of(p)) * useful / sum(r["wall_s"] for r in of(p)) for p in ("resume", "replayable")}
    cpu_per_k = {p: 1000 * sum(r["worker_cpu_s"] for r in of(p)) / (len(of(p)) * useful) for p in tput}
    ratio = tput["resume"] / tput["replayable"]
    pair_ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(of("resume"), of("replayable"), strict=True)]
    res = of("resume")
    per_job = shape.jobs * len(res)
    ckpt_bytes = sum(r[CHECKPOINT_BYTES] for r in res) / per_job
    result_bytes = statistics.mean(r["result_bytes"] for r in res)
    mixed = [r["latency_s"] for r in rounds if r["policy"] == "mixed"]
    lat = {p: statistics.mean(x for r in mixed for x in r[p]) for p in ("resume", "replayable")}
    out = [
        Row(
            "resume/no-kill-mixed",
            f"{shape.jobs} jobs x {shape.max_tokens} tok, half each policy, {shape.workers} w",
            "s/job",
            lat["resume"],
            lat["replayable"],
            BASELINE,
            target=f"<= {1 / TARGET_COST:.4f}x baseline",
            met=lat["resume"] <= lat["replayable"] / TARGET_COST,
            higher_is_better=False,
            extra={
                "rounds": len(mixed),
                "per_round_ratio": [
                    round(statistics.mean(r["resume"]) / statistics.mean(r["replayable"]), 4) for r in mixed
                ],
            },
        ),
        Row(
            "resume/no-kill",
            f"{shape.jobs} jobs x {shape.max_tokens} tok, {shape.workers} w",
            "tokens/s",
            tput["resume"],
            tput["replayable"],
            BASELINE,
            target=f">= {TARGET_COST}x baseline",
            met=ratio >= TARGET_COST,
            extra={
                "workers": shape.workers,
                "capacity": shape.capacity,
                "checkpoint_tokens": 64,
                "checkpoint_s": 2.0,
                "threads_per_worker": 1,
                "rounds_per_policy": shape.pairs,
                "pair_ratio_median": statistics.median(pair_ratios),
                "pair_ratios": [round(r, 4) for r in pair_ratios],  # (resume / replayable, in run order)
                "worker_cpu_ms_per_1k_tokens": {p: round(v * 1000, 3) for p, v in cpu_per_k.items()},
                "rounds": [_rounded(r) for r in rounds],
            }
            | machine_load(),
        ),
        Row(
            "resume/checkpoint-bytes",
            "per job, no kills",
            "bytes/job",
            ckpt_bytes,
            result_bytes,
            "result size",
            higher_is_better=False,
            extra={
                "checkpoints_per_job": sum(r[CHECKPOINTS] for r in res) / per_job,
                "tokens_checkpointed_per_job": sum(r[CHECKPOINTED] for r in res) / per_job,
                "bytes_per_token": ckpt_bytes / shape.max_tokens,
            },
        ),
    ]
    generated = sum(k["generated"] for k in kr["kills"])
    kept = sum(k["kept"] for k in kr["kills"])
    kept_fraction = kept / generated if generated else 0.0
    kill_case = f"{shape.kill_jobs} jobs, {len(kr['kills'])} SIGKILLs"
    per_kill = [
        {k: v for k, v in kill.items() if k != "counters"}
        | {"fraction": round(kill["kept"] / kill["generated"], 4) if kill["generated"] else None}
        for kill in kr["kills"]
    ]
    out.append(
        Row(
            "resume/kept-fraction",
            kill_case,
            "fraction",
            kept_fraction,
            target=f">= {TARGET_KEPT}",
            met=kept_fraction >= TARGET_KEPT if generated else None,
            extra={"generated_before_kills": generated, "kept": kept, "kills": per_kill, "ack_wait_s": KILL_ACK_WAIT_S},
        )
    )
    useful_k = shape.kill_jobs * shape.max_tokens
    out.append(
        Row(
            "resume/generated-per-useful",
            kill_case,
            "tokens/token",
            kr["total"][GENERATED] / useful_k,
            higher_is_better=False,
            extra={
                "generated": kr["total"][GENERATED],
                "useful": useful_k,
                "kept_tokens": kr["kept_tokens"],
                "resumes": kr["resumes"],
                "resumed_jobs_counter": kr["total"][RESUMED],
                "note": "replayable not measured: rollfleet_resumable_tokens_generated_total counts resumable "
                "jobs only; replayable's cost under the same kills is its wall time (resume/kills-wall)",
            },
        )
    )
    out.append(
        Row(
            "resume/kills-wall",
            f"{shape.kill_jobs} jobs, same kill schedule",
            "s",
            kr["wall_s"],
            kp["wall_s"],
            BASELINE,
            higher_is_better=False,
            extra={
                "kills_resume": [(k["at_s"], k["victim"]) for k in kr["kills"]],
                "kills_replayable": [(k["at_s"], k["victim"]) for k in kp["kills"]],
                "kills_skipped_resume": kr["skipped"],
                "kills_skipped_replayable": kp["skipped"],
                "replacement_ready_s_resume": [k["replacement_ready_s"] for k in kr["kills"]],
                "replacement_ready_s_replayable": [k["replacement_ready_s"] for k in kp["kills"]],
                "delivery_attempt_max_resume": kr["delivery_attempt_max"],
                "delivery_attempt_max_replayable": kp["delivery_attempt_max"],
                "ack_wait_s": KILL_ACK_WAIT_S,
                "seed": SEED,
            },
        )
    )
    print(f"no kills: resume/replayable throughput {ratio!r} (target >= {TARGET_COST})", flush=True)
    print(f"no kills: worker CPU s per 1k tokens {cpu_per_k!r}", flush=True)
    print(f"kills: kept {kept} of {generated} tokens generated before the kills: {kept_fraction!r}", flush=True)
    return out


def run(quick: bool) -> list[Row]:
    return asyncio.run(run_async(QUICK if quick else FULL))


if __name__ == "__main__":
    if sys.argv[1:2] == ["spare"]:
        sys.exit(spare_main(Path(sys.argv[2])))
    for row in run(quick="--quick" in sys.argv):
        print(row.line())
