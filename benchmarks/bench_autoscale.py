"""The fleet sizing itself against a replayed demand trace, beside three other ways to size it.

One broker; four fleets, each in its own namespace, fed the same trace at the same instants by
a client of its own:

- ``fixed-min`` and ``fixed-max``: the bounds' two sizes, started before the trace, never changed;
- ``keda``: KEDA's NATS JetStream scaler as a Kubernetes user would set it up, computed from the
  same broker: ``ceil((NumPending + NumAckPending) / lagThreshold)`` over the jobs stream (the
  sum over its consumers: rollfleet declares one per subject), passed through the HPA's
  tolerance (10 %) and its scale-down stabilization window, carried out by the same driver;
  ``lagThreshold`` is rollfleet's sizing (slots x target utilization), the window rollfleet's
  scale-in grace, the period rollfleet's interval. HPA's scale-up rate limits are left out
  (they would only slow it down);
- ``rollfleet``: ``rollfleet autoscale``'s controller (``Controller``, the planner, its policy:
  each class sized for its load now and for the load its trend projects a start-up time ahead,
  the start-up time learnt from its own launches);
- ``rollfleet-headroom``: the same controller with a second policy (``Scale.headroom``: a larger
  minimum and fewer jobs a slot): the other end of the trade-off between replica-seconds and the
  wait of what no trend foresees, the ramp's first seconds (it outgrows one replica sooner than
  a replica asked for at its first job can start) and the burst (a tenth of the trace's training
  jobs at one instant).

Workers are echo workers that take ``startup_s`` to start (``--echo-startup``, as a GPU server's
start takes) and ``service_s`` per job, ``slots`` at once. The full run launches them as
``rollfleet worker`` processes through the local driver (``autoscale/drivers/local.py``); the
quick run (a smoke test) runs them as ``Worker`` instances in this process through a driver of
the same interface, so that it costs seconds.

The trace (``demand_trace``): a ramp of training jobs (``max_staleness=2``), a burst, a steady
stretch, a lull, then an evaluation burst pinned to version 1 (``exact_version=1``, long after
training moved past it; most of its requests wait for a replica, ``wait_for_replica=True``, a
few do not) over a trickle of training jobs; a version is published every few seconds
throughout.

Measured per fleet, from this process's clock and the broker's raw facts:
- replica-seconds: worker replicas alive (started, serving or draining) integrated over the
  trace, sampled every ``sample_s``;
- queue wait: each answer's time from submit, less the engine's ``service_s`` (p50, p95 over
  every answered job);
- requests refused (``NoCompatibleReplica``) and expired (their deadline passed unanswered);
- scale events: replicas launched and retired during the trace, and the most changes of
  direction (a launch after a retirement, or the reverse) of one class within any cooldown;
- jobs lost or duplicated: from the results stream, the answers stored per key (a duplicate is
  a key with two; a lost job is one accepted, neither refused nor expired, with none).

Targets (judged on unrounded values, for both rollfleet settings): p95 wait <= 1.2x ``fixed-max``'s;
replica-seconds <= 0.6x ``fixed-max``'s; every evaluation request that chose to wait served
(none refused, none expired); 0 lost, 0 duplicated; at most one change of direction of a class
within any cooldown.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from benchmarks._fleet import machine_load, percentile
from benchmarks.report import RESULTS_DIR, Row
from harness import temp_broker, wait_until
from rollfleet.autoscale.controller import Controller, ControllerConfig
from rollfleet.autoscale.drivers.base import Run
from rollfleet.autoscale.drivers.local import LocalDriver
from rollfleet.autoscale.planner import Policy
from rollfleet.broker.jobs_load import jobs_on_subjects
from rollfleet.schemas import Names, RolloutPayload, SamplingParams, VersionRecord
from rollfleet.schemas.errors import Expired, NoCompatibleReplica, RollfleetError
from rollfleet.schemas.names import key_token
from rollfleet.trainer_client import RolloutClient
from rollfleet.workers.engines.echo import EchoEngine
from rollfleet.workers.worker import Worker, WorkerConfig

SYSTEMS = ("fixed-min", "fixed-max", "keda", "rollfleet", "rollfleet-headroom")
CONTROLLED = ("rollfleet", "rollfleet-headroom")  # (the fleets rollfleet's controller sizes)
EVAL_VERSION = 1  # the old version the evaluation burst pins (training is at 2 when the trace starts)
PAYLOAD = RolloutPayload(prompt_token_ids=list(range(16)), sampling=SamplingParams(max_tokens=8))
Kind = Literal["train", "eval", "eval-now"]  # eval: waits for a replica; eval-now: takes a refusal


def say(text: str) -> None:
    print(f"  [autoscale] {text}", file=sys.stderr, flush=True)


# -- the run's sizes and the trace (pure) ----------------------------------------------------


@dataclass(frozen=True)
class Scale:
    service_s: float  # the echo engine's time per job
    startup_s: float  # the echo engine's start
    slots: int
    bounds: tuple[int, int]
    interval_s: float  # the controller's and the KEDA loop's period
    sample_s: float
    cooldown_s: float
    grace_s: float  # rollfleet's scale-in grace; KEDA's scale-down stabilization window
    target_utilization: float
    headroom: tuple[int, float]  # rollfleet-headroom's minimum replicas and target utilization
    hold_after_s: float
    heartbeat_s: float
    # the trace
    ramp_s: float
    ramp_from: float  # jobs/s
    ramp_to: float
    burst: int
    steady_s: float
    lull_s: float
    eval_waiting: int
    eval_now: int
    eval_timeout_s: float
    tail_s: float
    tail_rate: float
    publish_every_s: float
    train_timeout_s: float
    in_process: bool

    def policy(self, name: str = "rollfleet") -> Policy:
        lo, utilization = self.headroom if name == "rollfleet-headroom" else (self.bounds[0], self.target_utilization)
        return Policy(
            min_replicas=lo,
            max_replicas=self.bounds[1],
            slots_per_replica=self.slots,
            target_utilization=utilization,
            cooldown_s=self.cooldown_s,
            scale_in_grace_s=self.grace_s,
            hold_after_s=self.hold_after_s,
        )


FULL = Scale(
    service_s=2.0, startup_s=20.0, slots=4, bounds=(1, 8), interval_s=2.0, sample_s=0.5, cooldown_s=30.0,
    grace_s=20.0, target_utilization=0.75, headroom=(2, 0.3), hold_after_s=5.0, heartbeat_s=1.0,
    ramp_s=60.0, ramp_from=0.5, ramp_to=5.0, burst=40, steady_s=30.0, lull_s=60.0,
    eval_waiting=24, eval_now=4, eval_timeout_s=90.0, tail_s=30.0, tail_rate=1.0,
    publish_every_s=5.0, train_timeout_s=900.0, in_process=False,
)  # fmt: skip
QUICK = Scale(
    service_s=0.1, startup_s=0.3, slots=4, bounds=(1, 2), interval_s=0.1, sample_s=0.05, cooldown_s=0.6,
    grace_s=0.3, target_utilization=0.75, headroom=(1, 0.3), hold_after_s=0.0, heartbeat_s=0.2,
    ramp_s=0.6, ramp_from=5.0, ramp_to=20.0, burst=8, steady_s=0.2, lull_s=0.4,
    eval_waiting=4, eval_now=1, eval_timeout_s=1.0, tail_s=0.4, tail_rate=5.0,
    publish_every_s=0.3, train_timeout_s=60.0, in_process=True,
)  # fmt: skip


@dataclass(frozen=True)
class Arrival:
    t: float  # seconds after the trace's start
    kind: Kind


@dataclass(frozen=True)
class Trace:
    arrivals: tuple[Arrival, ...]
    publishes: tuple[float, ...]
    phases: tuple[tuple[str, float, float], ...]  # (name, start, end)
    end_s: float


def _arrivals_at_rate(start: float, duration: float, rate_from: float, rate_to: float) -> list[float]:
    """Deterministic arrivals of a rate going linearly from ``rate_from`` to ``rate_to`` jobs/s:
    the n-th at the instant the integral of the rate reaches n."""
    out: list[float] = []
    steps = 10_000
    owed = 0.0
    for i in range(steps if duration > 0 else 0):
        rate = rate_from + (rate_to - rate_from) * ((i + 0.5) / steps)
        owed += rate * duration / steps
        while owed >= 1.0 - 1e-9:
            owed -= 1.0
            out.append(start + duration * (i + 1) / steps)
    return out


def demand_trace(s: Scale) -> Trace:
    ramp_end = s.ramp_s
    steady_end = ramp_end + s.steady_s
    lull_end = steady_end + s.lull_s
    end = lull_end + s.tail_s
    arrivals = [Arrival(t, "train") for t in _arrivals_at_rate(0.0, s.ramp_s, s.ramp_from, s.ramp_to)]
    arrivals += [Arrival(ramp_end, "train")] * s.burst
    arrivals += [Arrival(t, "train") for t in _arrivals_at_rate(ramp_end, s.steady_s, s.ramp_to, s.ramp_to)]
    arrivals += [Arrival(lull_end, "eval")] * s.eval_waiting + [Arrival(lull_end, "eval-now")] * s.eval_now
    arrivals += [Arrival(t, "train") for t in _arrivals_at_rate(lull_end, s.tail_s, s.tail_rate, s.tail_rate)]
    publishes = tuple(s.publish_every_s * (i + 1) for i in range(int(end / s.publish_every_s)))
    phases = (
        ("ramp", 0.0, ramp_end),
        ("burst + steady", ramp_end, steady_end),
        ("lull", steady_end, lull_end),
        ("eval burst (v1) + trickle", lull_end, end),
    )
    return Trace(tuple(sorted(arrivals, key=lambda a: a.t)), publishes, phases, end)


# -- KEDA's rule (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class KedaRule:
    min_replicas: int
    max_replicas: int
    lag_threshold: float  # the trigger's lagThreshold: a replica per this many jobs
    tolerance: float = 0.1  # the HPA's: no change while metric / (target x replicas) is within 10 % of 1
    stabilization_s: float = 300.0  # the HPA's scale-down window (its default: 300 s)


@dataclass(frozen=True)
class KedaState:
    recommendations: tuple[tuple[float, int], ...] = ()  # (when, replicas) within the window


def keda_desired(rule: KedaRule, lag: int, current: int, state: KedaState, now: float) -> tuple[int, KedaState]:
    """The replicas KEDA's JetStream trigger, through the HPA, asks for: the metric is the lag
    (``NumPending + NumAckPending``) as an ``AverageValue`` of ``lagThreshold`` a replica; within
    the tolerance the size stays; a scale-down goes only to the largest recommendation of the
    stabilization window (a scale-up is at once)."""
    if current > 0 and abs(lag / (rule.lag_threshold * current) - 1.0) <= rule.tolerance:
        wanted = current
    else:
        wanted = math.ceil(lag / rule.lag_threshold - 1e-9) if lag > 0 else 0
    wanted = min(max(wanted, rule.min_replicas), rule.max_replicas)
    kept = (*((t, n) for t, n in state.recommendations if now - t < rule.stabilization_s), (now, wanted))
    desired = wanted if wanted >= current else min(current, max(n for _, n in kept))
    return desired, KedaState(kept)


# -- figures from what was recorded (pure) -----------------------------------------------------


def replica_seconds(samples: Sequence[tuple[float, int]], start: float, end: float) -> float:
    """The integral of the replica count over ``[start, end]``, each sample holding until the next."""
    total = 0.0
    for (t, n), (t_next, _) in zip(samples, [*samples[1:], (end, 0)], strict=False):
        lo, hi = max(t, start), min(t_next, end)
        if hi > lo:
            total += n * (hi - lo)
    return total


def direction_changes(actions: Iterable[tuple[float, str, int]]) -> dict[str, list[float]]:
    """Per class, when its scaling turned (a launch after a retirement, or the reverse);
    ``actions``: (when, class, +1 for a launch or -1 for a retirement), in time order."""
    last: dict[str, int] = {}
    turns: dict[str, list[float]] = {}
    for t, klass, step in actions:
        if klass in last and last[klass] != step:
            turns.setdefault(klass, []).append(t)
        last[klass] = step
    return turns


def most_within(times: Sequence[float], window_s: float) -> int:
    """The most of ``times`` inside any window ``[t, t + window_s)``."""
    ordered, best, lo = sorted(times), 0, 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] >= window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def answers_per_key(subject_counts: Mapping[str, int], names: Names) -> Counter[str]:
    """Answers stored per key token, from the results stream's subjects (one subject per key, job
    and worker; a count above 1 on one subject is a second answer too)."""
    out: Counter[str] = Counter()
    for subject, count in subject_counts.items():
        parsed = names.parse_result_subject(subject)
        if parsed is not None:
            out[parsed[1]] += count
    return out


# -- drivers: the local one (processes), or Worker instances in this process --------------------


@dataclass
class InProcessDriver:
    """The local driver's interface over ``Worker`` instances in this process (the quick run)."""

    url: str
    namespace: str
    prefix: str
    scale: Scale
    name: str = "in-process"
    _workers: dict[str, tuple[Worker, asyncio.Task[None], Run]] = field(default_factory=dict)
    _n: int = 0

    def owns(self, worker_id: str, host: str = "") -> bool:
        return worker_id.startswith(self.prefix + "-")

    async def runs(self) -> list[Run]:
        for worker_id, (_, task, _) in list(self._workers.items()):
            if task.done():
                del self._workers[worker_id]
        return [run for _, _, run in self._workers.values()]

    async def launch(self, held: int | None) -> str:
        self._n += 1
        worker_id = f"{self.prefix}-{self._n}" if held is None else f"{self.prefix}-v{held}-{self._n}"
        s = self.scale
        config = WorkerConfig(
            nats_url=self.url, namespace=self.namespace, worker_id=worker_id, capacity=s.slots,
            heartbeat_s=s.heartbeat_s, follow_versions=held is None, version=held or 0, drain_timeout_s=30.0,
        )  # fmt: skip
        worker = Worker(config, EchoEngine(latency_s=s.service_s, startup_s=s.startup_s))
        self._workers[worker_id] = (worker, asyncio.create_task(worker.run()), Run(worker_id, held, time.time()))
        return worker_id

    async def retire(self, worker_id: str, host: str = "") -> None:
        found = self._workers.get(worker_id)
        if found is not None and not found[2].retiring:
            worker, task, run = found
            self._workers[worker_id] = (worker, task, replace(run, retiring=True))
            worker.request_stop()

    def alive(self) -> int:
        return sum(not task.done() for _, task, _ in self._workers.values())

    async def close(self) -> None:
        for worker, _, _ in self._workers.values():
            worker.request_stop()
        await asyncio.gather(*(task for _, task, _ in self._workers.values()), return_exceptions=True)


