"""Fleet size: what a replica costs the broker idle, the request path at a fixed offered load,
and how fast a commit reaches every replica, for 16, 128 and 1,000 replicas on one broker; and
the same load through the 3-node R3 cluster of ``broker_config/cluster/``, with its stream
leader's node killed.

Replicas are virtual (``benchmarks._replicas``): up to 250 real ``Worker`` instances per
process, echo engine, each with its own connection, registry entry, heartbeat, pull requests,
bell subscription and version following, exactly as ``rollfleet worker --engine echo
--follow-versions``. One trainer (``RolloutClient``, with its fleet view) runs in this process.

Measured from the broker's own counters (the monitoring endpoint, ``-m``): ``/varz`` in_msgs and
out_msgs, ``/jsz`` api.total, and the broker process's CPU time (``/proc``):

- idle: after the fleet is up and has followed two commits, a window of ``IDLE_S`` (two full
  cycles of the longest periodic renewal, the 120 s pull expiry) with nothing submitted;
- load: ``OFFERED`` jobs/s in ``BURSTS`` bursts of ``LOAD_S`` (latency: the median over the bursts of
  each burst's percentile), ``min_version`` cycling over the last three versions
  (the fleet serves the newest, so one of the three subjects is every replica's own, two need
  a wake-up), echo latency ``ECHO_S`` per job, capacity 4 per replica: jobs/s completed,
  submit-to-result p50/p99, broker messages (in + out) per job;
- convergence: a commit (no materialization: the echo engine) until the trainer's fleet view
  shows every replica at the new version (``wait_for_version``), and until the last replica's
  own activation time (``versions.activated``).

Targets (issue 14): idle at most 0.2 messages/s per replica and no JetStream API request;
idle broker CPU under 5 % of a core at 1,000 replicas; p99 at 1,000 replicas within 2x of p99
at 16; convergence under 2 s at 1,000. Every target is judged on the unrounded value.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._fleet import REPO, machine_load, percentile
from benchmarks.report import Row
from harness import (
    CLUSTER_PORTS,
    BrokerCounters,
    ProcessGroup,
    cpu_seconds,
    kill_stream_leader,
    start_cluster,
    wait_failover,
    wait_until,
)
from rollfleet.broker import EmbeddedBroker, free_port
from rollfleet.broker.topology import TopologyConfig
from rollfleet.schemas import RolloutPayload, SamplingParams, VersionActivated, VersionRecord, decode
from rollfleet.trainer_client import RolloutClient

SIZES, QUICK_SIZES = (16, 128, 1000), (4, 8)
CLUSTER_SIZE, QUICK_CLUSTER_SIZE = 128, 4
PER_HOST = 250  # virtual replicas per process
CAPACITY = 4
ECHO_S = 0.02
VERSIONS = 3  # the fleet is at version 2; jobs ask for min 0, 1 or 2
IDLE_S, QUICK_IDLE_S = 240.0, 6.0
LOAD_S, QUICK_LOAD_S = 20.0, 3.0
BURSTS, QUICK_BURSTS = 3, 1
OFFERED, QUICK_OFFERED = 300.0, 60.0
PAYLOAD = RolloutPayload(prompt_token_ids=list(range(32)), sampling=SamplingParams(max_tokens=16))
BROKER_CONFIG = REPO / "broker_config"
# A job in flight to a worker through the killed node is lost with it and redelivered after
# ack_wait; the cluster runs use a short one (as the reliability suite does), so the stall
# measures the fail-over rather than the 30 s default.
CLUSTER_ACK_WAIT_S = 5.0


def say(text: str) -> None:
    print(f"  [scale] {text}", file=sys.stderr, flush=True)


# -- a fleet of virtual replicas ------------------------------------------------------------------


@dataclass
class Fleet:
    url: str
    namespace: str
    size: int
    workdir: Path
    replicas: int = 1  # stream replicas
    ack_wait_s: float = 30.0
    procs: ProcessGroup = field(init=False)

    def __post_init__(self) -> None:
        self.procs = ProcessGroup(self.workdir, cwd=REPO)

    def start(self) -> None:
        for h, first in enumerate(range(0, self.size, PER_HOST)):
            count = min(PER_HOST, self.size - first)
            args = ["--nats", self.url, "--namespace", self.namespace, "--prefix", f"h{h}", "--count", str(count)]
            args += ["--capacity", str(CAPACITY), "--echo-latency", str(ECHO_S), "--replicas", str(self.replicas)]
            args += ["--ack-wait", str(self.ack_wait_s)]
            self.procs.module(f"host{h}", "benchmarks._replicas", *args, env={"ROLLFLEET_LOG_LEVEL": "warning"})

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.procs.values()]

    def check(self) -> None:
        dead = [n for n, p in self.procs.procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"replica hosts exited: {dead}: {self.procs.tail(dead[0])}")

    def stop(self) -> None:
        self.procs.close()


async def wait_ready(client: RolloutClient, fleet: Fleet, timeout: float = 900.0) -> float:
    t0 = time.monotonic()
    last = -1

    def ready() -> bool:
        nonlocal last
        fleet.check()
        n = sum(r.state == "ready" for r in client.fleet.replicas())
        if n // 100 != last // 100:
            say(f"{n}/{fleet.size} replicas ready")
        last = n
        return n >= fleet.size

    await wait_until(ready, timeout, what=f"{fleet.size} replicas ready", interval=0.5)
    return time.monotonic() - t0


# -- the three measurements ----------------------------------------------------------------------


async def commit(client: RolloutClient, version: int, size: int, activations: dict[tuple[str, int], float]) -> dict:
    """Commit ``version`` (nothing to materialize) and time it until every replica reports it."""
    record = VersionRecord(version=version, kind="delta", base_version=version - 1, created_at=time.time())
    t0 = time.time()
    await client.commit_version(record)
    committed = time.time() - t0
    await client.wait_for_version(version, replicas=size, timeout=120)
    seen = time.time() - t0
    await wait_until(
        lambda: sum(1 for (_, v) in activations if v == version) >= size, 30, what="activation announcements"
    )
    last = max(at for (_, v), at in activations.items() if v == version)
    return {"registry_s": seen, "activated_s": last - t0, "commit_call_s": committed}


async def idle(monitor: BrokerCounters, fleet: Fleet, seconds: float) -> dict[str, float]:
    say(f"idle window {seconds:.0f}s")
    a = monitor.snapshot()
    hosts0 = sum(cpu_seconds(pid) for pid in fleet.pids())
    await asyncio.sleep(seconds)
    fleet.check()
    d = monitor.snapshot() - a
    hosts = sum(cpu_seconds(pid) for pid in fleet.pids()) - hosts0
    dt = d.t
    return {
        "in_per_s": d.in_msgs / dt,
        "out_per_s": d.out_msgs / dt,
        "msgs_per_s_per_replica": (d.in_msgs + d.out_msgs) / dt / fleet.size,
        "api_per_s": d.api / dt,
        "broker_cpu_pct": 100 * d.cpu_s / dt,
        "replica_hosts_cpu_pct": 100 * hosts / dt,
        "window_s": dt,
    }


@dataclass
class Load:
    latencies: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each result
    errors: dict[str, int] = field(default_factory=dict)
    submitted: int = 0
    lost: int = 0
    redelivered: int = 0  # answered on a second or later delivery (the first was lost with a node)
    queue_waits: list[float] = field(default_factory=list)  # stored -> generation start, per result
    deliveries: list[float] = field(default_factory=list)  # generation end -> the trainer has it
    slowest: list[dict[str, Any]] = field(default_factory=list)  # what held up the slowest jobs


async def offer(client: RolloutClient, rate: float, seconds: float, latest: int, *, timeout: float = 60.0) -> Load:
    """Open loop: ``rate`` jobs/s, min_version cycling over the last three versions. A submit the
    broker did not take (an outage) is retried with the same key, as a trainer would."""
    load = Load()
    n = int(rate * seconds)
    tasks: list[asyncio.Task[None]] = []
    prefix = uuid.uuid4().hex[:6]

    async def one(i: int) -> None:
        key = f"{prefix}-{i}"
        t0, t_submit = time.perf_counter(), time.monotonic()
        deadline = time.monotonic() + timeout
        while True:
            try:
                handle = await client.submit(PAYLOAD, min_version=latest - i % 3, idempotency_key=key, timeout=timeout)
                result = await asyncio.wait_for(handle.result(), max(0.1, deadline - time.monotonic()))
                load.redelivered += result.delivery_attempt > 1
                load.queue_waits.append(result.queue_wait_s)
                load.deliveries.append(time.time() - result.finished_at)
                spent = time.perf_counter() - t0
                if spent > 5.0:
                    load.slowest.append(
                        {
                            "submitted_at": round(t_submit - t_offer, 3),
                            "latency_s": round(spent, 3),
                            "queue_wait_s": round(result.queue_wait_s, 3),
                            "delivery_attempt": result.delivery_attempt,
                            "result_delivery_s": round(load.deliveries[-1], 3),
                            "worker": result.worker_id,
                        }
                    )
                break
            except Exception as exc:
                name = type(exc).__name__
                load.errors[name] = load.errors.get(name, 0) + 1
                if time.monotonic() > deadline:
                    load.lost += 1
                    return
                await asyncio.sleep(0.2)
        load.latencies.append(time.perf_counter() - t0)
        load.arrivals.append(time.monotonic())

    t_offer = t0 = time.monotonic()
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
        load.submitted += 1
    await asyncio.gather(*tasks)
    return load


async def loaded(
    client: RolloutClient,
    monitor: BrokerCounters,
    rate: float,
    seconds: float,
    latest: int,
    hosts: list[int],
    bursts: int = 1,
) -> dict[str, Any]:
    """``bursts`` runs of ``seconds`` at ``rate``: latency percentiles are the median over the
    bursts (one burst slowed by the shared machine does not make the figure), counts are totals."""
    say(f"load {rate:.0f} jobs/s, {bursts} x {seconds:.0f}s")
    a = monitor.snapshot()
    cpu0 = (cpu_seconds(), sum(cpu_seconds(pid) for pid in hosts))
    runs: list[tuple[Load, float]] = []
    for _ in range(bursts):
        t0 = time.monotonic()
        load = await offer(client, rate, seconds, latest)
        runs.append((load, (max(load.arrivals) - t0) if load.arrivals else math.inf))
    cpu1 = (cpu_seconds(), sum(cpu_seconds(pid) for pid in hosts))
    d = monitor.snapshot() - a
    done = sum(len(load.latencies) for load, _ in runs)

    def median_of(values: Any, q: float) -> float:
        return statistics.median(percentile(list(v), q) * 1e3 for v in values)

    return {
        "jobs_s": statistics.median(len(load.latencies) / span for load, span in runs),
        "jobs": done,
        "bursts": bursts,
        "p50_ms": median_of((load.latencies for load, _ in runs), 50),
        "p99_ms": median_of((load.latencies for load, _ in runs), 99),
        "p99_ms_each_burst": [percentile(load.latencies, 99) * 1e3 for load, _ in runs],
        "queue_wait_p99_ms": median_of((load.queue_waits for load, _ in runs), 99),
        "result_delivery_p99_ms": median_of((load.deliveries for load, _ in runs), 99),
        "msgs_per_job": (d.in_msgs + d.out_msgs) / max(done, 1),
        "in_per_job": d.in_msgs / max(done, 1),
        "out_per_job": d.out_msgs / max(done, 1),
        "api_per_s": d.api / d.t,
        "broker_cpu_pct": 100 * d.cpu_s / d.t,
        "trainer_cpu_pct": 100 * (cpu1[0] - cpu0[0]) / d.t,
        "replica_hosts_cpu_pct": 100 * (cpu1[1] - cpu0[1]) / d.t,
        "lost": sum(load.lost for load, _ in runs),
        "errors": {k: sum(load.errors.get(k, 0) for load, _ in runs) for k in {k for lo, _ in runs for k in lo.errors}},
    }


async def watch_activations(client: RolloutClient) -> dict[tuple[str, int], float]:
    seen: dict[tuple[str, int], float] = {}

    async def on(msg: Any) -> None:
        a = decode(msg.data, VersionActivated)
        seen[(a.worker_id, a.version)] = a.activated_at

    await client.nc.subscribe(client.names.versions_activated, cb=on)
    return seen


# -- one broker, one fleet size ------------------------------------------------------------------


async def measure_size(url: str, monitor: BrokerCounters, size: int, workdir: Path, quick: bool) -> dict[str, Any]:
    ns = f"sc{size}x{uuid.uuid4().hex[:6]}"
    out: dict[str, Any] = {"size": size}
    async with await RolloutClient.connect(url, namespace=ns, client_id="trainer") as client:
        fleet = Fleet(url, ns, size, workdir / ns)
        (workdir / ns).mkdir(parents=True, exist_ok=True)
        fleet.start()
        try:
            out["startup_s"] = await wait_ready(client, fleet)
            activations = await watch_activations(client)
            out["commits"] = [await commit(client, v, size, activations) for v in range(1, VERSIONS)]
            await asyncio.sleep(2.0 if quick else 10.0)  # the start-up burst settles
            out["idle"] = await idle(monitor, fleet, QUICK_IDLE_S if quick else IDLE_S)
            out["load"] = await loaded(
                client,
                monitor,
                QUICK_OFFERED if quick else OFFERED,
                QUICK_LOAD_S if quick else LOAD_S,
                VERSIONS - 1,
                fleet.pids(),
                QUICK_BURSTS if quick else BURSTS,
            )
            await asyncio.sleep(1.0)
            out["commits"].append(await commit(client, VERSIONS, size, activations))
            say(f"N={size}: {json.dumps(out, default=str)[:600]}")
        finally:
            fleet.stop()
    return out


# -- the 3-node cluster ---------------------------------------------------------------------------


async def measure_cluster(size: int, workdir: Path, quick: bool) -> dict[str, Any]:
    """The same load through the R3 cluster; then again with the jobs stream leader's node killed."""
    cluster = start_cluster(workdir, BROKER_CONFIG / "cluster")
    out: dict[str, Any] = {"size": size}
    try:
        nodes = {n: (cluster.port_map[CLUSTER_PORTS[n]["http"]], p.proc.pid) for n, p in cluster.nodes.items()}  # type: ignore[union-attr]
        monitor = BrokerCounters(list(nodes.values()))
        ns = f"cl{size}x{uuid.uuid4().hex[:6]}"
        topo = TopologyConfig(replicas=3, ack_wait_s=CLUSTER_ACK_WAIT_S)

        async def connect() -> RolloutClient:
            return await RolloutClient.connect(cluster.url, namespace=ns, client_id="trainer", topology=topo)

        client = await wait_until(connect, 60, what="cluster JetStream", interval=0.5, retry_errors=True)
        async with client:
            fleet = Fleet(cluster.url, ns, size, workdir / ns, replicas=3, ack_wait_s=CLUSTER_ACK_WAIT_S)
            (workdir / ns).mkdir(parents=True, exist_ok=True)
            fleet.start()
            try:
                out["startup_s"] = await wait_ready(client, fleet)
                activations = await watch_activations(client)
                for v in range(1, VERSIONS):
                    await commit(client, v, size, activations)
                rate, seconds = (QUICK_OFFERED, QUICK_LOAD_S) if quick else (OFFERED, LOAD_S)
                bursts = QUICK_BURSTS if quick else BURSTS
                out["load"] = await loaded(client, monitor, rate, seconds, VERSIONS - 1, fleet.pids(), bursts)
                out["failover"] = await kill_leader(client, cluster, rate, seconds if not quick else 6.0)
            finally:
                fleet.stop()
    finally:
        cluster.stop()
    return out


