"""``rollfleet autoscale``: the controller that carries the plan out.

Each ``interval_s``, while it holds the lease (``lease.py``): read the signal and the registry
(``reading.py``), add the replicas its driver runs that have not registered yet, ask the planner
(``planner.plan``), retire and launch through the driver, and say every decision in one
structured log line with the signal that caused it. It keeps nothing the broker does not hold
but the planner's timers: a controller that restarts (or takes the lease over) starts from an
empty ``PlannerState`` and only waits longer before it shrinks anything.

What it decided is published three ways: Prometheus metrics (desired and actual replicas per
class, the signal, decisions), the fleet bucket's ``autoscaler.status`` (what ``rollfleet
status`` shows), and an HTTP endpoint KEDA's ``metrics-api`` scaler reads (``/keda``, the same
document; see ``keda.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from rollfleet.autoscale.drivers.base import Driver, Run
from rollfleet.autoscale.lease import DEFAULT_TTL_S, BrokerLease
from rollfleet.autoscale.planner import Decision, Plan, PlannerState, Policy, plan
from rollfleet.autoscale.reading import SignalReader
from rollfleet.autoscale.signal import LAUNCHING, ClassKey, ReplicaFacts, Signal
from rollfleet.broker.connection import connect
from rollfleet.broker.startup import until_ready
from rollfleet.broker.topology import DEFAULT_TOPOLOGY, TopologyConfig, ensure_topology
from rollfleet.broker.types import NATS
from rollfleet.runtime.aio import wait_event
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names

log = get_logger("rollfleet.autoscale")
# Decisions go through a logger resolved at each call (not bound once at import), so a test can
# read the very lines an operator reads.
decision_log = structlog.get_logger("rollfleet.autoscale")

STATUS_KEY = Names.AUTOSCALER_STATUS_KEY
STATUS_REFRESH_S = 15.0  # the status is rewritten when it changes, and at least this often


def fleet_of(
    registry: Iterable[ReplicaFacts], runs: Iterable[Run], owns: Callable[[str, str], bool]
) -> list[ReplicaFacts]:
    """The fleet the planner sees: every live registry entry, the driver's own marked managed
    (and draining once told to stop); a driver's replica not registered yet as launching; an
    entry of the driver's whose process or container is gone left out (it is gone, whatever
    its entry says for the next heartbeats). A run is matched to its entry by worker id, or by
    host where the driver knows only that (``Run.host``)."""
    by_id = {r.worker_id: r for r in runs}
    by_host = {r.host: r for r in by_id.values() if r.host}
    out: list[ReplicaFacts] = []
    for r in registry:
        run = by_id.pop(r.worker_id, None)
        if run is None and r.host in by_host:
            run = by_host.pop(r.host)
            by_id.pop(run.worker_id, None)
        elif run is not None and run.host:
            by_host.pop(run.host, None)
        if run is None:
            if not owns(r.worker_id, r.host):
                out.append(replace(r, managed=False))
            continue
        state = "draining" if run.retiring and r.state not in ("draining", "stopped") else r.state
        out.append(replace(r, managed=True, state=state))
    for run in by_id.values():
        state = "draining" if run.retiring else LAUNCHING
        out.append(
            ReplicaFacts(run.worker_id, held=run.held, state=state, capacity=0, started_at=run.started_at,
                         host=run.host or "")
        )  # fmt: skip
    return out


def class_name(klass: ClassKey) -> str:
    return str(klass)


def status_document(
    p: Plan, signal: Signal, policy: Policy, holder: str, at: float, recent: list[dict[str, Any]]
) -> dict[str, Any]:
    """What ``rollfleet status`` shows and KEDA reads: per class (``latest``, or a version held),
    the desired and actual replicas and the signal; the start-up time the plan looks ahead by
    (measured from its own launches, or the policy's until one was); and, for a class none of
    whose replicas serves while one starts, when (unix time, ``at``'s clock) the first is expected
    to serve: ``serving_by``, what a gateway's 409 may tell a client to wait."""
    classes = {}
    for klass in sorted(p.desired, key=lambda k: (k != "latest", str(k))):
        d = signal.demand(klass)
        eta = p.serving_in.get(klass)
        classes[class_name(klass)] = {
            "desired": p.desired[klass],
            "actual": p.actual.get(klass, 0),
            "backlog": d.backlog,
            "running": d.in_flight,
            "oldest_wait_s": round(d.oldest_wait_s, 3),
            "awaiting_activation": d.awaiting_activation,
            "sessions": d.sessions,
            "refused": d.refusals,
            "slots": d.slots,
            "busy": d.busy,
            # (whole seconds: the status is written again when it changes, not at every tick)
            "serving_by": None if eta is None else round(at + eta),
        }
    return {
        "holder": holder,
        "at": at,
        "latest": signal.latest,
        "policy": {"min": policy.min_replicas, "max": policy.max_replicas},
        "startup_s": round(p.startup_s, 3),
        "startup_measured": p.startup_measured,
        "classes": classes,
        "recent": recent[-10:],
    }


def decision_fields(d: Decision) -> dict[str, Any]:
    return {
        "klass": class_name(d.klass),
        "action": d.action,
        "before": d.before,
        "after": d.after,
        "reason": d.reason,
        "worker_id": d.worker_id,
        "backlog": d.demand.backlog,
        "running": d.demand.in_flight,
        "oldest_wait_s": round(d.demand.oldest_wait_s, 3),
        "awaiting_activation": d.demand.awaiting_activation,
        "sessions": d.demand.sessions,
        "refused": d.demand.refusals,
    }


class AutoscaleMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["klass"]
        self.desired = Gauge(
            "rollfleet_autoscale_desired_replicas", "replicas the plan wants", labels, registry=self.registry
        )
        self.actual = Gauge(
            "rollfleet_autoscale_actual_replicas",
            "replicas counted (starting ones too)",
            labels,
            registry=self.registry,
        )
        self.backlog = Gauge("rollfleet_autoscale_backlog_jobs", "jobs waiting", labels, registry=self.registry)
        self.running = Gauge("rollfleet_autoscale_running_jobs", "jobs running", labels, registry=self.registry)
        self.wait = Gauge(
            "rollfleet_autoscale_oldest_wait_seconds", "oldest waiting job's wait", labels, registry=self.registry
        )
        self.awaiting = Gauge(
            "rollfleet_autoscale_awaiting_activation_jobs",
            "jobs waiting out an activation",
            labels,
            registry=self.registry,
        )
        self.sessions = Gauge(
            "rollfleet_autoscale_pinned_sessions", "sessions pinned to the class", labels, registry=self.registry
        )
        self.refused = Gauge(
            "rollfleet_autoscale_refused_requests", "requests refused lately", labels, registry=self.registry
        )
        self.decisions = Counter(
            "rollfleet_autoscale_decisions", "decisions taken", ["klass", "action"], registry=self.registry
        )
        self.leader = Gauge(
            "rollfleet_autoscale_leader", "1 while this controller holds the lease", registry=self.registry
        )
        self._shown: set[str] = set()

    def show(self, doc: dict[str, Any]) -> None:
        classes = doc["classes"]
        for gone in self._shown - set(classes):
            for g in (
                self.desired,
                self.actual,
                self.backlog,
                self.running,
                self.wait,
                self.awaiting,
                self.sessions,
                self.refused,
            ):
                g.remove(gone)
        self._shown = set(classes)
        for name, c in classes.items():
            self.desired.labels(name).set(c["desired"])
            self.actual.labels(name).set(c["actual"])
            self.backlog.labels(name).set(c["backlog"])
            self.running.labels(name).set(c["running"])
            self.wait.labels(name).set(c["oldest_wait_s"])
            self.awaiting.labels(name).set(c["awaiting_activation"])
            self.sessions.labels(name).set(c["sessions"])
            self.refused.labels(name).set(c["refused"])

    def text(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class ControllerConfig:
    url: str
    namespace: str = "default"
    policy: Policy = field(default_factory=Policy)
    interval_s: float = 2.0
    lease_ttl_s: float = DEFAULT_TTL_S
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # /metrics and /keda; 0 picks a free port; None: none
    store: Path | None = None  # a store directory: versions retention deleted are not held
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    connect_options: dict[str, Any] = field(default_factory=dict)
    topology: TopologyConfig = DEFAULT_TOPOLOGY


class Controller:
    def __init__(self, config: ControllerConfig, driver: Driver) -> None:
        self.config = config
        self.driver = driver
        self.names = Names(config.namespace)
        self.metrics = AutoscaleMetrics()
        self.state = PlannerState()
        self.document: dict[str, Any] | None = None
        self.http_port: int | None = None
        self.acting = False
        self.ticks = 0
        self._nc: NATS | None = None
        self._reader: SignalReader | None = None
        self._lease: BrokerLease | None = None
        self._fleet_kv: Any = None
        self._recent: list[dict[str, Any]] = []
        self._waits: dict[str, tuple[int, int]] = {}
        self._published: tuple[Any, float] = (None, 0.0)
        self._server: asyncio.AbstractServer | None = None

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        self._nc = await connect(
            cfg.url, name="rollfleet-autoscale", inbox_prefix=self.names.inbox_prefix("trainer"), **cfg.connect_options
        )
        try:
            js = self._nc.jetstream()
            # (it reads what a trainer declares; like a gateway, it declares what is missing itself,
            # with the fleet's own topology flags)
            await until_ready(lambda: ensure_topology(js, self.names, cfg.topology), what="namespace")
            self._fleet_kv = await until_ready(
                lambda: js.key_value(self.names.fleet_bucket), what="namespace", typed=False
            )
            self._reader = await SignalReader(self._nc, js, self.names, cfg.store).start()
            self._lease = BrokerLease(self._fleet_kv, cfg.holder, cfg.lease_ttl_s)
            if cfg.http_port is not None:
                from rollfleet.autoscale.keda import serve_http

                self._server, self.http_port = await serve_http(
                    self.metrics.text, self.served_document, cfg.http_host, cfg.http_port
                )
                log.info(
                    "autoscale endpoint", url=f"http://{cfg.http_host}:{self.http_port}", paths=["/metrics", "/keda"]
                )
            while not stop.is_set():
                holding = await self._lease.step()
                self.metrics.leader.set(1 if holding else 0)
                if holding and not self.acting:
                    log.info("autoscale acting: lease held", holder=cfg.holder, namespace=cfg.namespace)
                    self.state = PlannerState()  # (everything else is read again from the broker)
                elif not holding and self.acting:
                    log.warning("autoscale standing by: lease lost", holder=cfg.holder)
                elif not holding and self.ticks == 0:
                    log.info("autoscale waiting for the lease", holder=await self._lease.holder_now())
                self.acting = holding
                if holding:
                    try:
                        await self.tick()
                    except Exception as exc:  # (the broker away: the next tick reads again)
                        log.warning("autoscale tick failed", error=repr(exc))
                self.ticks += 1
                await wait_event(stop, cfg.interval_s)
        finally:
            if self._server is not None:
                self._server.close()
            if self._lease is not None:
                await self._lease.release()
            if self._reader is not None:
                await self._reader.close()
            await self.driver.close()
            await self._nc.close()

    async def tick(self) -> Plan:
        assert self._reader is not None and self._lease is not None
        runs = await self.driver.runs()
        signal, registry = await self._reader.read(managed=[r.worker_id for r in runs])
        fleet = fleet_of(registry, runs, self.driver.owns)
        hosts = {r.worker_id: r.host for r in fleet}
        now = time.monotonic()
        p = plan(signal, fleet, self.config.policy, self.state, now)
        self.state = p.state
        acts = self.driver.name != "none"  # (plan only: KEDA carries the followers' size out)
        for d in p.decisions:
            if acts or d.action in ("up", "down", "unavailable"):
                self._say(d)
        for worker_id in p.retire if acts else ():
            if not self._lease.holding:
                break  # (the lease lapsed meanwhile: another controller may act now)
            await self.driver.retire(worker_id, hosts.get(worker_id, ""))
            # (an action, said once it is done: the decision line above may not be followed by one)
            log.info("autoscale retired", worker_id=worker_id, driver=self.driver.name)
        for launch in p.launch if acts else ():
            for _ in range(launch.count):
                if not self._lease.holding:
                    break
                worker_id = await self.driver.launch(launch.held)
                log.info("autoscale launched", worker_id=worker_id, held=launch.held, driver=self.driver.name)
        doc = status_document(p, signal, self.config.policy, self.config.holder, time.time(), self._recent)
        self.document = doc
        self.metrics.show(doc)
        await self._publish(doc)
        return p

    def _say(self, d: Decision) -> None:
        fields = decision_fields(d)
        name = fields["klass"]
        if d.action == "waits":  # (a standing condition: said when it starts or changes)
            if self._waits.get(name) == (d.before, d.after):
                return
            self._waits[name] = (d.before, d.after)
        elif d.action == "launch":
            self._waits.pop(name, None)
        self.metrics.decisions.labels(name, d.action).inc()
        decision_log.info("autoscale decision", **fields)
        self._recent = [*self._recent[-9:], {"at": round(time.time(), 3), **fields}]

    async def _publish(self, doc: dict[str, Any]) -> None:
        """The status in the fleet bucket, when it changed (the wait aside) or went stale."""
        essence = {k: {f: v for f, v in c.items() if f != "oldest_wait_s"} for k, c in doc["classes"].items()}
        last, at = self._published
        now = time.monotonic()
        if essence == last and now - at < STATUS_REFRESH_S:
            return
        try:
            await self._fleet_kv.put(STATUS_KEY, json.dumps(doc).encode())
            self._published = (essence, now)
        except Exception as exc:
            log.debug("autoscale status not written", error=repr(exc))

    async def served_document(self) -> dict[str, Any] | None:
        """What ``/keda`` serves: this controller's plan while it acts; else the acting one's."""
        if self.acting and self.document is not None:
            return self.document
        return await self.stored_document()

    async def stored_document(self) -> dict[str, Any] | None:
        """The status the acting controller last wrote (what a standby serves)."""
        if self._fleet_kv is None:
            return None
        try:
            entry = await self._fleet_kv.get(STATUS_KEY)
            return json.loads(entry.value or b"null")
        except Exception:
            return None
