"""Request path: jobs/s and submit-to-result latency through rollfleet (echo engine, 2 workers, one
client) against a minimal hand-written nats-py JetStream loop doing the same broker operations.

Both systems run on the same broker in the same run, with the same process layout (the client in
this process; 2 workers as child processes, or as tasks in this process for the ``inproc`` rows)
and the same message sizes:

- rollfleet: ``RolloutClient.submit`` (fleet check, JetStream publish with ack; no bell, the
  subject is in the workers' window) -> the job is delivered to a pull request a worker keeps
  waiting (or to a top-up when its deliveries say more is queued); the worker decodes and checks
  the job, runs the echo engine, publishes the result (JetStream, with ack) and acks the job ->
  the client's results consumer receives it.
- baseline: the client publishes an opaque job of the same size (JetStream, with ack, Nats-Msg-Id)
  to a work-queue stream; each worker keeps one pull request outstanding per free slot on a
  shared durable consumer, publishes an opaque result of the same size (JetStream, with ack) and
  acks the job; the client receives results through a streaming pull on its results consumer.

Measured: throughput with many jobs in flight (a window), the CPU each process spent per job
meanwhile (client, both workers, broker: from /proc), and p50/p99 latency with exactly one job in
flight (sequential jobs). Interleaved rounds, medians. Targets (issue 14), judged on the unrounded
ratios: >= 0.9x the baseline's jobs/s, CPU per job (all processes) <= 1.3x, p50 <= 1.3x.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig

from benchmarks._fleet import REPO, PullStream, baseline_worker, machine_load, percentile
from benchmarks.report import Row
from harness import check_alive, cpu_seconds, spawn, stop_all, temp_broker, wait_until, worker_command
from rollfleet.cli.event_loop import EVENT_LOOP_ENV
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Completion,
    RolloutJob,
    RolloutPayload,
    RolloutResult,
    SamplingParams,
    VersionConstraint,
    encode,
)
from rollfleet.trainer_client import RolloutClient
from rollfleet.trainer_client.requests import build_job
from rollfleet.workers.engines.echo import EchoEngine
from rollfleet.workers.worker import Worker, WorkerConfig

WORKERS = 2
CAPACITY = 16  # jobs per worker at once, the same for both systems
PROMPT_TOKENS, MAX_TOKENS = 32, 16
PAYLOAD = RolloutPayload(prompt_token_ids=list(range(PROMPT_TOKENS)), sampling=SamplingParams(max_tokens=MAX_TOKENS))
BASELINE = "minimal nats-py loop"
ASYNCIO_WORKERS = "rollfleet, workers on asyncio's loop"

JobFn = Callable[[], Awaitable[None]]


def sample_job(job_id: str | None = None) -> tuple[RolloutJob, bytes]:
    """A job as ``RolloutClient.submit`` builds it for this benchmark's payload, and its wire bytes."""
    return build_job(
        PAYLOAD,
        client_id="bench",
        constraint=VersionConstraint("min", 0),
        written="min:0",
        idempotency_key=None,
        deadline=None,
        timeout=None,
        default_timeout_s=600.0,
        retry_policy="replayable",
        session_id=None,
        trainer_version=0,
        limits=DEFAULT_LIMITS,
        max_timeout_s=None,
        job_id=job_id or uuid.uuid4().hex,
    )


def echo_result(job: RolloutJob, outputs: list[Completion], finished_at: float) -> RolloutResult:
    """The answer a worker labels for ``job`` (the fields ``JobRunner`` fills for an echo run)."""
    return RolloutResult(
        job_id=job.job_id,
        idempotency_key=job.idempotency_key,
        client_id=job.client_id,
        outputs=outputs,
        version_start=0,
        version_end=0,
        worker_id="echo-0",
        engine="echo",
        queue_wait_s=0.001,
        generation_s=0.0001,
        delivery_attempt=1,
        finished_at=finished_at,
        prompt_tokens=PROMPT_TOKENS,
        fingerprint=job.fingerprint,
        constraint=job.constraint,
    )


def message_sizes() -> tuple[int, int]:
    """Encoded sizes of a rollfleet job and its echo result as they travel: the baseline sends
    opaque bytes of these sizes."""
    job, data = sample_job()
    # The echo engine's own outputs (generated on a loop of their own: this may run inside one).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        generation = pool.submit(asyncio.run, EchoEngine().generate(job.job_id, job.payload)).result()
    return len(data), len(encode(echo_result(job, generation.outputs, time.time())))