def local_driver(url: str, namespace: str, prefix: str, s: Scale, home: Path) -> LocalDriver:
    args = ["--capacity", str(s.slots), "--echo-latency", str(s.service_s), "--echo-startup", str(s.startup_s)]
    args += ["--heartbeat", str(s.heartbeat_s)]
    return LocalDriver(url=url, namespace=namespace, home=home / prefix, prefix=prefix, worker_args=args)


class Counted:
    """A driver whose launches and retirements are recorded (when, class, +1 or -1)."""

    def __init__(self, inner: Any, clock: Any) -> None:
        self.inner, self.clock = inner, clock
        self.name = inner.name
        self.actions: list[tuple[float, str, int]] = []

    def owns(self, worker_id: str, host: str = "") -> bool:
        return bool(self.inner.owns(worker_id, host))

    async def runs(self) -> list[Run]:
        return list(await self.inner.runs())

    async def launch(self, held: int | None) -> str:
        self.actions.append((self.clock(), "latest" if held is None else str(held), +1))
        return str(await self.inner.launch(held))

    async def retire(self, worker_id: str, host: str = "") -> None:
        runs = {r.worker_id: r for r in await self.inner.runs()}
        run = runs.get(worker_id)
        if run is not None and not run.retiring:
            self.actions.append((self.clock(), "latest" if run.held is None else str(run.held), -1))
        await self.inner.retire(worker_id, host)

    def alive(self) -> int:
        inner = self.inner
        return inner.alive() if isinstance(inner, InProcessDriver) else len(inner.pids())

    async def close(self) -> None:
        await self.inner.close()