async def kill_leader(client: RolloutClient, cluster: Any, rate: float, seconds: float) -> dict[str, Any]:
    names = client.names
    say(f"cluster: load {rate:.0f} jobs/s for {seconds:.0f}s, the jobs stream leader's node killed at 40%")
    probe: dict[str, Any] = {}

    async def chaos() -> None:
        await asyncio.sleep(seconds * 0.4)
        probe["killed"] = await kill_stream_leader(cluster, client.js, names.jobs_stream)
        probe["t_kill"] = time.monotonic()
        probe["failover_s"] = await wait_failover(
            client.js, names, probe["killed"], min_versions=range(VERSIONS), client_id="trainer", timeout=60.0
        )

    chaos_task = asyncio.create_task(chaos())
    t0 = time.monotonic()
    load = await offer(client, rate, seconds, VERSIONS - 1, timeout=90.0)
    await chaos_task
    t_kill = probe["t_kill"]
    arrivals = sorted(load.arrivals)
    # The stall as the reliability suite measures it: the longest gap in result deliveries from
    # the kill until fail-over + 10 s. Jobs that took longer (a delivery lost with the node and
    # redelivered after ack_wait, or a result whose store was retried) are reported apart.
    window_end = t_kill + probe["failover_s"] + 10.0
    after = [t for t in arrivals if t_kill <= t <= window_end]
    before = [t for t in arrivals if t_kill - 2.0 <= t < t_kill]
    stall = max((b - a for a, b in itertools.pairwise([t_kill, *after])), default=math.inf)
    info = await client.js.stream_info(names.results_stream, subjects_filter=names.results_filter("trainer"))
    duplicated = sum(count - 1 for count in (info.state.subjects or {}).values() if count > 1)
    return {
        "killed": probe["killed"],
        "failover_s": probe["failover_s"],
        "stall_s": stall,
        "normal_gap_s": max((b - a for a, b in itertools.pairwise(before)), default=0.0),
        "jobs": len(load.latencies),
        "jobs_s": len(load.latencies) / ((max(arrivals) - t0) if arrivals else math.inf),
        "p99_ms": percentile(load.latencies, 99) * 1e3 if load.latencies else math.inf,
        "lost": load.lost,
        "redelivered": load.redelivered,
        "duplicated": duplicated,
        "max_latency_s": max(load.latencies, default=math.inf),
        "slower_than_5s": sorted(load.slowest, key=lambda j: -j["latency_s"])[:10],
        "kill_at_s": round(t_kill - t0, 3),
        "errors": load.errors,
    }