# -- measuring any system --------------------------------------------------------------------


async def throughput(job: JobFn, n: int, window: int) -> dict[str, float]:
    """``n`` jobs with up to ``window`` in flight: jobs/s, and the latency each saw under that load."""
    sem = asyncio.Semaphore(window)
    lat: list[float] = []

    async def one() -> None:
        t0 = time.perf_counter()
        try:
            await job()
            lat.append(time.perf_counter() - t0)
        finally:
            sem.release()

    tasks = []
    t0 = time.perf_counter()
    for _ in range(n):
        await sem.acquire()
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - t0
    return {"jobs_s": n / seconds, "seconds": seconds, "loaded_p50_ms": percentile(lat, 50) * 1e3}


async def latency(job: JobFn, n: int) -> dict[str, float]:
    """Exactly one job in flight, ``n`` times: submit-to-result p50/p99."""
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await job()
        lat.append(time.perf_counter() - t0)
    return {
        "p50_ms": percentile(lat, 50) * 1e3,
        "p99_ms": percentile(lat, 99) * 1e3,
        "mean_ms": sum(lat) / len(lat) * 1e3,
    }


# -- rollfleet ---------------------------------------------------------------------------------


class RollfleetSystem:
    def __init__(
        self,
        url: str,
        layout: str,
        tmp: Path,
        *,
        worker_log_level: str | None = None,
        event_loop: str | None = None,
        wrap: Callable[[list[str]], list[str]] = list,
    ) -> None:
        self.url, self.layout, self.tmp = url, layout, tmp
        self.wrap = wrap  # a worker's command line as run (a diagnostic may run it under a counter)
        self.env = {"ROLLFLEET_LOG_LEVEL": worker_log_level} if worker_log_level else {}
        if event_loop is not None:  # (the worker processes' loop; unset: the CLI's default)
            self.env[EVENT_LOOP_ENV] = event_loop
        self.namespace = "rp" + uuid.uuid4().hex[:8]
        self.procs: list[Any] = []
        self.workers: list[Worker] = []
        self.client: RolloutClient | None = None

    async def start(self) -> None:
        if self.layout == "proc":
            for i in range(WORKERS):
                args = ("--engine", "echo", "--capacity", str(CAPACITY))
                cmd = self.wrap(worker_command(self.url, self.namespace, f"echo-{i}", *args))
                self.procs.append(spawn(cmd, self.tmp / f"{self.namespace}-echo-{i}.log", env=self.env, cwd=REPO))
        else:
            for i in range(WORKERS):
                config = WorkerConfig(self.url, self.namespace, worker_id=f"echo-{i}", capacity=CAPACITY)
                worker = Worker(config, EchoEngine())
                await worker.start()
                self.workers.append(worker)
        self.client = await RolloutClient.connect(self.url, namespace=self.namespace, client_id="bench")
        client = self.client

        def ready() -> bool:
            check_alive(self.procs, "rollfleet worker")
            return sum(r.state == "ready" for r in client.fleet.replicas()) >= WORKERS

        await wait_until(ready, 60, what="rollfleet workers ready")

    async def job(self) -> None:
        assert self.client is not None
        handle = await self.client.submit(PAYLOAD, min_version=0)
        await handle

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        for worker in self.workers:
            await worker.stop()
        stop_all(self.procs)


# -- the baseline ------------------------------------------------------------------------------