# -- one fleet under the trace --------------------------------------------------------------


@dataclass
class Job:
    key: str
    kind: Kind
    at: float  # trace time it was submitted
    outcome: str = "pending"  # ok | refused | expired | error:<code>
    wait_s: float | None = None


@dataclass
class Fleet:
    name: str
    namespace: str
    client: RolloutClient
    driver: Counted
    jobs: list[Job] = field(default_factory=list)
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, alive, ready, backlog)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    controller: Controller | None = None
    decisions: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)  # the controller's, as it said them

    def ready(self) -> int:
        return sum(r.state == "ready" for r in self.client.fleet.replicas())


async def keda_loop(fleet: Fleet, rule: KedaRule, interval_s: float, stop: asyncio.Event) -> None:
    """KEDA's JetStream trigger through the HPA, carried out by the fleet's driver: a scale-down
    removes pods not ready first, then the newest (a ReplicaSet's order; no pod-deletion-cost)."""
    names = Names(fleet.namespace)
    state = KedaState()
    while not stop.is_set():
        with contextlib.suppress(Exception):  # (a slow broker read: the next period reads again)
            jobs = await jobs_on_subjects(fleet.client.js, names)
            lag = sum(j.pending + j.in_flight for j in jobs.values())
            runs = [r for r in await fleet.driver.runs() if not r.retiring]
            desired, state = keda_desired(rule, lag, len(runs), state, time.monotonic())
            for _ in range(desired - len(runs)):
                await fleet.driver.launch(None)
            if desired < len(runs):
                ready = {r.worker_id for r in fleet.client.fleet.replicas() if r.state == "ready"}
                order = sorted(runs, key=lambda r: (r.worker_id in ready, -r.started_at))
                for run in order[: len(runs) - desired]:
                    await fleet.driver.retire(run.worker_id)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def submit_one(fleet: Fleet, job: Job, s: Scale, started: float) -> None:
    client = fleet.client
    try:
        if job.kind == "train":
            handle = await client.submit(PAYLOAD, max_staleness=2, idempotency_key=job.key, timeout=s.train_timeout_s)
        else:
            handle = await client.submit(
                PAYLOAD, exact_version=EVAL_VERSION, idempotency_key=job.key, timeout=s.eval_timeout_s,
                wait_for_replica=job.kind == "eval",
            )  # fmt: skip
        await handle
    except NoCompatibleReplica:
        job.outcome = "refused"
    except Expired:
        job.outcome = "expired"
    except RollfleetError as exc:
        job.outcome = f"error:{type(exc).__name__}"
    else:
        job.outcome = "ok"
        job.wait_s = time.monotonic() - started - s.service_s


