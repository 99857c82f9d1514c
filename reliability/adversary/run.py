"""The machine adversary: seeded, randomized faults composed at random moments, against real
processes, with an independent oracle judging every run (issue 19).

    python -m reliability.adversary --seed 1234 --duration 60
    python -m reliability.adversary --seed 1234 --duration 60 --hf 1         # plus an hf replica
    python -m reliability.adversary --seed 1234 --code /path/to/checkout     # another rollfleet tree
    python -m reliability.adversary --campaign 20 --duration 90              # many seeds

One run: a nats-server with the generated auth config (a user per worker id, a rogue worker
user among them, a privileged wiretap), ``rollfleet worker`` processes following a policy
store with ``--verify-live``, a trainer process (``reliability.adversary.load``) submitting a
seeded mix of jobs and sessions, the rogue (``reliability.adversary.rogue``) and the tap
(``reliability.adversary.tap``); publisher processes (``reliability.adversary.publisher``) for
the versions it SIGKILLs mid-publication or races for, the policy KV read raw before and after
each (``Timeline.publishers``). The seed fixes the schedule of events
(``reliability.adversary.schedule``), printed first, one JSON line per event as it is injected.
The harness keeps the fleet at its size (``keep_fleet``: a worker that is killed and not
restarted by its event, or that exits on its own, is started again). At the end the oracle
(``reliability.adversary.oracle``) checks every answer; a run with violations prints them, its
seed and the one-line command that replays it, and a JSON summary line last
(``"violations": 0`` when it passed). Exit code 1 on violations.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.clocks import faketime_library
from reliability.adversary.autoscaler import AUTOSCALER_KINDS, autoscaler_event
from reliability.adversary.cluster_nodes import NODE_KINDS
from reliability.adversary.engines import ENGINE_KINDS, SGLANG_POOL, engine_event
from reliability.adversary.journal import Journal, describe_error, describe_result
from reliability.adversary.machine import ECHO_POOL, GATEWAY_CLIENT, GATEWAYS, HF_POOL, ROGUE, Machine, WorkerProc
from reliability.adversary.oracle import AVAILABLE_S
from reliability.adversary.schedule import Event, make_schedule

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "adv"
TRAINER_ID = "trainer"
FAULT_WAIT_S = 25.0
KEEP_AFTER_S = 2.0  # how long a slot of the fleet may stay empty before the harness fills it again
EXACT_DRAINS = (0.3, 1.0, 3.0)


@dataclass
class Config:
    seed: int
    duration: float = 60.0
    workers: int = 3
    hf: int = 0
    sglang: int = 0  # sglang workers, each attached to a keyed engine server of its own (engine events)
    store: str = "dir"  # "s3": the policy store in a bucket (moto), each worker reading it through a fault proxy
    cluster: bool = False  # a 3-node cluster with R3 streams, and node events (``reliability.adversary.cluster_nodes``)
    auth: bool = True
    code: str | None = None  # another checkout's rollfleet (e.g. the code before a fix)
    schedule: str | None = None  # a named schedule instead of the seed's random one
    sessions: int = 3
    loop: bool = True  # the trainer runs a RolloutLoop too (``reliability.adversary.loop_load``)
    gateway_sessions: int = 1  # lanes of HTTP trajectories and keyless callers (``gateway_load``)
    ack_wait: float = 2.0
    duplicate_window: float = 15.0
    max_deliver: int = 10
    available_s: float = AVAILABLE_S  # the oracle's bound on a stop of service (tests shorten it)
    # "MIN:MAX": the echo fleet sized by ``rollfleet autoscale`` controllers, not started by the harness
    # (``reliability.adversary.autoscaler``; the ``autoscaler`` schedule's mode). Without auth: the
    # generated config has a user per worker id, and a controller names its workers as it starts them.
    autoscale: str | None = None
    workdir: Path | None = None
    keep: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.schedule == "autoscaler" and not self.autoscale:
            from reliability.adversary.autoscaler import DEFAULT_BOUNDS

            self.autoscale = DEFAULT_BOUNDS
        if self.autoscale:
            self.auth = False

    @property
    def replicas(self) -> int:
        """Stream replicas every process of the run declares: R3 on the cluster."""
        return 3 if self.cluster else 1

    def replay(self) -> str:
        parts = [f"python -m reliability.adversary --seed {self.seed} --duration {self.duration:g}"]
        if self.hf:
            parts.append(f"--hf {self.hf}")
        if self.sglang:
            parts.append(f"--sglang {self.sglang}")
        if self.store != "dir":
            parts.append(f"--store {self.store}")
        if self.cluster:
            parts.append("--cluster")
        if self.autoscale:
            parts.append(f"--autoscale {self.autoscale}")
        if self.workers != 3 and not self.autoscale:
            parts.append(f"--workers {self.workers}")
        if not self.loop:
            parts.append("--no-loop")
        if self.gateway_sessions != 1:
            parts.append(f"--gateway-sessions {self.gateway_sessions}")
        if not self.auth and not self.autoscale:
            parts.append("--no-auth")
        if self.schedule:
            parts.append(f"--schedule {self.schedule}")
        if self.code:
            parts.append(f"--code {self.code}")
        return " ".join(parts)


@dataclass
class Report:
    config: Config
    seconds: float = 0.0
    events: int = 0  # events that did something (a skipped one, e.g. no victim, is not counted)
    events_by_kind: dict[str, int] = field(default_factory=dict)
    events_skipped: dict[str, int] = field(default_factory=dict)
    checks: dict[str, int] = field(default_factory=dict)
    violations: list[Any] = field(default_factory=list)
    unverified: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    workdir: str = ""
    crashed: str | None = None

    @property
    def vacuous(self) -> str | None:
        """Why the run proves nothing (no event injected, no fact judged), if it does not."""
        if self.crashed is not None:
            return None
        if self.events <= 0:
            return "the run injected no events"
        if sum(self.checks.values()) <= 0:
            return "the oracle judged no fact"
        return None

    @property
    def passed(self) -> bool:
        return not self.violations and self.crashed is None and self.vacuous is None

    def summary(self) -> dict[str, Any]:
        by_check: dict[str, int] = {}
        for v in self.violations:
            by_check[v.check] = by_check.get(v.check, 0) + 1
        return {
            "seed": self.config.seed,
            "duration": self.config.duration,
            "hf": self.config.hf,
            "schedule": self.config.schedule,
            "rollfleet": self.notes.get("rollfleet"),
            "seconds": self.seconds,
            "events": self.events,
            "events_by_kind": self.events_by_kind,
            "events_skipped": self.events_skipped,
            "checks": sum(self.checks.values()),
            "checks_by_invariant": self.checks,
            "violations": len(self.violations) + (1 if self.crashed else 0) + (1 if self.vacuous else 0),
            "vacuous": self.vacuous,
            "violations_by_check": by_check,
            "unverified": self.unverified,
            "crashed": self.crashed,
            "replay": self.config.replay(),
            "notes": {k: v for k, v in self.notes.items() if k != "rollfleet"},
        }


class Adversary:
    def __init__(self, cfg: Config, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.rng = random.Random(f"runtime:{cfg.seed}")
        self.t0 = 0.0
        self.events_journal = Journal(workdir / "events.jsonl")
        # Children import rollfleet and reliability as this process does: from the shim of
        # --code, or from this checkout.
        paths = [os.environ.get("RF_ADV_SHIM") or str(REPO), os.environ.get("PYTHONPATH", "")]
        self.child_env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        self.machine = Machine(
            workdir,
            namespace=NAMESPACE,
            seed=cfg.seed,
            auth=cfg.auth,
            child_env=self.child_env,
            cwd=_child_cwd(),
            cluster=cfg.cluster,
        )
        self.admin: Any = None
        self.publisher: Any = None
        self.weights: Any = None
        self.tap: Any = None
        self.rogue: Any = None
        self.names: Any = None
        self.publish_lock = asyncio.Lock()
        self.damaged = 0  # version directories hidden or corrupt now
        self.publisher_fault = False  # a publisher process is at work (nothing is hidden meanwhile)
        self.busy: set[str] = set()  # worker ids an event is working on
        self.incarnation = 0
        self._trainer_lock = asyncio.Lock()
        self.node_out: str | None = None  # (``--cluster``) the node a node event has out now
        self.tasks: set[asyncio.Task[Any]] = set()
        self.injected: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        self.retired: set[str] = set()  # worker ids killed for good (their slot is refilled under another id)
        self.keeper: asyncio.Task[None] | None = None
        self.loop_publisher: asyncio.Task[None] | None = None
        self.loop_publishes = 0  # versions published for the trainer's loop (its steps)
        self.kept: list[dict[str, Any]] = []  # workers the fleet keeper started
        self.topology: Any = None
        self.autoscale: Any = None  # (``--autoscale``) reliability.adversary.autoscaler.AutoscaleFleet

    # -- output ------------------------------------------------------------------------------
    def say(self, what: str, /, **fields: Any) -> None:
        record = {"t": round(time.time() - self.t0, 3), "event": what, **fields}
        self.events_journal.write({**record, "wall": time.time()}, sync=False)
        self.machine.timeline.events.append({**record, "wall": time.time()})
        if not self.cfg.quiet:
            print(json.dumps(record, default=str), flush=True)

    # -- set-up ------------------------------------------------------------------------------
    async def setup(self) -> None:
        from reliability.adversary.rogue import Rogue
        from reliability.adversary.tap import Tap
        from reliability.adversary.trainer_weights import TrainerWeights
        from rollfleet.broker.topology import TopologyConfig
        from rollfleet.schemas import Names
        from rollfleet.trainer_client import PolicyPublisher, RolloutClient

        cfg, m = self.cfg, self.machine
        self.names = Names(NAMESPACE)
        base = self.workdir / "base"
        if cfg.hf:
            from rollfleet.models import build_model_dir

            await asyncio.to_thread(build_model_dir, base, "tiny", 0)
        else:
            from harness.weights import write_base_checkpoint

            write_base_checkpoint(base)
        self.weights = TrainerWeights(base, cfg.seed)
        m.start_broker()
        await m.start_links([*ECHO_POOL, *HF_POOL])  # each worker dials the broker through its own link
        if cfg.store == "s3":  # (moto, and each worker reading the bucket through a fault proxy of its own)
            from reliability.adversary.objstore import start_object_store

            await start_object_store(self, [u for u in m.users() if u not in ("trainer", "gateway", ROGUE)])
        self.say("broker", url=m.broker.url if m.broker else "", auth=cfg.auth, monitor=m.monitor_port)
        self.topology = TopologyConfig(
            ack_wait_s=cfg.ack_wait,
            duplicate_window_s=cfg.duplicate_window,
            max_deliver=cfg.max_deliver,
            replicas=cfg.replicas,
        )
        self.admin = await RolloutClient.connect(
            m.url("trainer"), namespace=NAMESPACE, client_id="adversary", topology=self.topology, fail_fast=False
        )
        if m.cluster is not None:  # (the node events mean something only if every stream is R3)
            info = await self.admin.js.stream_info(self.names.jobs_stream)
            replicas = info.config.num_replicas
            self.say("cluster", replicas=replicas, leader=info.cluster.leader if info.cluster else None)
            if replicas != 3:
                raise RuntimeError(f"the jobs stream has {replicas} replicas on the cluster, not 3")
        # A gateway declares what it finds lost as the fleet does: the same ack-wait, window, replicas.
        m.gateway_args = [
            "--ack-wait",
            str(cfg.ack_wait),
            "--duplicate-window",
            str(cfg.duplicate_window),
            "--max-deliver",
            str(cfg.max_deliver),
            *self.replicas_args("--replicas"),
        ]
        for name in GATEWAYS:  # (once the namespace is declared: their start-ups overlap the rest of the setup)
            m.start_gateway(name)
        self.publisher = PolicyPublisher(m.store_arg(), base, keyframe_every=6, keep_last=None)
        await self.publish("setup")
        tap_user = ("tap", m.passwords["tap"]) if cfg.auth else (None, None)
        self.tap = await Tap(m.url(), self.names, m.monitor_ports, user=tap_user[0], password=tap_user[1]).start()
        if cfg.autoscale:
            await self.setup_autoscaled()
            return
        rogue_user = (ROGUE, m.passwords[ROGUE]) if cfg.auth else (None, None)
        self.rogue = await Rogue(
            m.url(),
            self.names,
            worker_id=ROGUE,
            victims=[*ECHO_POOL[: cfg.workers], *HF_POOL[: cfg.hf], *SGLANG_POOL[: cfg.sglang]],
            client_id=TRAINER_ID,
            journal=Journal(self.workdir / "rogue.jsonl"),
            seed=cfg.seed,
            user=rogue_user[0],
            password=rogue_user[1],
        ).start()
        for wid in ECHO_POOL[: cfg.workers]:
            self.start_worker(wid, "echo")
        for wid in HF_POOL[: cfg.hf]:
            self.start_worker(wid, "hf")
        for wid in SGLANG_POOL[: cfg.sglang]:
            self.start_worker(wid, "sglang")
        await self._fleet_ready(cfg.workers + cfg.hf + cfg.sglang, 90.0, "workers did not become ready")
        # Answers stored before the trainer asks: keys a trainer is likely to use.
        from reliability.adversary.load import family_keys, key_families

        # Some seeds' rogue forges nothing at first and copies nothing: what it cannot do then
        # shows the other defects in the clear.
        self.rogue.copy_share = self.rng.choice((0.0, 0.2, 0.2))
        if self.rng.random() < 0.6:
            guesses = [k for base_key in key_families(cfg.seed)[:4] for k in family_keys(base_key)]
            pre = self.rng.sample(guesses, 5)
            self.rogue.latest = 0
            await self.rogue.pre_forge(pre)
            self.say("rogue pre-forged", keys=pre)
        self.say("rogue", copy_share=self.rogue.copy_share)
        await self.rogue.snoop(1.5)  # every run's rogue tries to read the others' deliveries once

    async def setup_autoscaled(self) -> None:
        """(``--autoscale``) a controller sizes the echo fleet: it is started, and the run waits for
        its minimum to serve; no rogue (its promises rest on the auth config this mode has not)."""
        from reliability.adversary.autoscaler import AutoscaleFleet

        cfg = self.cfg
        self.autoscale = AutoscaleFleet(self)
        await self.autoscale.start()
        for wid in HF_POOL[: cfg.hf]:
            self.start_worker(wid, "hf")
        for wid in SGLANG_POOL[: cfg.sglang]:
            self.start_worker(wid, "sglang")
        want = self.autoscale.bounds[0] + cfg.hf + cfg.sglang
        await self._fleet_ready(want, 120.0, "the autoscaler's minimum did not become ready")

    async def _fleet_ready(self, want: int, timeout: float, failure: str) -> None:
        """Wait for ``want`` ready replicas and for every gateway to listen; ``failure`` if not."""
        m = self.machine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len([r for r in self.admin.fleet.replicas() if r.state == "ready"]) >= want:
                break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"{failure}: {[w.how for w in m.timeline.workers]}, see {m.workdir / 'logs'}")
        for name in GATEWAYS:
            gp = m.gateways[name]
            if not await m.gateway_listening(gp):
                raise RuntimeError(f"gateway {name} did not start listening: see {gp.log}")
            self.say("gateway start", gateway=name, pid=gp.proc.pid, address=gp.address)
        self.say("fleet ready", workers=sorted(w.worker_id for w in m.current.values() if w.alive))

    def start_worker(self, wid: str, engine: str, armed: str | None = None, skew_s: float = 0.0) -> WorkerProc:
        if engine == "sglang" and f"engine:{wid}" not in self.busy:
            # Its own server, on the trainer's base (version 0's bytes): started unless running (an
            # engine event that has it down restarts it itself; the worker waits for it).
            es = self.machine.engines.ensure(wid, self.workdir / "base")
            if es.start >= time.time() - 1.0:
                self.say("engine server start", worker=wid, pid=es.proc.pid, port=es.port)
        drain = self.rng.choice(EXACT_DRAINS)
        extra = [
            "--exact-drain",
            str(drain),
            "--ack-wait",
            str(self.cfg.ack_wait),
            "--duplicate-window",
            str(self.cfg.duplicate_window),
            "--max-deliver",
            str(self.cfg.max_deliver),
            "--prepare-timeout",
            "8",
            *self.replicas_args("--replicas"),
        ]
        wp = self.machine.start_worker(wid, engine, extra, armed=armed, skew_s=skew_s)
        self.say(
            "worker start",
            worker=wid,
            engine=engine,
            pid=wp.proc.pid,
            exact_drain=drain,
            armed=armed,
            **({"skew_s": skew_s} if skew_s else {}),
        )
        return wp

    async def node_event(self, kind: str, p: dict[str, Any]) -> bool:
        """A node killed, frozen or cut off (a single broker's restart or pause, on a cluster, is
        a node's): one node at a time, the jobs stream's leader or one at random."""
        m = self.machine
        assert m.cluster is not None
        if self.node_out is not None:
            self.say(f"{kind} skipped", reason=f"node {self.node_out} is out: one at a time keeps a quorum")
            return False
        leader = None
        if p.get("which", "random") == "leader":
            with contextlib.suppress(Exception):
                info = await asyncio.wait_for(self.admin.js.stream_info(self.names.jobs_stream), 2.0)
                leader = m.cluster.by_server_name(info.cluster.leader if info.cluster else None)
        name = m.cluster.pick(self.rng, leader, set())
        if name is None:
            self.say(f"{kind} skipped", reason="no live node")
            return False
        self.node_out = name
        try:
            is_leader = name == leader
            if kind in ("node_kill", "broker_restart"):
                down_s = float(p.get("down_s", 2.0))
                self.say("node SIGKILL", node=name, leader=is_leader, down_s=down_s)
                await m.kill_node(name, down_s, is_leader)
                self.say("node back", node=name)
            elif kind in ("node_pause", "pause_broker"):
                self.say("node SIGSTOP", node=name, leader=is_leader, for_s=p["for_s"])
                await m.pause_node(name, p["for_s"], is_leader)
                self.say("node SIGCONT", node=name)
            else:
                self.say("node cut off", node=name, leader=is_leader, for_s=p["for_s"])
                await m.cut_node(name, p["for_s"], is_leader)
                self.say("node joined again", node=name)
        finally:
            self.node_out = None
        return True

    def replicas_args(self, flag: str = "--stream-replicas") -> list[str]:
        """On a cluster, every process declares what it finds missing as R3 (a stream deleted and
        declared again by whoever notices first stays R3)."""
        return [flag, str(self.cfg.replicas)] if self.cfg.replicas > 1 else []

    def start_trainer(self, duration: float) -> None:
        cfg = self.cfg
        args = [
            "--journal",
            str(self.workdir / "trainer.jsonl"),
            "--seed",
            str(cfg.seed),
            "--duration",
            f"{max(0.0, duration):.1f}",
            "--sessions",
            str(cfg.sessions),
            "--client-id",
            TRAINER_ID,
            "--ack-wait",
            str(cfg.ack_wait),
            "--duplicate-window",
            str(cfg.duplicate_window),
            "--max-deliver",
            str(cfg.max_deliver),
            "--gateways",
            str(self.machine.gateways_file),
            "--gateway-sessions",
            str(cfg.gateway_sessions),
            *(["--loop"] if cfg.loop else []),
            *self.replicas_args(),
        ]
        proc = self.machine.start_trainer(self.incarnation, args)
        self.say("trainer start", incarnation=self.incarnation, pid=proc.pid, duration=round(duration, 1))

    # -- versions ------------------------------------------------------------------------------
    async def publish(self, why: str, *, hide_s: float = 0.0, corrupt_s: float = 0.0) -> int | None:
        """Write the next version, optionally hide its directory or corrupt a shard before the
        commit (a flaky mount; a bad write), commit it, and restore the store after a while.

        After a publisher fault another process may have written the next version's directory (a
        killed one's, committed or not; a race's winner): the publisher refuses to overwrite it
        (``VersionConflict``), rebuilds its state from the store's newest version, and the
        trainer publishes the version after that, from the lineage it adopted."""
        from rollfleet.schemas.errors import VersionConflict

        async with self.publish_lock:
            for attempt in range(3):
                v = 0 if self.publisher.latest_version is None else self.publisher.latest_version + 1
                try:
                    record = await asyncio.to_thread(self.publisher.publish, self.weights.at(v))
                    break
                except VersionConflict as exc:
                    self.say("publish refused", version=v, error=str(exc)[:160], attempt=attempt)
                    if attempt == 2:
                        raise
            hidden = corrupted = None
            if hide_s and v > 0:
                hidden = self.machine.hide(v)
            if corrupt_s and v > 0:
                corrupted = self.machine.corrupt(v, self.rng)
            self.damaged += (hidden is not None) + (corrupted is not None)
            t_start = time.time()
            committed = await self.commit(record)
            if committed:
                self.machine.timeline.commits.append((v, t_start, time.time()))
                self.rogue_latest(v)
            self.say(
                "publish",
                version=v,
                why=why,
                committed=committed,
                hidden=bool(hidden),
                corrupt=str(corrupted[0].name) if corrupted else None,
            )
        if hidden is not None:
            t_hide = time.time()
            await asyncio.sleep(hide_s)
            self.machine.unhide(v)
            self.damaged -= 1
            self.machine.timeline.hidden.append((v, t_hide, time.time()))
            self.say("store dir back", version=v, after_s=round(hide_s, 2))
        if corrupted is not None:
            t_c = time.time()
            await asyncio.sleep(corrupt_s)
            self.machine.restore(*corrupted)
            self.damaged -= 1
            self.machine.timeline.corrupt.append((v, t_c, time.time()))
            self.say("shard restored", version=v, after_s=round(corrupt_s, 2))
        return v

    def rogue_latest(self, v: int) -> None:
        if self.rogue is not None:
            self.rogue.latest = v

    async def commit(self, record: Any) -> bool:
        deadline = time.monotonic() + 20.0
        while True:
            try:
                await asyncio.wait_for(self.admin.commit_version(record), 10.0)
                return True
            except Exception as exc:  # the broker may be restarting: try again, bounded
                # An attempt whose reply was lost may have committed: the policy KV says.
                facts = await self.policy_facts(record.version, timeout=5.0)
                if facts.get("latest") == record.version and facts.get("entry_publisher") == record.publisher:
                    self.say("commit found done", version=record.version, error=repr(exc)[:200])
                    return True
                if time.monotonic() > deadline:
                    self.say("commit failed", version=record.version, error=repr(exc)[:200])
                    return False
                await asyncio.sleep(0.5)

    async def policy_facts(self, version: int, timeout: float = 15.0) -> dict[str, Any]:
        """The policy KV as the broker holds it now, read raw (nats-py, msgpack): ``latest`` and
        the publisher named by ``v.<version>`` (None where absent). Retried while the broker is
        out; ``error`` when it never answered."""
        import msgspec
        import nats.js.errors

        deadline = time.monotonic() + timeout
        while True:
            try:
                kv = await asyncio.wait_for(self.admin.js.key_value(self.names.policy_bucket), 5.0)
                out: dict[str, Any] = {"latest": None, "entry_publisher": None, "entry": False}
                try:
                    latest = await asyncio.wait_for(kv.get("latest"), 5.0)
                    out["latest"] = int(latest.value or b"0")
                except nats.js.errors.KeyNotFoundError:
                    pass
                try:
                    entry = await asyncio.wait_for(kv.get(f"v.{int(version)}"), 5.0)
                    doc = msgspec.msgpack.decode(entry.value or b"")
                    out.update(entry=True, entry_publisher=doc.get("publisher") if isinstance(doc, dict) else None)
                except nats.js.errors.KeyNotFoundError:
                    pass
                return out
            except Exception as exc:
                if time.monotonic() > deadline:
                    return {"error": repr(exc)[:200]}
                await asyncio.sleep(0.5)

    async def store_quiet(self, timeout: float = 15.0) -> bool:
        """Wait until no version directory is hidden or corrupt (a publisher process reads the
        store's newest version: on a store missing one it would take another version for next)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.damaged <= 0:
                break
            await asyncio.sleep(0.2)
        return self.damaged <= 0

    def next_version(self) -> int:
        """The version a fresh publisher writes next: after the store's newest complete one."""
        from rollfleet.policy_store import list_versions

        if self.machine.objstore is not None:
            listed = self.machine.objstore.versions()
            return listed[-1] + 1 if listed else 0
        listed = list_versions(self.machine.store)
        return listed[-1] + 1 if listed else 0

    async def publisher_proc(
        self,
        name: str,
        version: int,
        armed: str | None = None,
        perturb: int | None = None,
        go: Path | None = None,
        go_delay: float = 0.0,
    ) -> Any:
        args = [
            "--base",
            str(self.workdir / "base"),
            "--client-id",
            f"publisher-{name}",
            "--keyframe-every",
            "6",
            "--trainer-seed",
            str(self.cfg.seed),
            "--adopted",
            json.dumps(self.weights.adopted),
            "--publisher",
            name,
            "--expect-version",
            str(version),
            # (the fleet's topology: the consumers this commit declares redeliver after its ack-wait)
            "--ack-wait",
            str(self.cfg.ack_wait),
            "--duplicate-window",
            str(self.cfg.duplicate_window),
            "--max-deliver",
            str(self.cfg.max_deliver),
            *self.replicas_args(),
        ]
        if perturb is not None:
            args += ["--perturb", str(perturb)]
        if go is not None:
            args += ["--go-file", str(go), "--go-delay", str(go_delay)]
        return self.machine.start_publisher(name, args, armed=armed)

    async def publishers_ready(self, names: list[str], procs: list[Any], timeout: float = 40.0) -> bool:
        """Whether every publisher process printed READY (it read the store), waiting at most ``timeout``."""
        logs = [self.workdir / "logs" / f"publisher.{name}.log" for name in names]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(log.is_file() and b"READY " in log.read_bytes() for log in logs):
                return True
            if any(proc.poll() is not None for proc in procs):
                return False
            await asyncio.sleep(0.05)
        return False

    async def wait_proc(self, proc: Any, timeout: float = 45.0) -> int | None:
        """A publisher process's exit code (-9: SIGKILLed by its fault); None: it hung, and was killed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        if proc.poll() is None:
            from rollfleet.runtime.processes import terminate

            terminate(proc, 5.0, signal.SIGKILL)
            return None
        return int(proc.returncode)

    async def publisher_kill(self, p: dict[str, Any]) -> bool:
        """The next version published by a separate process armed with ``kill:<point>``; the
        policy KV read before and after says whether it was committed (past ``latest``'s CAS)."""
        from rollfleet.runtime import faults

        if p["point"] not in faults.POINTS:
            self.say("publisher kill skipped", point=p["point"], reason="no such fault point in this code")
            return False
        async with self.publisher_event("publisher kill") as v:
            if v is None:
                return False
            name = f"killed-v{v}-{len(self.machine.timeline.publishers)}"
            before, t0 = await self.policy_facts(v), time.time()
            proc = await self.publisher_proc(name, v, armed=f"kill:{p['point']}")
            self.say("publisher armed", version=v, point=p["point"], publisher=name, pid=proc.pid)
            code = await self.wait_proc(proc)
            after = await self.record_publishers(
                "kill", v, before, t0, point=p["point"], publisher=name, pid=proc.pid, code=code
            )
            self.say(
                "publisher killed" if code == -signal.SIGKILL else "publisher not killed",
                version=v,
                point=p["point"],
                code=code,
                latest=after.get("latest"),
                entry=after.get("entry_publisher"),
            )
        await asyncio.sleep(p["then_after"])
        await self.publish("after a killed publisher")
        return code == -signal.SIGKILL

    async def publisher_race(self, p: dict[str, Any]) -> bool:
        """Two processes publish the same next version, one the trainer's tensors, the other a
        perturbed copy. The winner is what the policy KV's ``v.<N>`` names; if it is the
        perturbed one, the trainer adopts it: its next publish (the trainer's own publisher finds
        the winner's directory, rebuilds its state from it) builds on those bytes. (No publish of
        its own follows: two versions at once would move every replica's window of ``min``
        subjects on faster than the schedule's publishes do.)"""
        async with self.publisher_event("publisher race") as v:
            if v is None:
                return False
            contenders = {"trainer": f"race-v{v}-trainer", "perturbed": f"race-v{v}-perturbed-{p['salt']}"}
            before = await self.policy_facts(v)
            order = list(contenders)
            self.rng.shuffle(order)
            t0 = time.time()
            procs = {}
            go = self.workdir / f"race-v{v}.go"
            for who in order:
                procs[who] = await self.publisher_proc(
                    contenders[who],
                    v,
                    perturb=p["salt"] if who == "perturbed" else None,
                    go=go,
                    go_delay=float(p.get("late_s", 0.0)) if who == p.get("late") else 0.0,
                )
            # Both have read the store (and computed their tensors) before either writes: they
            # race through the writer's rename and the KV's create of v.<N>.
            ready = await self.publishers_ready([contenders[who] for who in order], list(procs.values()))
            go.touch()
            self.say(
                "publishers racing",
                version=v,
                contenders=contenders,
                pids={k: pr.pid for k, pr in procs.items()},
                ready=ready,
            )
            codes = {who: await self.wait_proc(pr, 60.0) for who, pr in procs.items()}
            pids = {k: pr.pid for k, pr in procs.items()}
            after = await self.record_publishers(
                "race", v, before, t0, salt=p["salt"], contenders=contenders, pids=pids, codes=codes
            )
            won = next((who for who, name in contenders.items() if name == after.get("entry_publisher")), None)
            if won == "perturbed":
                # The trainer goes on from what was committed (as a trainer that lost a race
                # would reload the winner's weights).
                self.weights = self.weights.adopting({**self.weights.adopted, v: int(p["salt"])})
            self.say("publisher race over", version=v, won=won, codes=codes, latest=after.get("latest"))
        return won is not None

    @contextlib.asynccontextmanager
    async def publisher_event(self, what: str) -> AsyncIterator[int | None]:
        """A publisher event's hold on publishing: the next version to publish, or None when the
        event is skipped (a version hidden or corrupt, or nothing committed yet)."""
        async with self.publish_lock:
            self.publisher_fault = True
            try:
                if not await self.store_quiet():
                    self.say(f"{what} skipped", reason="a version is hidden or corrupt")
                    yield None
                    return
                v = self.next_version()
                yield v if v != 0 else None
            finally:
                self.publisher_fault = False

    async def record_publishers(
        self, kind: str, v: int, before: dict[str, Any], t0: float, **fields: Any
    ) -> dict[str, Any]:
        """The policy KV's facts after a publisher event, in the timeline the oracle reads."""
        t1 = time.time()
        after = await self.policy_facts(v)
        self.machine.timeline.publishers.append(
            {
                "kind": kind,
                "version": v,
                **fields,
                "t_start": t0,
                "t_end": t1,
                "latest_before": before.get("latest"),
                "latest_after": after.get("latest"),
                "entry_publisher": after.get("entry_publisher"),
                "error": after.get("error") or before.get("error"),
            }
        )
        if after.get("latest") == v:
            self.rogue_latest(v)
        return after

    async def publish_loop_steps(self) -> None:
        """The trainer's loop asks for the next version after each batch (a ``loop_step`` record in
        its journal, ``reliability.adversary.loop_load``): published and committed here, from the
        trainer's weights as every version is, at most one every ``LOOP_PUBLISH_GAP_S``."""
        from reliability.adversary.loop_load import LOOP_PUBLISH_GAP_S

        path = self.workdir / "trainer.jsonl"
        offset, asked, last = 0, 0, 0.0
        while True:
            await asyncio.sleep(0.2)
            try:
                chunk = _read_from(path, offset)
            except OSError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]  # (a line still being written is read next time)
            offset += len(whole)
            asked += whole.count(b'"ev":"loop_step"')
            if asked and time.monotonic() - last >= LOOP_PUBLISH_GAP_S:
                asked, last = 0, time.monotonic()
                try:
                    await self.publish("loop step")
                    self.loop_publishes += 1
                except Exception as exc:  # (the broker away: the loop's next step asks again)
                    self.say("loop step publish failed", error=repr(exc)[:200])

    # -- choosing victims ------------------------------------------------------------------------
    def holders(self, mode: str) -> list[str]:
        """Workers that hold (were delivered, have not acked or handed back) a job of ``mode``."""
        now = time.time()
        out: list[str] = []
        claim_ttl = max(self.cfg.duplicate_window, self.cfg.ack_wait * self.cfg.max_deliver)
        for d in self.tap.deliveries[-400:]:
            if d.worker is None or any(k in ("+ACK", "-NAK", "+TERM") for _, k in self.tap.acks.get(d.ack, [])):
                continue
            if mode == "session" and d.session_id is None:
                continue
            if mode == "session-long" and (d.session_id is None or d.max_tokens < 300 or now - d.t > 0.6):
                continue  # a long turn that started just now: it runs on for a second or more
            if mode == "exact" and (d.constraint is None or d.constraint[0] != "exact"):
                continue
            if mode == "large" and d.max_tokens < 1400:
                continue
            if mode == "long" and not (d.retry == "at_most_once" and now - d.t > claim_ttl + 0.5):
                continue
            out.append(d.worker)
        return out

    async def victim(self, mode: str, engine: str | None = None, own: bool = False) -> WorkerProc | None:
        """A live worker to hit (``own``: only one the harness started, which it may start again)."""
        m = self.machine
        candidates = [w for w in m.alive_workers(engine) if w.worker_id not in self.busy]
        if own:
            candidates = [w for w in candidates if not w.autoscaled]
        if mode != "random":
            deadline = time.monotonic() + {"long": 12.0, "session-long": 8.0}.get(mode, 0.0)
            while True:
                held = set(self.holders(mode))
                chosen = [w for w in candidates if w.worker_id in held and w.alive]
                if chosen or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.1)
            if chosen:
                candidates = chosen
        candidates = [w for w in candidates if w.alive]
        return self.rng.choice(candidates) if candidates else None

    def enough_left(self, excluding: str) -> bool:
        return len([w for w in self.machine.alive_workers("echo") if w.worker_id != excluding]) >= 1

    async def restart(self, wp: WorkerProc, after: float, same_id: bool) -> None:
        if wp.autoscaled:
            return  # (its controller replaces it: a worker the harness started under its id would be no one's)
        await asyncio.sleep(after)
        wid = wp.worker_id if same_id else (self.machine.free_id(wp.engine, self.rng) or wp.worker_id)
        cur = self.machine.current.get(wid)
        if cur is not None and cur.alive:
            return
        self.start_worker(wid, wp.engine)

    async def keep_fleet(self) -> None:
        """Keep the fleet at its size, as a container restart policy does: a slot whose process
        ended (killed and not restarted by its event, or exited on its own) is filled again after
        ``KEEP_AFTER_S``, under the same id if it exited on its own (a crash-looping worker keeps
        being restarted: the oracle's ``available`` sees a fleet that does not serve), else under
        a free id (a retired one stays dead)."""
        m = self.machine
        short_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(0.5)
            m.reap()
            self.keep_gateways(short_since)
            for engine, size, pool in (
                ("echo", 0 if self.cfg.autoscale else self.cfg.workers, ECHO_POOL),  # (else the controller's)
                ("hf", self.cfg.hf, HF_POOL),
                ("sglang", self.cfg.sglang, SGLANG_POOL),
            ):
                present = {w.worker_id for w in m.current.values() if w.engine == engine and w.alive}
                present |= {b for b in self.busy if b in pool}
                if len(present) >= size:
                    short_since.pop(engine, None)
                    continue
                since = short_since.setdefault(engine, time.monotonic())
                if time.monotonic() - since < KEEP_AFTER_S:
                    continue
                ended = [
                    w
                    for w in m.current.values()
                    if w.engine == engine
                    and not w.alive
                    and w.worker_id not in present
                    and w.worker_id not in self.retired
                ]
                crashed = [w.worker_id for w in ended if w.how.startswith("exited")]
                free = [
                    w
                    for w in pool
                    if w not in present
                    and w not in self.retired
                    and w not in crashed
                    and not (w in m.current and m.current[w].alive)
                ]
                for _ in range(size - len(present)):
                    wid = crashed.pop(0) if crashed else (free.pop(self.rng.randrange(len(free))) if free else None)
                    if wid is None:
                        break
                    before = m.current.get(wid)
                    self.kept.append(
                        {
                            "t": round(time.time() - self.t0, 2),
                            "worker": wid,
                            "previous": before.how if before else None,
                        }
                    )
                    self.start_worker(wid, engine)
                    self.say("fleet kept at size", worker=wid, previous=before.how if before else None)
                short_since.pop(engine, None)

    def keep_gateways(self, short_since: dict[str, float]) -> None:
        """A gateway that exited on its own (no event has it) is started again after
        ``KEEP_AFTER_S``, as a restart policy would (an exit at start, the broker not ready, left
        the HTTP path dead for the rest of a run: campaign seed 8, ``--cluster``)."""
        m = self.machine
        for name in GATEWAYS:
            gp = m.gateways.get(name)
            if gp is None or gp.alive or name in self.busy:
                short_since.pop(f"gateway:{name}", None)
                continue
            since = short_since.setdefault(f"gateway:{name}", time.monotonic())
            if time.monotonic() - since < KEEP_AFTER_S:
                continue
            short_since.pop(f"gateway:{name}", None)
            if gp.end is None:
                gp.end, gp.how = time.time(), f"exited {gp.proc.returncode}"
                m.write_gateways()
            fresh = m.start_gateway(name)
            self.kept.append({"t": round(time.time() - self.t0, 2), "gateway": name, "previous": gp.how})
            self.say("gateways kept", gateway=name, previous=gp.how, pid=fresh.proc.pid)
            self.spawn(m.gateway_listening(fresh))

    # -- the events -------------------------------------------------------------------------------
    async def run_event(self, ev: Event) -> bool:
        """Inject one event; False if it was skipped (nothing to do it to)."""
        p = ev.params
        m = self.machine
        if ev.kind == "publish":
            await self.publish("publish")
        elif ev.kind == "burst":
            for _ in range(p["count"]):
                await self.publish("burst")
        elif ev.kind == "publish_hidden":
            await self.publish("hidden", hide_s=p["for_s"])
        elif ev.kind == "corrupt":
            await self.publish("corrupt", corrupt_s=p["for_s"])
        elif ev.kind == "hide":
            committed = [v for v, _, _ in m.timeline.commits if v > 0]
            if not committed or self.publisher_fault:
                return False
            v = committed[-1] if p["which"] == "latest" else self.rng.choice(committed[-3:])
            if m.hide(v) is None:
                return False
            self.damaged += 1
            self.say("store dir gone", version=v, for_s=p["for_s"])
            t = time.time()
            await asyncio.sleep(p["for_s"])
            m.unhide(v)
            self.damaged -= 1
            m.timeline.hidden.append((v, t, time.time()))
            self.say("store dir back", version=v)
        elif ev.kind == "slow_reads":
            if m.objstore is not None:  # (the pre-read hook reads files; a bucket's slow reads are store_lag)
                self.say("slow reads skipped", reason="--store s3: the hook is never called for a bucket")
                return False
            t = time.time()
            m.set_slow(p["seconds"])
            self.say("slow reads", seconds=p["seconds"], for_s=p["for_s"])
            await asyncio.sleep(p["for_s"])
            m.set_slow(None)
            m.timeline.slow.append((p["seconds"], t, time.time()))
            self.say("reads fast again")
        elif ev.kind in ("kill", "term"):
            wp = await self.victim(p["victim"], "hf" if p.get("hf") and self.cfg.hf else None)
            if wp is None:
                self.say(f"{ev.kind} skipped", reason="no victim")
                return False
            self.busy.add(wp.worker_id)
            try:
                if ev.kind == "kill":
                    m.kill_worker(wp)
                    self.say("SIGKILL worker", worker=wp.worker_id, victim=p["victim"])
                else:
                    self.say("SIGTERM worker", worker=wp.worker_id, victim=p["victim"])
                    await m.term_worker(wp)
                    self.say("worker drained", worker=wp.worker_id, how=wp.how, code=wp.proc.returncode)
                if p["restart"] or not self.enough_left(wp.worker_id):
                    await self.restart(wp, p["after"], p["same_id"])
            finally:
                self.busy.discard(wp.worker_id)
        elif ev.kind == "fault":
            return await self.fault(p)
        elif ev.kind == "pause_worker":
            wp = await self.victim(p["victim"])
            if wp is None:
                self.say("pause skipped", reason="no victim")
                return False
            self.busy.add(wp.worker_id)  # (no other event, nor the fleet keeper, touches it meanwhile)
            try:
                self.say("SIGSTOP worker", worker=wp.worker_id, victim=p["victim"], for_s=p["for_s"])
                await m.pause_worker(wp, p["for_s"])
                self.say("SIGCONT worker", worker=wp.worker_id)
            finally:
                self.busy.discard(wp.worker_id)
        elif ev.kind in ("partition", "lag", "cut_link"):
            wp = await self.victim(p["victim"])
            link = m.links.get(wp.worker_id) if wp is not None else None
            if wp is None or link is None:
                self.say(f"{ev.kind} skipped", reason="no victim")
                return False
            self.busy.add(wp.worker_id)
            try:
                t0 = time.time()
                if ev.kind == "partition":
                    self.say("link stalled", worker=wp.worker_id, direction=p["direction"], for_s=p["for_s"])
                    await link.stall(p["direction"], p["for_s"])
                    # (the oracle treats it as a pause: the worker ran on, unheard or deaf)
                    wp.stops.append([t0, time.time()])
                    self.say("link healed", worker=wp.worker_id)
                elif ev.kind == "lag":
                    self.say("link lagging", worker=wp.worker_id, seconds=p["seconds"], for_s=p["for_s"])
                    await link.lag(p["seconds"], p["for_s"])
                    self.say("link fast again", worker=wp.worker_id)
                else:
                    link.cut()
                    self.say("link cut", worker=wp.worker_id)
            finally:
                self.busy.discard(wp.worker_id)
        elif ev.kind == "skew":
            if faketime_library() is None:
                self.say("skew skipped", reason="no libfaketime (Debian's faketime package)")
                return False
            wp = await self.victim(p["victim"], own=True)
            if wp is None:
                self.say("skew skipped", reason="no victim")
                return False
            self.busy.add(wp.worker_id)
            try:
                self.say("SIGTERM worker", worker=wp.worker_id, victim=p["victim"], why="skew")
                await m.term_worker(wp)
                self.start_worker(wp.worker_id, wp.engine, skew_s=p["skew_s"])
            finally:
                self.busy.discard(wp.worker_id)
        elif m.cluster is not None and ev.kind in ("pause_broker", "broker_restart", *NODE_KINDS):
            return await self.node_event(ev.kind, p)
        elif m.cluster is not None and ev.kind in ("broker_rollback", "broker_wipe"):
            self.say(f"{ev.kind} skipped", reason="a single broker's store fault (a cluster's nodes: node events)")
            return False
        elif ev.kind == "pause_broker":
            if m.broker is None or not m.broker.alive():
                return False
            self.say("broker SIGSTOP", for_s=p["for_s"])
            await m.pause_broker(p["for_s"])
            self.say("broker SIGCONT")
        elif ev.kind == "broker_restart":
            self.say("broker SIGKILL", down_s=p["down_s"])
            await m.restart_broker(p["down_s"])
            self.say("broker back")
        elif ev.kind == "delete_consumer":
            return await self.delete_consumer(p["which"])
        elif ev.kind in ("broker_rollback", "broker_wipe", "delete_stream"):
            from reliability.adversary import broker_store

            return bool(await getattr(broker_store, ev.kind)(self, p))
        elif ev.kind == "trainer_kill":
            if self._trainer_lock.locked():  # (one trainer kill and restart at a time: never two trainers)
                self.say("trainer kill skipped", why="another one under way")
                return False
            async with self._trainer_lock:
                if not m.trainer_alive() or self.incarnation >= 2:
                    self.say("trainer kill skipped")
                    return False
                holder = await self.victim("session-long") if p.get("with_holder") else None
                if not m.trainer_alive():
                    self.say("trainer kill skipped", why="the trainer ended meanwhile")
                    return False
                m.kill_trainer()
                self.say("SIGKILL trainer", incarnation=self.incarnation)
                if holder is not None and self.enough_left(holder.worker_id):
                    # The replica holding the dead trainer's turn goes too, for good: its id is
                    # retired (the fleet keeper refills the slot under another id).
                    self.retired.add(holder.worker_id)
                    m.kill_worker(holder)
                    self.say("SIGKILL worker", worker=holder.worker_id, victim="holder of the dead trainer's turn")
                await asyncio.sleep(p["after"])
                self.incarnation += 1
                self.start_trainer(self.cfg.duration - (time.time() - self.t0))
        elif ev.kind == "second_client":
            return await self.second_client()
        elif ev.kind in ("gateway_kill", "gateway_pause", "gateway_restart"):
            return await self.gateway_fault(ev.kind, p)
        elif ev.kind in ENGINE_KINDS:
            return await engine_event(self, ev.kind, p)
        elif ev.kind in AUTOSCALER_KINDS:
            return await autoscaler_event(self, ev.kind, p)
        elif ev.kind in ("store_truncate", "store_drop", "store_lag"):
            from reliability.adversary.objstore import store_event

            return await store_event(self, ev.kind, p)
        elif ev.kind in ("disk_full", "disk_readonly"):
            from reliability.adversary.disks import disk_event

            return await disk_event(self, ev.kind, p)
        elif ev.kind == "publisher_kill":
            return await self.publisher_kill(p)
        elif ev.kind == "publisher_race":
            return await self.publisher_race(p)
        elif ev.kind in ("snoop", "forge") and self.rogue is None:
            self.say(f"{ev.kind} skipped", reason="no rogue in this run (--autoscale runs without auth)")
            return False
        elif ev.kind == "snoop":
            self.say("rogue snooping", for_s=p["for_s"])
            await self.rogue.snoop(p["for_s"])
            self.say("rogue stopped snooping", read=self.rogue.snooped)
        elif ev.kind == "forge":
            from reliability.adversary.load import family_keys, key_families

            keys = [k for b in key_families(self.cfg.seed) for k in family_keys(b)]
            seen = [d.key for d in self.tap.deliveries if d.key and d.key.startswith("job-")]
            if seen:
                inc, _, n = seen[-1].rpartition("-")
                keys += [f"{inc}-{int(n) + i}" for i in range(3, 7) if n.isdigit()]
            chosen = self.rng.sample(keys, min(len(keys), p["count"]))
            await self.rogue.pre_forge(chosen)
            self.say("rogue forged", keys=chosen)
        return True

    async def fault(self, p: dict[str, Any]) -> bool:
        """Restart a worker armed with ``pause:<point>``; once it stops there, SIGKILL it."""
        from rollfleet.runtime import faults

        m = self.machine
        if p["point"] not in faults.POINTS:  # (a point this tree does not have)
            self.say("fault skipped", point=p["point"], reason="no such fault point in this code")
            return False
        wp = await self.victim("random", "echo", own=True)
        if wp is None or not self.enough_left(wp.worker_id):
            self.say("fault skipped", point=p["point"])
            return False
        self.busy.add(wp.worker_id)
        try:
            m.kill_worker(wp)
            armed = self.start_worker(wp.worker_id, "echo", armed=f"pause:{p['point']}")
            self.say("armed", worker=wp.worker_id, point=p["point"])
            if p["point"] in (
                "worker:mid-drain",
                "worker:mid-activation",
                "worker:before-activation",
                "worker:after-materialize",
                "worker:mid-prepare",
            ):
                await asyncio.sleep(4.0)  # registered and serving first, then a version to prepare
                self.spawn(self.publish(f"to reach {p['point']}"))
            reached = await m.wait_paused(armed, FAULT_WAIT_S)
            if reached:
                await asyncio.sleep(p["hold_s"])
                m.kill_worker(armed, "killed at fault point")
                self.say("SIGKILL at fault point", worker=wp.worker_id, point=p["point"])
            else:
                await m.term_worker(armed, 10.0)
                self.say("fault point not reached", worker=wp.worker_id, point=p["point"])
            await self.restart(armed, p["after"], True)
        finally:
            self.busy.discard(wp.worker_id)
        return True

    async def delete_consumer(self, which: str) -> bool:
        js = self.tap.nc.jetstream(timeout=5)
        stream = self.names.jobs_stream
        try:
            infos = await js.consumers_info(stream)
        except Exception as exc:
            self.say("consumer deletion skipped", error=repr(exc)[:120])
            return False
        names = sorted(i.name for i in infos)
        latest = self.publisher.latest_version or 0
        if which == "latest-min" and f"min-{latest}" in names:
            target = f"min-{latest}"
        elif which == "latest-exact" and f"exact-{latest}" in names:
            target = f"exact-{latest}"
        elif which == "replica":
            target = self.rng.choice([n for n in names if n.startswith("replica-")] or names or [""])
        else:
            target = self.rng.choice([n for n in names if not n.startswith("replica-")] or names or [""])
        if not target:
            return False
        try:
            await js.delete_consumer(stream, target)
            self.machine.timeline.consumers_deleted.append((time.time(), target))
            self.say("consumer deleted", consumer=target, stream=stream)
        except Exception as exc:
            self.say("consumer deletion failed", consumer=target, error=repr(exc)[:120])
            return False
        return True

    async def gateway_fault(self, kind: str, p: dict[str, Any]) -> bool:
        """SIGKILL one gateway (or SIGTERM it: a rolling restart) and start it again (on a new port,
        which the trainer reads from the gateways file) ``after`` s later, or freeze it (SIGSTOP)
        for ``for_s`` s."""
        m = self.machine
        name = GATEWAYS[int(p["which"]) % len(GATEWAYS)]
        gp = m.gateways.get(name)
        if gp is None or not gp.alive or name in self.busy:
            self.say(f"{kind} skipped", gateway=name, reason="not running, or another event has it")
            return False
        self.busy.add(name)
        try:
            if kind == "gateway_pause":
                self.say("SIGSTOP gateway", gateway=name, for_s=p["for_s"])
                await m.pause_gateway(gp, p["for_s"])
                self.say("SIGCONT gateway", gateway=name)
                return True
            if kind == "gateway_restart":
                self.say("SIGTERM gateway", gateway=name, pid=gp.proc.pid)
                await m.term_gateway(gp)
                self.say("gateway stopped", gateway=name, how=gp.how, code=gp.proc.returncode)
            else:
                m.kill_gateway(gp)
                self.say("SIGKILL gateway", gateway=name, pid=gp.proc.pid)
            await asyncio.sleep(p["after"])
            fresh = m.start_gateway(name)
            listening = await m.gateway_listening(fresh)
            self.say("gateway start", gateway=name, pid=fresh.proc.pid, address=fresh.address, listening=listening)
        finally:
            self.busy.discard(name)
        return True

    async def second_client(self) -> bool:
        """A second client with the trainer's client_id while the trainer runs: refused, or a finding."""
        from rollfleet.trainer_client import RolloutClient

        m = self.machine
        if not m.trainer_alive():
            self.say("second client skipped", reason="trainer not running")
            return False
        record: dict[str, Any] = {"t": time.time(), "trainer_incarnation": self.incarnation}
        try:
            client = await asyncio.wait_for(
                RolloutClient.connect(
                    m.url("trainer"), namespace=NAMESPACE, client_id=TRAINER_ID, topology=self.topology
                ),
                20.0,
            )
        except Exception as exc:
            record.update(describe_error(exc))
        else:
            record.update(kind="connected", t_connected=time.time())
            await client.close()
            record["t_closed"] = time.time()
        record["trainer_alive"] = m.trainer_alive()
        m.timeline.second_clients.append(record)
        self.say("second client", outcome=record.get("cls", record.get("kind")))
        return True

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def guarded(self, ev: Event) -> None:
        try:
            done = await asyncio.wait_for(self.run_event(ev), 90.0)
        except Exception as exc:
            self.say("event failed", kind=ev.kind, error=repr(exc)[:300])
            done = False
        # Counted once it did something: a skipped or failed event injected nothing.
        tally = self.injected if done else self.skipped
        tally[ev.kind] = tally.get(ev.kind, 0) + 1

    # -- the run -------------------------------------------------------------------------------
    async def run(self) -> Report:
        cfg = self.cfg
        report = Report(config=cfg, workdir=str(self.workdir))
        import rollfleet

        report.notes["rollfleet"] = os.path.realpath(os.path.dirname(rollfleet.__file__))
        schedule = make_schedule(
            cfg.seed,
            cfg.duration,
            hf=bool(cfg.hf),
            name=cfg.schedule,
            sglang=bool(cfg.sglang),
            store=cfg.store,
            cluster=cfg.cluster,
            autoscale=bool(cfg.autoscale),
        )
        t_start = time.monotonic()
        self.t0 = time.time()
        self.say(
            "run",
            seed=cfg.seed,
            duration=cfg.duration,
            rollfleet=report.notes["rollfleet"],
            replay=cfg.replay(),
            workdir=str(self.workdir),
        )
        self.say("schedule", events=[[round(e.t, 2), e.kind, e.params] for e in schedule])
        try:
            await self.setup()
            self.t0 = time.time()  # event times count from here, as the schedule does
            self.keeper = asyncio.ensure_future(self.keep_fleet())
            self.loop_publisher = asyncio.ensure_future(self.publish_loop_steps())
            self.start_trainer(cfg.duration)
            for ev in schedule:
                await asyncio.sleep(max(0.0, self.t0 + ev.t - time.time()))
                self.machine.reap()
                self.say("inject", kind=ev.kind, **ev.params)
                self.spawn(self.guarded(ev))
            await asyncio.sleep(max(0.0, self.t0 + cfg.duration - time.time()))
            await self.settle()
            finals = await self.reask_all()
            finals.update(await self.reask_gateway_turns())
            if self.autoscale is not None:
                await self.autoscale.reask_bursts()
                await self.autoscale.quiet_tail()
                self.machine.timeline.autoscale = self.autoscale.facts(self.t0)
            report.notes.update(await self.collect_notes())
            from reliability.adversary.oracle import Oracle, save_inputs

            stored = await self.tap.stored_answers()
            activations = await self.tap.stored_activations()
            await self.tap.described()
            log_lines = self.machine.broker_log().splitlines()
            broker_log = "\n".join(line for line in log_lines if "Violation" in line)
            with contextlib.suppress(Exception):
                save_inputs(
                    self.workdir / "oracle.json",
                    cfg=cfg,
                    timeline=self.machine.timeline,
                    finals=finals,
                    stored=stored,
                    activations=activations,
                    broker_log=broker_log,
                )
            oracle = Oracle(
                cfg=cfg,
                timeline=self.machine.timeline,
                tap=self.tap,
                trainer=Journal.read(self.workdir / "trainer.jsonl"),
                rogue=Journal.read(self.workdir / "rogue.jsonl"),
                finals=finals,
                stored=stored,
                activations=activations,
                weights=self.weights,
                names=self.names,
                broker_log=broker_log,
            )
            report.violations = oracle.judge()
            report.checks = dict(oracle.checks)
            report.unverified = dict(oracle.unverified)
            report.notes.update(oracle.notes)
        except Exception as exc:
            import traceback

            report.crashed = f"{type(exc).__name__}: {exc}"
            report.notes["traceback"] = traceback.format_exc()[-3000:]
        finally:
            await self.close()
            report.seconds = time.monotonic() - t_start
            report.events = sum(self.injected.values())
            report.events_by_kind = dict(sorted(self.injected.items()))
            report.events_skipped = dict(sorted(self.skipped.items()))
        return report

    async def settle(self) -> None:
        """No more events; let what is running finish, heal the store, keep a fleet, and wait for
        the trainer to resolve (or journal as hung) everything it asked."""
        m = self.machine
        deadline = time.monotonic() + 60.0
        while self.tasks and time.monotonic() < deadline:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for task in list(self.tasks):
            task.cancel()
        m.heal_store()
        if m.cluster is not None:
            for name, node in m.cluster.nodes.items():
                if not node.alive():
                    m.cluster.start_node(name)
        elif m.broker is not None and not m.broker.alive():
            m.broker.start()
        m.reap()
        if self.autoscale is not None:
            self.autoscale.keep_one()
        while len(m.alive_workers("echo")) < 2 and self.autoscale is None:
            wid = m.free_id("echo", self.rng)
            if wid is None:
                break
            self.start_worker(wid, "echo")
        m.note_trainer_exit()
        done = any(r.get("ev") == "done" for r in Journal.read(self.workdir / "trainer.jsonl"))
        if not m.trainer_alive() and not done:
            self.incarnation += 1
            self.start_trainer(0.0)  # the restarted trainer recovers what it journaled, then stops
        self.say("settling", trainer_alive=m.trainer_alive())
        deadline = time.monotonic() + 170.0
        while time.monotonic() < deadline:
            if not m.trainer_alive():
                break
            await asyncio.sleep(0.5)
        if m.trainer_alive():
            m.kill_trainer()
            self.say("trainer did not finish; killed")
        m.note_trainer_exit()
        if self.loop_publisher is not None:  # (the loop's last batches are asked with its steps published)
            self.loop_publisher.cancel()
        self.say("trainer finished", code=m.trainer.returncode if m.trainer else None)
        from reliability.adversary.objstore import watch_after_heal

        await watch_after_heal(self)  # (--store s3: the last heal's bound watched to its end)
        from reliability.adversary.disks import watch_after_disks

        await watch_after_disks(self)  # (replicas whose disk came back, until they caught up)

    async def reask_all(self) -> dict[str, dict[str, Any]]:
        """A fresh client with the trainer's client_id asks ``result(key)`` for every key that was
        answered with a result or a stored failure: the same answer must come back. A key the
        trainer sent through a gateway is asked by a client with the gateways' id (a shared one):
        keys of different client ids are different keys."""
        keys: dict[str, set[str]] = {}  # client id -> its keys (a gateway's calls are the gateways' client's)
        for r in Journal.read(self.workdir / "trainer.jsonl"):
            if r.get("ev") == "answer":
                keys.setdefault(r.get("client") or TRAINER_ID, set()).add(r.get("idem_key") or r["key"])
        out: dict[str, dict[str, Any]] = {}
        await asyncio.gather(*(self._reask(client_id, its_keys, out) for client_id, its_keys in sorted(keys.items())))
        self.say("re-asked", keys=len(out))
        return out

    async def reask_gateway_turns(self) -> dict[str, dict[str, Any]]:
        """Every keyed trajectory turn the gateways answered 200 (``gateway_load``), asked again at the
        end with its key, its body and its ``X-Session-Id`` through each gateway up now (one that
        was restarted since included): its one answer must come back, however far its session went
        on meanwhile. In the finals as ``gw:<key>@<gateway>``, of kind ``http-result``,
        ``http-error`` or ``http-none`` (no response within the gateway's own time-out, and 5 s):
        judged by ``oracle_gateway`` alone."""
        import aiohttp

        from reliability.adversary.journal import http_answer
        from reliability.adversary.machine import GATEWAY_TIMEOUT_S

        records = Journal.read(self.workdir / "trainer.jsonl")
        calls = {r["rid"]: r for r in records if r.get("ev") == "gw_call"}
        asked: dict[str, tuple[str, dict[str, Any]]] = {}
        for r in records:
            if r.get("ev") == "gw_try" and r.get("key") and r.get("status") == 200 and r.get("rid") in calls:
                call = calls[r["rid"]]
                if call.get("traj") and call.get("kind") == "turn":
                    asked.setdefault(r["key"], (call["traj"], {**call["body"], "input_ids": r["input_ids"]}))
        out: dict[str, dict[str, Any]] = {}
        gateways = {n: g.address for n, g in sorted(self.machine.gateways.items()) if g.alive and g.address}
        if not asked or not gateways:
            return out
        sem = asyncio.Semaphore(8)

        async def one(http: Any, key: str, traj: str, body: dict[str, Any], name: str, address: str) -> None:
            headers = {"Idempotency-Key": key, "X-Session-Id": traj}
            wait = aiohttp.ClientTimeout(total=GATEWAY_TIMEOUT_S + 5.0)
            async with sem:
                t = time.time()
                try:
                    async with http.post(f"{address}/generate", json=body, headers=headers, timeout=wait) as resp:
                        got = http_answer(resp.status, await resp.json(content_type=None))
                    # (kind "http-...": the oracle's other checks take the finals' results for the clients')
                    out[f"gw:{key}@{name}"] = {**got, "kind": f"http-{got['kind']}", "t": t}
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    out[f"gw:{key}@{name}"] = {"kind": "http-none", "error": repr(exc)[:200], "t": t,
                                               "waited_s": round(time.time() - t, 3)}  # fmt: skip

        async def trajectory(http: Any, traj: str, name: str, address: str) -> None:
            # (a gateway runs a trajectory's turns one at a time: its keys are asked in turn, so
            # that one waits no longer than its own answer takes)
            for key, (of, body) in sorted(asked.items()):
                if of == traj:
                    await one(http, key, traj, body, name, address)

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(
                *(trajectory(http, traj, name, address)
                  for traj in sorted({t for t, _ in asked.values()}) for name, address in gateways.items())
            )  # fmt: skip
        self.say("gateway turns re-asked", keys=len(asked), gateways=sorted(gateways))
        return out

    async def _reask(self, client_id: str, keys: set[str], out: dict[str, dict[str, Any]]) -> None:
        from rollfleet.schemas.errors import RollfleetError
        from rollfleet.trainer_client import RolloutClient

        user = "gateway" if client_id == GATEWAY_CLIENT else "trainer"
        client = await asyncio.wait_for(
            RolloutClient.connect(
                self.machine.url(user),
                namespace=NAMESPACE,
                client_id=client_id,
                topology=self.topology,
                shared=client_id == GATEWAY_CLIENT,  # (the gateways share their id; so does this re-ask)
            ),
            60.0,
        )
        sem = asyncio.Semaphore(16)

        async def one(key: str) -> None:
            async with sem:
                t = time.time()
                try:
                    result = await client.result(key, timeout=4.0)
                except RollfleetError as exc:
                    out[key] = {**describe_error(exc), "t": t}
                except TimeoutError:
                    out[key] = {"kind": "timeout", "t": t}
                except Exception as exc:
                    out[key] = {**describe_error(exc), "untyped": True, "t": t}
                else:
                    out[key] = {**describe_result(result), "t": t}

        try:
            await asyncio.gather(*(one(k) for k in sorted(keys)))
        finally:
            await client.close()

    async def collect_notes(self) -> dict[str, Any]:
        await self.tap.resolve()
        with contextlib.suppress(Exception):
            self.tap.dump(self.workdir / "tap.json")
        rogue = self.rogue
        return {
            "deliveries_seen": len(self.tap.deliveries),
            "deliveries_unattributed": self.tap.unresolved,
            "answers_published_seen": len(self.tap.published),
            "tap_gaps_s": round(sum(b - a for a, b in self.tap.gaps if b != float("inf")), 3),
            "connz_polls": self.tap.polls,
            "versions_committed": len(self.machine.timeline.commits),
            "worker_processes": len(self.machine.timeline.workers),
            "workers_exited_on_their_own": [
                f"{w.worker_id}: {w.how}" for w in self.machine.timeline.workers if w.how.startswith("exited")
            ],
            "fleet_kept_at_size": self.kept,
            "trainer_incarnations": len(self.machine.timeline.trainers),
            "loop_publishes": self.loop_publishes,
            "rogue_snooped": rogue.snooped if rogue else 0,
            "rogue_forged": rogue.forged if rogue else 0,
            "rogue_refusals": len(rogue.refusals) if rogue else 0,
        }

    async def close(self) -> None:
        for task in [*self.tasks, *(t for t in (self.keeper, self.loop_publisher) if t)]:
            task.cancel()
        if self.autoscale is not None:  # (its controllers first: none may launch while the workers stop)
            with contextlib.suppress(Exception):
                await self.autoscale.close()
        for part in (self.rogue, self.tap, self.admin):
            if part is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(part.close(), 10.0)
        await asyncio.to_thread(self.machine.close)
        await self.machine.close_links()
        from reliability.adversary.objstore import close_object_store

        await close_object_store(self)
        self.events_journal.close()