# -- rows ------------------------------------------------------------------------------------------


def _judged(applies: bool, target: str, met: bool) -> dict[str, Any]:
    """A row's target and verdict, where the target applies (the largest fleet)."""
    return {"target": target, "met": met} if applies else {}


def rows_for(runs: list[dict[str, Any]], cluster: dict[str, Any] | None, common: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    smallest = runs[0]
    largest = max(r["size"] for r in runs)
    for run in runs:
        n, idle_, load, commits = run["size"], run["idle"], run["load"], run["commits"]
        top = n == largest
        case = f"N={n} one broker"
        extra = common | {"replicas": n, "startup_s": run["startup_s"]}
        per = idle_["msgs_per_s_per_replica"]
        rows += [
            Row("scale/idle", case, "msgs/s/replica", per, **_judged(True, "<= 0.2", per <= 0.2), extra=extra | idle_),
            Row("scale/idle", case, "API req/s", idle_["api_per_s"], **_judged(True, "0", idle_["api_per_s"] == 0)),
            Row(
                "scale/idle",
                case,
                "broker CPU %",
                idle_["broker_cpu_pct"],
                **_judged(top, f"< 5 % at N={largest}", idle_["broker_cpu_pct"] < 5.0),
            ),
            Row("scale/load", case, "jobs/s", load["jobs_s"], extra=extra | load),
            Row("scale/load", case, "p50 ms", load["p50_ms"], higher_is_better=False),
            Row(
                "scale/load",
                case,
                "p99 ms",
                load["p99_ms"],
                smallest["load"]["p99_ms"] if n != smallest["size"] else None,
                f"p99 at N={smallest['size']}",
                higher_is_better=False,
                **_judged(
                    top, f"<= 2x p99 at N={smallest['size']}", load["p99_ms"] <= 2.0 * smallest["load"]["p99_ms"]
                ),
            ),
            Row("scale/load", case, "broker msgs/job", load["msgs_per_job"], higher_is_better=False),
        ]
        worst = max(c["registry_s"] for c in commits)
        rows.append(
            Row(
                "scale/convergence",
                case,
                "s (slowest)",
                worst,
                higher_is_better=False,
                **_judged(top, f"< 2 s at N={largest}", worst < 2.0),
                extra={"commits": commits},
            )
        )
    if cluster is not None:
        n = cluster["size"]
        single = next((r for r in runs if r["size"] == n), None)
        case = f"N={n} 3-node R3"
        load, fo = cluster["load"], cluster["failover"]
        versus = {"baseline_name": f"one broker, N={n}"}
        rows += [
            Row("scale/cluster", case, "jobs/s", load["jobs_s"], single and single["load"]["jobs_s"], **versus),
            Row(
                "scale/cluster",
                case,
                "p99 ms",
                load["p99_ms"],
                single and single["load"]["p99_ms"],
                **versus,
                higher_is_better=False,
                extra=common | load,
            ),
            Row("scale/cluster", case, "broker msgs/job", load["msgs_per_job"], higher_is_better=False),
            Row(
                "scale/cluster",
                case + " leader killed",
                "stall s",
                fo["stall_s"],
                higher_is_better=False,
                **_judged(True, "0 lost, 0 duplicated", fo["lost"] == 0 and fo["duplicated"] == 0),
                extra=fo,
            ),
        ]
    return rows


async def run_async(quick: bool) -> list[Row]:
    sizes = QUICK_SIZES if quick else SIZES
    load0 = machine_load()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-scale-") as tmp:
        workdir = Path(tmp)
        mport = free_port()
        broker = EmbeddedBroker(store_dir=workdir / "nats", extra_args=["-m", str(mport)]).start()
        try:
            assert broker.proc is not None
            monitor = BrokerCounters([(mport, broker.proc.pid)])
            for size in sizes:
                say(f"N={size}: starting {math.ceil(size / PER_HOST)} replica host(s)")
                runs.append(await measure_size(broker.url, monitor, size, workdir, quick))
        finally:
            broker.stop()
        cluster = await measure_cluster(QUICK_CLUSTER_SIZE if quick else CLUSTER_SIZE, workdir / "cluster", quick)
    common = {
        "capacity": CAPACITY,
        "echo_s": ECHO_S,
        "offered_jobs_s": QUICK_OFFERED if quick else OFFERED,
        "loadavg_1m_before": load0["loadavg_1m"],
        "loadavg_1m_after": machine_load()["loadavg_1m"],
        "cpus": load0["cpus"],
        "per_host": PER_HOST,
        "median_registry_convergence_s": statistics.median(c["registry_s"] for r in runs for c in r["commits"]),
    }
    return rows_for(runs, cluster, common)


def run(quick: bool) -> list[Row]:
    return asyncio.run(run_async(quick))


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row.line())