async def replay(fleets: list[Fleet], trace: Trace, s: Scale, t0: float) -> None:
    """Every arrival and publish at its instant, to every fleet at once."""
    events: list[tuple[float, str, Arrival | None]] = [(a.t, "job", a) for a in trace.arrivals]
    events += [(t, "publish", None) for t in trace.publishes]
    events.sort(key=lambda e: (e[0], e[1] != "publish"))
    version = 2
    counts: Counter[str] = Counter()
    for at, what, arrival in events:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if what == "publish":
            version += 1
            record = VersionRecord(version=version, kind="delta", base_version=version - 1, created_at=time.time())
            await asyncio.gather(*(f.client.commit_version(record) for f in fleets))
            continue
        assert arrival is not None
        counts[arrival.kind] += 1
        key = f"{arrival.kind}-{counts[arrival.kind]}"
        now = time.monotonic()
        for fleet in fleets:
            job = Job(key, arrival.kind, now - t0)
            fleet.jobs.append(job)
            fleet.tasks.append(asyncio.create_task(submit_one(fleet, job, s, now)))


async def sample(fleets: list[Fleet], s: Scale, t0: float, stop: asyncio.Event) -> None:
    names = {f.name: Names(f.namespace) for f in fleets}
    wall_t0 = time.time() - (time.monotonic() - t0)
    while not stop.is_set():
        now = time.monotonic() - t0
        for fleet in fleets:
            doc = fleet.controller.document if fleet.controller is not None else None
            for d in (doc or {}).get("recent", []):  # (its last ten decisions: a sample sees each)
                key = (d["at"], d["klass"], d["action"], d.get("worker_id"))
                if key not in fleet.decisions:
                    fleet.decisions[key] = {**d, "t": round(d["at"] - wall_t0, 2)}
            backlog = -1
            with contextlib.suppress(Exception):
                jobs = await jobs_on_subjects(fleet.client.js, names[fleet.name])
                backlog = sum(j.pending for j in jobs.values())
            fleet.samples.append((now, fleet.driver.alive(), fleet.ready(), backlog))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), s.sample_s)