def _read_from(path: Path, offset: int) -> bytes:
    """What a file holds from ``offset`` on (a journal being written: read as far as it goes)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


def _child_cwd() -> Path:
    """Children run from a directory with no ``rollfleet`` in it, so PYTHONPATH decides which
    rollfleet they import (``python -m`` puts the working directory first on sys.path)."""
    here = Path(os.environ.get("RF_ADV_SHIM", "")) if os.environ.get("RF_ADV_SHIM") else None
    return here if here is not None else Path(tempfile.gettempdir())


def use_code(code: str | None) -> None:
    """Make this process and its children import rollfleet from ``code`` (a checkout) and
    reliability from here (the harness from ``code`` too, where it has one): re-executes itself
    once with a PYTHONPATH of symlinks."""
    if os.environ.get("RF_ADV_SHIM"):
        return
    import hashlib

    target = Path(code).resolve() / "rollfleet" if code else REPO / "rollfleet"
    if not (target / "__init__.py").is_file():
        raise SystemExit(f"--code {code}: no rollfleet package in it")
    tag = hashlib.blake2b(f"{target}|{REPO}".encode(), digest_size=6).hexdigest()
    shim = Path(tempfile.gettempdir()) / f"rf-adv-shim-{tag}"
    shim.mkdir(exist_ok=True)
    # The harness (not installed with the package) from the checkout under test where it has one:
    # it is built against that checkout's modules.
    harness = target.parent / "harness" if (target.parent / "harness").is_dir() else REPO / "harness"
    for name, dest in (("rollfleet", target), ("reliability", REPO / "reliability"), ("harness", harness)):
        link = shim / name
        if not link.is_symlink() or os.readlink(link) != str(dest):
            link.unlink(missing_ok=True)
            link.symlink_to(dest)
    env = {**os.environ, "PYTHONPATH": str(shim), "RF_ADV_SHIM": str(shim)}
    os.chdir(shim)
    os.execve(sys.executable, [sys.executable, "-m", "reliability.adversary", *sys.argv[1:]], env)


async def run_one(cfg: Config) -> Report:
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix=f"rf-adv-{cfg.seed}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    adversary = Adversary(cfg, workdir)
    report = await adversary.run()
    if report.passed and not cfg.keep:
        adversary.machine.cleanup()
    return report


def print_report(report: Report) -> None:
    for v in report.violations:
        print(f"VIOLATION {v.line()}", flush=True)
    if report.crashed:
        print(f"CRASHED {report.crashed}\n{report.notes.get('traceback', '')}", flush=True)
    if report.vacuous:
        print(f"VACUOUS {report.vacuous}", flush=True)
    if not report.passed:
        print(f"FAILED seed {report.config.seed}; replay: {report.config.replay()}  (workdir {report.workdir})")
    print(json.dumps(report.summary(), default=str), flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m reliability.adversary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load and events")
    p.add_argument("--workers", type=int, default=3, help="echo workers at the start")
    p.add_argument("--hf", type=int, default=0, help="hf workers (tiny model) besides the echo ones")
    p.add_argument(
        "--sglang",
        type=int,
        default=0,
        help="sglang workers (at most 2), each attached to a keyed SGLang stand-in of its own; adds engine events",
    )
    p.add_argument(
        "--store",
        choices=("dir", "s3"),
        default="dir",
        help="the policy store: a directory, or a bucket on a local S3 API (moto) that each worker reads "
        "through a fault proxy of its own; adds object-store events",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="the broker as a 3-node cluster with R3 streams; adds node events (killed, frozen, cut off)",
    )
    p.add_argument("--no-auth", action="store_true", help="no auth config (and no rogue user)")
    p.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="the echo fleet sized by `rollfleet autoscale --driver local` controllers within MIN:MAX (no auth, "
        "no rogue); adds autoscaler events (the `autoscaler` schedule implies 3:5)",
    )
    p.add_argument("--no-loop", action="store_true", help="no RolloutLoop lane in the trainer")
    p.add_argument(
        "--gateway-sessions", type=int, default=1, help="lanes of HTTP trajectories and keyless gateway callers"
    )
    p.add_argument("--schedule", default=None, help="a named schedule instead of the seed's random one")
    p.add_argument("--code", default=None, help="run this checkout's rollfleet (e.g. the code before a fix)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the work directory of a passing run")
    p.add_argument("--campaign", type=int, default=0, help="run this many seeds (from --seed, or fresh)")
    p.add_argument("--quiet", action="store_true", help="no event lines, only findings and the summary")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("ROLLFLEET_LOG_LEVEL", "error")  # the adversary's own clients: quiet
    use_code(args.code)  # (returns only inside the re-executed process)
    seed = args.seed if args.seed is not None else secrets.randbelow(10**6)
    runs = max(1, args.campaign)
    drawn = "given" if args.seed is not None else "fresh"
    print(f"adversary seeds ({drawn}): {', '.join(str(seed + i) for i in range(runs))}", flush=True)
    failed = 0
    for i in range(runs):
        cfg = Config(
            seed=seed + i,
            duration=args.duration,
            workers=args.workers,
            hf=args.hf,
            sglang=args.sglang,
            store=args.store,
            cluster=args.cluster,
            auth=not args.no_auth and args.schedule != "no-auth",
            loop=not args.no_loop,
            gateway_sessions=args.gateway_sessions,
            code=args.code,
            schedule=args.schedule,
            autoscale=args.autoscale,
            workdir=Path(args.workdir) / str(seed + i) if args.workdir else None,
            keep=args.keep,
            quiet=args.quiet,
        )
        report = asyncio.run(run_one(cfg))
        print_report(report)
        failed += not report.passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