class BaselineSystem:
    def __init__(
        self,
        url: str,
        layout: str,
        tmp: Path,
        job_bytes: int,
        result_bytes: int,
        wrap: Callable[[list[str]], list[str]] = list,
    ) -> None:
        self.url, self.layout, self.tmp = url, layout, tmp
        self.wrap = wrap
        self.job_bytes, self.result_bytes = job_bytes, result_bytes
        ns = "bl" + uuid.uuid4().hex[:8]
        self.jobs_stream, self.results_stream = f"{ns.upper()}_JOBS", f"{ns.upper()}_RESULTS"
        self.jobs_subject, self.results_prefix = f"{ns}.jobs", f"{ns}.results"
        self.client_id = "bench"
        self.procs: list[Any] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[int]] = []
        self.pending: dict[str, asyncio.Future[bytes]] = {}
        self.received = 0

    async def start(self) -> None:
        self.nc = await nats.connect(self.url, name="baseline-client")
        self.js = self.nc.jetstream()
        # The same stream kinds and consumer settings rollfleet declares (file storage, dedup window).
        await self.js.add_stream(
            StreamConfig(
                name=self.jobs_stream,
                subjects=[self.jobs_subject],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                duplicate_window=600.0,
            )
        )
        await self.js.add_stream(
            StreamConfig(
                name=self.results_stream,
                subjects=[f"{self.results_prefix}.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                duplicate_window=600.0,
                max_age=3600.0,
            )
        )
        await self.js.add_consumer(
            self.jobs_stream,
            ConsumerConfig(
                durable_name="workers",
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=30.0,
                max_ack_pending=4096,
                max_waiting=4096,
            ),
        )
        await self.js.add_consumer(
            self.results_stream,
            ConsumerConfig(
                durable_name=self.client_id,
                filter_subject=f"{self.results_prefix}.{self.client_id}.>",
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                max_ack_pending=65_536,
            ),
        )

        async def on_result(msg: Msg) -> None:
            future = self.pending.pop((msg.headers or {}).get("Nats-Msg-Id", ""), None)
            if future is not None and not future.done():
                future.set_result(msg.data)
            await msg.ack()
            self.received += 1
            if self.received % 128 == 0:
                await self.results.want(128)

        self.results = await PullStream(self.nc, self.results_stream, self.client_id, on_result).start()
        await self.results.want(256)
        args = (self.url, self.jobs_stream, "workers", CAPACITY, self.result_bytes, self.results_prefix)
        if self.layout == "proc":
            for i in range(WORKERS):
                cmd = [sys.executable, "-m", "benchmarks._fleet", "baseline-worker", "--nats", self.url]
                cmd += ["--stream", args[1], "--consumer", args[2], "--capacity", str(CAPACITY)]
                cmd += ["--result-bytes", str(self.result_bytes), "--results-prefix", self.results_prefix]
                self.procs.append(spawn(self.wrap(cmd), self.tmp / f"baseline-{i}.log", cwd=REPO))
        else:
            self.tasks = [asyncio.create_task(baseline_worker(*args, self.stop)) for _ in range(WORKERS)]
        self.body = os.urandom(self.job_bytes)
        deadline = time.monotonic() + 60
        while (await self.js.consumer_info(self.jobs_stream, "workers")).num_waiting < WORKERS:
            check_alive(self.procs, "baseline worker")
            if time.monotonic() > deadline:
                raise TimeoutError("baseline workers did not start")
            await asyncio.sleep(0.05)

    async def job(self) -> None:
        key = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        headers = {"Nats-Msg-Id": key, "Client-Id": self.client_id, "Job-Id": key}
        await self.js.publish(self.jobs_subject, self.body, headers=headers, timeout=10.0)
        await future

    async def close(self) -> None:
        self.stop.set()
        if self.tasks:
            await asyncio.gather(*self.tasks)
        stop_all(self.procs)
        await self.results.close()
        await self.nc.close()


# -- the run -----------------------------------------------------------------------------------


def cpu_snapshot(broker_pid: int, workers: list[int]) -> dict[str, float]:
    return {
        "client": cpu_seconds(),  # in the inproc layout: client and workers together
        "workers": sum(cpu_seconds(pid) for pid in workers),
        "broker": cpu_seconds(broker_pid),
    }


async def measure(system: Any, n_tput: int, window: int, n_seq: int, broker_pid: int) -> dict[str, float]:
    await system.start()
    try:
        await throughput(system.job, max(50, n_tput // 10), window)  # warm-up: connections, consumers, caches
        pids = [p.pid for p in system.procs]
        before = cpu_snapshot(broker_pid, pids)
        out = await throughput(system.job, n_tput, window)
        after = cpu_snapshot(broker_pid, pids)
        # Where the CPU goes under load (2 cores shared by all of them): ms of CPU per job.
        out |= {f"cpu_ms_per_job_{k}": (after[k] - before[k]) / n_tput * 1e3 for k in before}
        if n_seq:
            out |= await latency(system.job, n_seq)
    finally:
        await system.close()
    return out


def _median_of(trials: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(t[k] for t in trials) for k in trials[0]}


async def run_async(
    quick: bool, layouts: tuple[str, ...], rounds: int, ablation_layouts: tuple[str, ...] = ()
) -> list[Row]:
    n_tput, window, n_seq = (300, 64, 40) if quick else (4000, 256, 1000)
    job_bytes, result_bytes = message_sizes()
    rows: list[Row] = []
    with temp_broker("rf-bench-rp-") as broker, tempfile.TemporaryDirectory(prefix="rf-bench-rp-logs-") as logs:
        tmp = Path(logs)
        assert broker.proc is not None
        pid = broker.proc.pid
        for layout in layouts:
            ablations = layout in ablation_layouts
            load = machine_load()
            factories: dict[str, Callable[[], Any]] = {
                "baseline": functools.partial(BaselineSystem, broker.url, layout, tmp, job_bytes, result_bytes),
                "rollfleet": functools.partial(RollfleetSystem, broker.url, layout, tmp),
            }
            if layout == "proc":
                # The worker processes on asyncio's own loop, against the default (uvloop where
                # installed): the loop's share of the request path, same run, same baseline.
                factories[ASYNCIO_WORKERS] = functools.partial(
                    RollfleetSystem, broker.url, layout, tmp, event_loop="asyncio"
                )
            if ablations:
                # Diagnostic: what per-job debug logging in the workers would cost.
                factories["ablation: worker log level debug"] = functools.partial(
                    RollfleetSystem, broker.url, layout, tmp, worker_log_level="debug"
                )
            # Interleaved rounds, medians: the machine's load drifts (2 cores shared with other work).
            trials: dict[str, list[dict[str, float]]] = {name: [] for name in factories}
            for _ in range(rounds):
                for name, make in factories.items():
                    seq = 0 if name.startswith("ablation") else n_seq // rounds
                    trials[name].append(await measure(make(), n_tput, window, seq, pid))
            trials_base = trials.pop("baseline")
            base = _median_of(trials_base)
            common = {
                "workers": WORKERS,
                "capacity": CAPACITY,
                "layout": "worker processes" if layout == "proc" else "workers in the client's event loop",
                "job_bytes": job_bytes,
                "result_bytes": result_bytes,
                "rounds": rounds,
                "loadavg_1m_after": machine_load()["loadavg_1m"],
            } | load
            for name, runs in trials.items():
                m = _median_of(runs)
                case = f"{name} {layout}"
                diagnostic = name.startswith("ablation")
                judged = name == "rollfleet"  # (a variant's rows are for comparing, not judged)
                cpu = {k: v for k, v in m.items() if k.startswith("cpu_ms")}
                cpu |= {"baseline_" + k: v for k, v in base.items() if k.startswith("cpu_ms")}
                rows.append(
                    Row(
                        "request_path/throughput",
                        f"{case} window={window}",
                        "jobs/s",
                        m["jobs_s"],
                        base["jobs_s"],
                        BASELINE,
                        target=">= 0.9x baseline" if judged else "",
                        met=m["jobs_s"] / base["jobs_s"] >= 0.9 if judged else None,
                        extra=common
                        | {
                            "jobs": n_tput,
                            "loaded_p50_ms": m["loaded_p50_ms"],
                            "baseline_loaded_p50_ms": base["loaded_p50_ms"],
                            "jobs_s_each_round": [r["jobs_s"] for r in runs],
                            "baseline_jobs_s_each_round": [r["jobs_s"] for r in trials_base],
                        }
                        | cpu,
                    )
                )
                if diagnostic:
                    continue  # a throughput diagnostic only
                total, base_total = (sum(v for k, v in r.items() if k.startswith("cpu_ms")) for r in (m, base))
                rows.append(
                    Row(
                        "request_path/cpu",
                        f"{case} window={window}",
                        "CPU ms/job",
                        total,
                        base_total,
                        BASELINE,
                        higher_is_better=False,
                        target="<= 1.3x baseline" if judged else "",
                        met=total / base_total <= 1.3 if judged else None,
                        extra=common | cpu,
                    )
                )
                for q in ("p50", "p99"):
                    ratio = m[f"{q}_ms"] / base[f"{q}_ms"]
                    rows.append(
                        Row(
                            "request_path/latency",
                            f"{case} 1 in flight",
                            f"{q} ms",
                            m[f"{q}_ms"],
                            base[f"{q}_ms"],
                            BASELINE,
                            higher_is_better=False,
                            target="<= 1.3x baseline" if q == "p50" and judged else "",
                            met=ratio <= 1.3 if q == "p50" and judged else None,
                            extra=common | {"jobs": n_seq, "mean_ms": m["mean_ms"]},
                        )
                    )
    return rows


def run(quick: bool) -> list[Row]:
    layouts = ("proc",) if quick else ("proc", "inproc")
    ablation_layouts = () if quick else ("proc",)
    return asyncio.run(run_async(quick, layouts, 1 if quick else 5, ablation_layouts))


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row.line())