async def stored_answers(fleet: Fleet) -> Counter[str]:
    names = Names(fleet.namespace)
    info = await fleet.client.js.stream_info(names.results_stream, subjects_filter=names.results_wildcard)
    return answers_per_key(info.state.subjects or {}, names)


async def measure(s: Scale) -> tuple[dict[str, dict[str, Any]], Trace, dict[str, Fleet]]:
    trace = demand_trace(s)
    lo, hi = s.bounds
    clock_origin = [math.inf]  # (actions before the trace start, the fleets' set-up, come out at -inf)

    def clock() -> float:
        return time.monotonic() - clock_origin[0]

    with temp_broker("rf-bench-autoscale-") as broker, tempfile.TemporaryDirectory(prefix="rf-autoscale-") as tmp:
        url, run = broker.url, f"as{int(time.time()) % 100000}"
        fleets: list[Fleet] = []
        for name in SYSTEMS:
            ns = f"{run}-{name.replace('-', '')}"
            client = await RolloutClient.connect(url, namespace=ns, client_id="bench")
            client.deadline_grace_s = min(2.0, s.eval_timeout_s / 4)
            prefix = name.replace("-", "")
            inner: Any = (
                InProcessDriver(url, ns, prefix, s) if s.in_process else local_driver(url, ns, prefix, s, Path(tmp))
            )
            fleets.append(Fleet(name, ns, client, Counted(inner, clock)))
        by_name = {f.name: f for f in fleets}
        stop_loops = asyncio.Event()
        loops: list[asyncio.Task[Any]] = []
        controllers: dict[str, Controller] = {}
        try:
            for f in fleets:  # training is at 2: version 1 is old by the time it is asked for
                for v in (1, 2):
                    await f.client.commit_version(VersionRecord(version=v, kind="delta", base_version=v - 1))
            for name, size in (("fixed-min", lo), ("fixed-max", hi), ("keda", lo)):
                for _ in range(size):
                    await by_name[name].driver.launch(None)
            for name in CONTROLLED:
                auto = by_name[name]
                config = ControllerConfig(url=url, namespace=auto.namespace, policy=s.policy(name),
                                          interval_s=s.interval_s)  # fmt: skip
                auto.controller = controllers[name] = Controller(config, auto.driver)  # type: ignore[arg-type]
                loops.append(asyncio.create_task(controllers[name].run(stop_loops)))
            say(f"starting the fleets ({s.startup_s:g} s start-up each)")
            sizes = (lo, hi, lo, lo, s.policy("rollfleet-headroom").min_replicas)
            for f, size in zip(fleets, sizes, strict=True):
                await wait_until(lambda f=f, size=size: f.ready() >= size, 120 + 3 * s.startup_s,
                                 what=f"{f.name}: {size} replicas ready", interval=0.05)  # fmt: skip
            rule = KedaRule(lo, hi, s.slots * s.target_utilization, stabilization_s=s.grace_s)
            loops.append(asyncio.create_task(keda_loop(by_name["keda"], rule, s.interval_s, stop_loops)))
            t0 = time.monotonic()
            clock_origin[0] = t0
            stop_sampling = asyncio.Event()
            sampler = asyncio.create_task(sample(fleets, s, t0, stop_sampling))
            n = len(fleets)
            say(f"replaying the trace: {len(trace.arrivals)} requests over {trace.end_s:g} s, each to {n} fleets")
            await replay(fleets, trace, s, t0)
            await asyncio.sleep(max(0.0, t0 + trace.end_s - time.monotonic()))
            say("trace over; waiting for every request to be settled")
            for f in fleets:
                await asyncio.gather(*f.tasks)
            # Every fleet is measured over the same window: until the last request of any was settled.
            settled_at = time.monotonic() - t0
            stop_sampling.set()
            await sampler
            figures = {f.name: await summarize(f, s, settled_at) for f in fleets}
        finally:
            stop_loops.set()
            await asyncio.gather(*loops, return_exceptions=True)
            # (a controller closed its own driver; the other fleets' workers drain side by side)
            await asyncio.gather(*(f.driver.close() for f in fleets if f.name not in controllers))
            await asyncio.gather(*(f.client.close() for f in fleets))
    return figures, trace, by_name


async def summarize(f: Fleet, s: Scale, window_end: float) -> dict[str, Any]:
    # The waits compared are the training jobs', which every fleet serves; an evaluation job only a
    # replica held at its version serves: its wait is said apart.
    waits = [j.wait_s for j in f.jobs if j.wait_s is not None and j.kind == "train"]
    eval_waits = [j.wait_s for j in f.jobs if j.wait_s is not None and j.kind != "train"]
    outcomes = Counter(j.outcome for j in f.jobs)
    answers = await stored_answers(f)
    accepted = [j for j in f.jobs if j.outcome not in ("refused", "expired")]
    lost = [j.key for j in accepted if answers.get(key_token(j.key), 0) == 0]
    duplicated = [k for k, n in answers.items() if n > 1]
    evals = [j for j in f.jobs if j.kind == "eval"]
    in_trace = [(t, k, d) for t, k, d in f.driver.actions if 0 <= t <= window_end]
    turns = direction_changes(in_trace)
    doc = f.controller.document if f.controller is not None else None
    slowest = sorted(((j.at, j.wait_s) for j in f.jobs if j.wait_s is not None and j.kind == "train"),
                     key=lambda x: -x[1])[:40]  # fmt: skip
    return {
        # (the p95's tail: which jobs waited, by when they arrived)
        "slowest_training": [[round(at, 2), round(w, 3)] for at, w in slowest],
        "startup_s": doc.get("startup_s") if doc else None,  # (what the controller measured, in the end)
        "startup_measured": doc.get("startup_measured") if doc else None,
        "replica_seconds": replica_seconds([(t, n) for t, n, _, _ in f.samples], 0.0, window_end),
        "wait_p50_s": percentile(waits, 50) if waits else math.nan,
        "wait_p95_s": percentile(waits, 95) if waits else math.nan,
        "answered": len(waits) + len(eval_waits),
        "eval_wait_p95_s": percentile(eval_waits, 95) if eval_waits else None,
        "eval_wait_max_s": max(eval_waits) if eval_waits else None,
        "refused": outcomes["refused"],
        "expired": outcomes["expired"],
        "errors": sum(n for o, n in outcomes.items() if o.startswith("error:")),
        "eval_waiting": len(evals),
        "eval_served": sum(j.outcome == "ok" for j in evals),
        "eval_refused": sum(j.outcome == "refused" for j in evals),
        "eval_expired": sum(j.outcome == "expired" for j in evals),
        "eval_now_refused": sum(j.outcome == "refused" for j in f.jobs if j.kind == "eval-now"),
        "launched": sum(d > 0 for _, _, d in in_trace),
        "retired": sum(d < 0 for _, _, d in in_trace),
        "turns": {k: [round(t, 2) for t in v] for k, v in turns.items()},
        "most_turns_per_cooldown": max((most_within(v, s.cooldown_s) for v in turns.values()), default=0),
        "lost": len(lost),
        "duplicated": len(duplicated),
        "answers_stored": sum(answers.values()),
        "window_s": round(window_end, 3),
        "decisions": sorted(
            (
                {k: d.get(k) for k in ("t", "klass", "action", "before", "after", "reason")}
                for d in f.decisions.values()
            ),
            key=lambda d: d["t"],
        ),
    }


# -- the plot ------------------------------------------------------------------------------------


def plot(fleets: Mapping[str, Fleet], trace: Trace, figures: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(10, 8), sharex=True, height_ratios=[3, 3, 1.4])
    colors = {"fixed-min": "#999999", "fixed-max": "#555555", "keda": "#d08a1c", "rollfleet": "#1f6fb4",
              "rollfleet-headroom": "#2ca02c"}  # fmt: skip
    styles = {"fixed-min": ":", "fixed-max": "--", "keda": "-", "rollfleet": "-", "rollfleet-headroom": "-."}
    for name, f in fleets.items():
        t = [x[0] for x in f.samples]
        fig_ = figures[name]
        label = f"{name}: {fig_['replica_seconds']:.0f} replica-s, training p95 wait {fig_['wait_p95_s']:.2f} s"
        top.step(t, [x[1] for x in f.samples], where="post", color=colors[name], ls=styles[name], label=label)
        mid.plot(t, [max(x[3], 0) for x in f.samples], color=colors[name], ls=styles[name], label=name)
    for ax in (top, mid, bottom):
        for i, (_, start, end) in enumerate(trace.phases):
            ax.axvspan(start, end, color="#f2f2f2" if i % 2 else "white", zorder=0)
    for name, start, _ in trace.phases:
        top.annotate(name, (start, 1.0), xycoords=("data", "axes fraction"), va="bottom", fontsize=8)
    width = max(trace.end_s / 120, 1e-3)
    train = [a.t for a in trace.arrivals if a.kind == "train"]
    evals = [a.t for a in trace.arrivals if a.kind != "train"]
    bins = [i * width for i in range(int(trace.end_s / width) + 2)]
    bottom.hist([train, evals], bins=bins, stacked=True, color=["#8fb8de", "#c0504d"], label=["training", "eval (v1)"])
    top.set_ylabel("replicas alive")
    mid.set_ylabel("jobs waiting")
    bottom.set_ylabel("requests")
    bottom.set_xlabel("seconds into the trace")
    top.legend(fontsize=8, loc="upper right")
    mid.legend(fontsize=8, loc="upper right")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- rows ----------------------------------------------------------------------------------------


def rows_of(figures: Mapping[str, Mapping[str, Any]], s: Scale, trace: Trace, plot_path: Path) -> list[Row]:
    top = figures["fixed-max"]
    rows: list[Row] = []
    for name in SYSTEMS:
        f = figures[name]
        me = name in CONTROLLED
        extra = dict(f) if name != "fixed-min" else {**f, "trace": trace_summary(s, trace), "plot": str(plot_path),
                                                        **machine_load()}  # fmt: skip
        rs_met = f["replica_seconds"] <= 0.6 * top["replica_seconds"] if me else None
        rows.append(
            Row("autoscale/replica-seconds", name, "replica-s", f["replica_seconds"], top["replica_seconds"],
                "fixed-max", False, "<= 0.6x fixed-max" if me else "", extra, rs_met)
        )  # fmt: skip
    for q in (50, 95):
        for name in SYSTEMS:
            f = figures[name]
            me = q == 95 and name in CONTROLLED
            base = top[f"wait_p{q}_s"]
            met = bool(f[f"wait_p{q}_s"] <= 1.2 * base) if me else None
            rows.append(
                Row(f"autoscale/wait-p{q}", name, "s (training)", f[f"wait_p{q}_s"], base if base > 0 else None,
                    "fixed-max" if base > 0 else "", False, "<= 1.2x fixed-max" if me else "", {}, met)
            )  # fmt: skip
    for name in SYSTEMS:
        f = figures[name]
        me = name in CONTROLLED
        served_all = f["eval_served"] == f["eval_waiting"] and f["eval_refused"] == 0
        rows.append(
            Row("autoscale/eval-served", name, f"of {f['eval_waiting']}", f["eval_served"], None, "", True,
                "all that waited, 0 refused" if me else "",
                {k: f[k] for k in ("eval_refused", "eval_expired", "eval_now_refused", "eval_wait_p95_s",
                                    "eval_wait_max_s")}, served_all if me else None)
        )  # fmt: skip
        rows.append(Row("autoscale/refused", name, "requests", f["refused"], None, "", False, "", {}, None))
        rows.append(
            Row("autoscale/scale-events", name, "launch+retire", f["launched"] + f["retired"], None, "", False,
                "", {"launched": f["launched"], "retired": f["retired"], "turns": f["turns"]}, None)
        )  # fmt: skip
        rows.append(
            Row("autoscale/lost+duplicated", name, "jobs", f["lost"] + f["duplicated"], None, "", False,
                "0" if me else "", {"lost": f["lost"], "duplicated": f["duplicated"],
                                    "answers_stored": f["answers_stored"]},
                f["lost"] + f["duplicated"] == 0 if me else None)
        )  # fmt: skip
        rows.append(
            Row("autoscale/turns-per-cooldown", name, "most", f["most_turns_per_cooldown"], None, "", False,
                "<= 1" if me else "", {"cooldown_s": s.cooldown_s},
                f["most_turns_per_cooldown"] <= 1 if me else None)
        )  # fmt: skip
    return rows


def trace_summary(s: Scale, trace: Trace) -> dict[str, Any]:
    kinds = Counter(a.kind for a in trace.arrivals)
    return {
        "requests": dict(kinds),
        "phases": [(n, round(a, 3), round(b, 3)) for n, a, b in trace.phases],
        "publishes": len(trace.publishes),
        "service_s": s.service_s,
        "startup_s": s.startup_s,
        "slots": s.slots,
        "bounds": list(s.bounds),
        "policy": {"target_utilization": s.target_utilization, "headroom (min, target utilization)": s.headroom,
                   "trend_window_s": s.policy().trend_window_s, "startup_s (until measured)": s.policy().startup_s,
                   "cooldown_s": s.cooldown_s,
                   "scale_in_grace_s": s.grace_s, "hold_after_s": s.hold_after_s, "interval_s": s.interval_s},
        "keda": {"lagThreshold": s.slots * s.target_utilization, "stabilization_s": s.grace_s, "tolerance": 0.1},
        "workers": "in-process Worker instances" if s.in_process else "rollfleet worker processes (local driver)",
    }  # fmt: skip


def run(quick: bool = False) -> list[Row]:
    s = QUICK if quick else FULL
    figures, trace, fleets = asyncio.run(measure(s))
    path = Path(tempfile.gettempdir()) / "rf-autoscale-quick.png" if quick else RESULTS_DIR / "autoscale.png"
    plot(fleets, trace, figures, path)
    for name in SYSTEMS:
        f = figures[name]
        say(
            f"{name}: {f['replica_seconds']:.1f} replica-s, wait p50 {f['wait_p50_s']:.3f} s p95 "
            f"{f['wait_p95_s']:.3f} s, refused {f['refused']}, expired {f['expired']}, eval served "
            f"{f['eval_served']}/{f['eval_waiting']}, launched {f['launched']} retired {f['retired']}, "
            f"lost {f['lost']} duplicated {f['duplicated']}"
        )
    return rows_of(figures, s, trace, path)
