"""The fleet sized by real ``rollfleet autoscale --driver local`` controllers (``--autoscale MIN:MAX``,
the ``autoscaler`` schedule), and the events that attack them.

In this mode the harness starts no echo workers of its own: a controller process does, as
``rollfleet worker`` processes in sessions of their own (they outlive it, and the next controller
finds them by their command lines), each with the adversary's worker flags (keyed echo,
``--verify-live``, the slow-read hook, an engine start-up of ``ECHO_STARTUP_S``). What the oracle
needs of them it learns as it would of any process: a look at ``/proc`` every ``SCAN_S`` finds each
worker by its command line (its ``--local-dir`` under this run's directory), its kernel start time
and its parent (the controller that launched it); each controller's log gives the SIGTERMs it
sent (``autoscale retired``); an ordered consumer on the fleet bucket gives the lease key's writes
as the broker stored them. The generated auth config names one user per worker id, and the local
driver names its workers as it launches them, so this mode runs without auth, and without the
rogue, whose promises rest on it.

The events (``AUTOSCALER_KINDS``):

===================== ========================================================================
``autoscaler_kill``   SIGKILL the acting controller; a new one is started ``after`` s later (its
                      predecessor's lease lapses first: a whole lease time of silence)
``autoscaler_restart`` SIGTERM the acting controller (a clean stop releases the lease) and start a
                      new one ``after`` s later
``autoscaler_pause``  SIGSTOP the acting controller for ``for_s`` s, then SIGCONT (longer than half
                      a lease time: it must stop acting; a standby may take over meanwhile)
``autoscaler_second`` a second controller, the same command, for ``for_s`` s (then SIGTERMed): the
                      lease keeps one acting
``kill_starting``     SIGKILL a replica while it starts (launched, not yet ready); where none is
                      starting, a ready one is SIGKILLed first, so that the controller starts one
``scale_in``          a scale-in ``during`` an activation (reads slowed, a version published) or a
                      resumable job (every follower's slots filled with long ``resume`` jobs):
                      the acting controller handed over to one whose maximum is one below the
                      fleet's size, which retires at its first tick; the bounds come back after
                      ``for_s`` s (each change a controller started, then the others SIGTERMed)
``eval_wait``         ``count`` exact jobs at the version ``back`` versions before the latest,
                      submitted with ``wait_for_replica=True`` (an evaluation of an old checkpoint
                      that chooses to wait for a held replica) with a ``deadline_s``
===================== ========================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from harness.processes import CHILD_LOG_ENV, sigterm_then_kill, spawn
from reliability.adversary.journal import Journal, describe_error, describe_result
from reliability.adversary.machine import WorkerProc, _log_level
from rollfleet.autoscale.drivers.local import command_flag

AUTOSCALER_KINDS = (
    "autoscaler_kill",
    "autoscaler_restart",
    "autoscaler_pause",
    "autoscaler_second",
    "kill_starting",
    "scale_in",
    "eval_wait",
)
DEFAULT_BOUNDS = "3:5"  # (three followers at least: a scale-in below the fleet's size needs no scale-up first)
PREFIX = "as"  # the local driver's worker ids: as-<hex>, as-v<V>-<hex>
SCAN_S = 0.2
ECHO_STARTUP_S = 2.0  # each replica's engine takes this long to start (``--echo-startup``)
INTERVAL_S = 1.0
LEASE_TTL_S = 6.0
# The controllers' policy: short timers, so a minute's run sees scale-ups, scale-ins and held versions.
POLICY_FLAGS = {
    "--interval": INTERVAL_S,
    "--lease-ttl": LEASE_TTL_S,
    "--cooldown": 6.0,
    "--scale-in-grace": 4.0,
    "--hold-after": 2.0,
    "--startup": 5.0,
    "--slots-per-replica": 3,
    "--target-wait": 4.0,
    "--max-per-version": 1,
    "--trend-window": 10.0,
}
# How long a held replica may take to serve once a controller acts: its hold-after, a tick, the
# process's start, the engine's, materializing the version, registering (the oracle's ``need_s``).
NEED_S = 2.0 + 2 * INTERVAL_S + ECHO_STARTUP_S + 14.0
EVAL_CLIENT = "evaluator"
QUIET_TAIL_S = 10.0


def boot_time() -> float:
    """When this host booted, to the clock tick (``/proc/stat``'s ``btime`` is whole seconds: a
    process's start would be dated up to a second early)."""
    with open("/proc/uptime") as f:
        return time.time() - float(f.read().split()[0])


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks since boot) of a process; None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


class ForeignProc:
    """A process this one did not start (a controller's worker), as much of ``subprocess.Popen``
    as the harness uses: poll, signal, wait. Its exit code is its parent's to read: ``"?"``."""

    def __init__(self, pid: int, start_ticks: int) -> None:
        self.pid = pid
        self._ticks = start_ticks
        self.returncode: Any = None

    def poll(self) -> Any:
        if self.returncode is None:
            st = proc_stat(self.pid)
            if st is None or st[2] != self._ticks or st[0] in ("Z", "X"):
                self.returncode = "?"
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> Any:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode


@dataclass
class ControllerProc:
    """One ``rollfleet autoscale`` process's life."""

    name: str
    proc: Any
    log: Path
    start: float
    bounds: tuple[int, int]
    end: float | None = None
    how: str = ""
    stops: list[list[float]] = field(default_factory=list)
    termed_at: float | None = None  # SIGTERMed (a clean stop: it releases the lease)

    @property
    def alive(self) -> bool:
        return bool(self.proc.poll() is None)

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.proc.pid,
            "start": self.start,
            "end": self.end,
            "how": self.how,
            "stops": self.stops,
            "termed_at": self.termed_at,
            "bounds": list(self.bounds),
        }


def parse_bounds(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi)


class AutoscaleFleet:
    """The controllers of one run, the workers they start as the harness sees them, and the facts."""

    def __init__(self, adv: Any) -> None:
        self.adv = adv
        self.m = adv.machine
        self.bounds = parse_bounds(adv.cfg.autoscale)
        self.home = adv.workdir / "autoscale"
        self.rng = random.Random(f"autoscaler:{adv.cfg.seed}")
        self.controllers: list[ControllerProc] = []
        self.workers: dict[int, dict[str, Any]] = {}  # pid -> {wp, held, parent}
        self.ignored: set[int] = set()
        self.retires: list[dict[str, Any]] = []
        self.decisions: dict[str, int] = {}
        self.lease: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.bursts: list[dict[str, Any]] = []
        self.scale_ins: list[dict[str, Any]] = []
        self.journal = Journal(adv.workdir / "evaluator.jsonl")
        self._offsets: dict[Path, int] = {}
        self._btime = boot_time()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._scanner: asyncio.Task[None] | None = None
        self._lease_sub: Any = None
        self._client: Any = None
        self._client_lock = asyncio.Lock()
        self._evals_n = 0
        self._healed = 0  # wiretap outages over, for which the lease watch was made again
        self._watch_failing = False
        # One event at a time works the controllers (a scale-in's handovers, a kill, a pause): each
        # waits for the one before it to finish, as the schedule means them in turn.
        self._controllers_lock = asyncio.Lock()

    # -- controllers ---------------------------------------------------------------------------
    def command(self, bounds: tuple[int, int]) -> list[str]:
        cfg = self.adv.cfg
        worker_args = {
            "--heartbeat": "0.5",
            "--capacity": "3",
            "--catch-up-wait": "60",
            "--pre-read-hook": "reliability.adversary.hooks:slow_read",
            "--echo-token-latency": "0.003",
            "--echo-startup": f"{ECHO_STARTUP_S:g}",
            "--exact-drain": "1.0",
            "--ack-wait": f"{cfg.ack_wait:g}",
            "--duplicate-window": f"{cfg.duplicate_window:g}",
            "--max-deliver": str(cfg.max_deliver),
            "--prepare-timeout": "8",
            **({"--replicas": str(cfg.replicas)} if cfg.replicas > 1 else {}),
        }
        cmd = [
            sys.executable,
            "-m",
            "rollfleet",
            "autoscale",
            "--nats",
            self.m.url("trainer"),
            "--namespace",
            self.m.namespace,
            "--bounds",
            f"{bounds[0]}:{bounds[1]}",
            "--driver",
            "local",
            "--engine",
            "echo",
            "--store",
            str(self.m.store),
            "--home",
            str(self.home),
            "--id-prefix",
            PREFIX,
            "--ack-wait",
            f"{cfg.ack_wait:g}",
            "--duplicate-window",
            f"{cfg.duplicate_window:g}",
            "--max-deliver",
            str(cfg.max_deliver),
            *self.adv.replicas_args("--replicas"),
        ]
        for flag, value in POLICY_FLAGS.items():
            cmd += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        cmd += [f"--worker-arg={k}={v}" for k, v in worker_args.items()]
        cmd += ["--worker-arg=--verify-live", "--worker-arg=--echo-keyed"]
        return cmd

    def start_controller(self, bounds: tuple[int, int] | None = None) -> ControllerProc:
        bounds = bounds or self.bounds
        name = f"c{len(self.controllers) + 1}"
        log = self.m.workdir / "logs" / f"autoscale-{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**CHILD_LOG_ENV, **self.adv.child_env, "RF_ADV_SLOW_READ": str(self.m.slow_file), **_log_level("info")}
        proc = spawn(self.command(bounds), log, env=env, cwd=self.m.cwd)
        cp = ControllerProc(name, proc, log, time.time(), bounds)
        self.controllers.append(cp)
        self.adv.say("autoscaler start", controller=name, pid=proc.pid, bounds=f"{bounds[0]}:{bounds[1]}")
        return cp

    def live(self) -> list[ControllerProc]:
        return [c for c in self.controllers if c.alive]

    def acting(self) -> ControllerProc | None:
        """The controller the lease's last stored write names (alive), else None."""
        for r in reversed(self.lease):
            if str(r["op"]).upper() != "PUT":
                return None
            pid = r["holder"].rsplit(":", 1)[-1]
            return next((c for c in self.live() if str(c.proc.pid) == pid), None)
        return None

    def acting_now(self) -> ControllerProc | None:
        """The acting controller if it renewed the lease within half a lease time (it may act now)."""
        c = self.acting()
        if c is None or not self.lease or time.time() - float(self.lease[-1]["t"]) >= LEASE_TTL_S / 2:
            return None
        return c

    def _ended(self, c: ControllerProc, how: str) -> None:
        if c.end is None:
            c.end, c.how = time.time(), c.how or how

    def kill(self, c: ControllerProc) -> None:
        from rollfleet.runtime.processes import terminate

        c.how = c.how or "killed"
        terminate(c.proc, 10.0, signal.SIGKILL)
        self._ended(c, "killed")

    async def term(self, c: ControllerProc, timeout: float = 15.0) -> None:
        if c.alive:
            c.how, c.termed_at = c.how or "terminated", time.time()
            if await sigterm_then_kill(c.proc, timeout):
                c.how = "terminated, then killed"
        self._ended(c, "terminated")

    async def pause(self, c: ControllerProc, seconds: float) -> None:
        t0 = time.time()
        self.m.freezes.stop(c.proc)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.m.freezes.cont(c.proc)
            c.stops.append([t0, time.time()])

    async def waiting(self, c: ControllerProc, timeout: float = 25.0) -> bool:
        """Whether a controller is up: it logged that it waits for the lease (or holds it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and c.alive:
            with contextlib.suppress(OSError):
                text = c.log.read_bytes()
                if b"autoscale waiting for the lease" in text or b"autoscale acting" in text:
                    return True
            await asyncio.sleep(0.1)
        return False

    async def hand_over(self, bounds: tuple[int, int], why: str) -> ControllerProc | None:
        """A controller with ``bounds`` started; once it waits for the lease, every other one is
        SIGTERMed (each releases the lease as it stops): the new one acts at its next look."""
        fresh = self.start_controller(bounds)
        if not await self.waiting(fresh):
            self.adv.say("autoscaler handover failed", controller=fresh.name, why=why)
            return None
        for c in self.live():
            if c is not fresh:
                await self.term(c)
                self.adv.say("autoscaler stopped", controller=c.name, why=why, how=c.how)
        return fresh

    # -- the workers, as /proc shows them ---------------------------------------------------------
    def scan(self) -> None:
        """New worker processes of this run's controllers, and the ends of the known ones."""
        self._read_logs()
        marker = str(self.home / "replicas") + os.sep
        parents = {c.proc.pid: c.name for c in self.controllers if c.alive}
        try:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return
        for pid in pids:
            if pid in self.workers or pid in self.ignored:
                continue
            st = proc_stat(pid)
            if st is None:
                continue
            try:
                argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
            except OSError:
                continue
            local = command_flag(argv, "--local-dir")
            if "worker" not in argv or local is None or not local.startswith(marker):
                # (a controller's child before its exec still shows the controller's command line)
                if st[1] not in parents:
                    self.ignored.add(pid)
                continue
            worker_id = command_flag(argv, "--worker-id") or "?"
            held = command_flag(argv, "--hold-version")
            start = self._btime + st[2] / self._tick
            wp = WorkerProc(
                worker_id,
                "echo",
                ForeignProc(pid, st[2]),
                self.home / "logs" / f"{worker_id}.log",  # type: ignore[arg-type]
                start,
                autoscaled=True,
            )
            self.workers[pid] = {
                "wp": wp,
                "held": int(held) if held is not None else None,
                "parent": parents.get(st[1]),
            }
            self.m.timeline.workers.append(wp)
            self.m.current[worker_id] = wp
            self.adv.say(
                "autoscaled worker seen",
                worker=worker_id,
                pid=pid,
                held=self.workers[pid]["held"],
                launched_by=self.workers[pid]["parent"],
                started_s_ago=round(time.time() - start, 2),
            )
        for info in self.workers.values():
            wp = info["wp"]
            if wp.end is None and not wp.alive:
                self.m._ended(wp, f"exited {wp.proc.returncode}")

    def _read_logs(self) -> None:
        """Each controller's new log lines: its retirements (a SIGTERM it sent), its decisions."""
        for c in self.controllers:
            offset = self._offsets.get(c.log, 0)
            try:
                with open(c.log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[c.log] = offset + len(whole)
            for line in whole.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                event = rec.get("event")
                if event == "autoscale decision":
                    key = str(rec.get("action"))
                    self.decisions[key] = self.decisions.get(key, 0) + 1
                elif event == "autoscale retired":
                    t = _stamp(rec.get("timestamp"))
                    self.retires.append({"t": t, "controller": c.name, "worker_id": rec.get("worker_id")})
                    self._retired(str(rec.get("worker_id")), c.name, t)

    def _retired(self, worker_id: str, controller: str, t: float) -> None:
        """A worker a controller SIGTERMed: it drains (``terminated``, as the oracle reads a drain)."""
        for info in self.workers.values():
            wp = info["wp"]
            if wp.worker_id != worker_id or wp.start > t:
                continue
            if wp.end is not None and wp.end < t - 1.0:
                continue
            if not wp.how or wp.how.startswith("exited"):
                wp.how = f"terminated (retired by {controller})"
            if wp.told_to_stop is None:
                wp.told_to_stop = t

    async def _scan_forever(self) -> None:
        while True:
            try:
                self.scan()
            except Exception as exc:  # (a process gone between two reads of /proc)
                self.adv.say("autoscale scan failed", error=repr(exc)[:200])
            await self.watch_lease_again()
            await asyncio.sleep(SCAN_S)

    def autoscaled(self, alive: bool = True) -> list[WorkerProc]:
        return [i["wp"] for i in self.workers.values() if not alive or i["wp"].alive]

    def counted(self) -> list[dict[str, Any]]:
        """Worker processes alive now and not told to stop (the fleet's size)."""
        return [
            i
            for i in self.workers.values()
            if i["wp"].alive and i["wp"].told_to_stop is None and not i["wp"].how.startswith("terminated")
        ]

    def registry_state(self, worker_id: str) -> Any:
        """The last registry entry the wiretap saw for a worker (None: none yet)."""
        for _, w, status in reversed(self.adv.tap.fleet):
            if w == worker_id:
                return status
        return None

    # -- the lease, as the broker stored it --------------------------------------------------------
    async def watch_lease(self) -> None:
        from rollfleet.schemas import Names

        js = self.adv.tap.nc.jetstream()
        subject = f"$KV.{self.adv.names.fleet_bucket}.{Names.AUTOSCALER_LEASE_KEY}"

        async def stored(msg: Any) -> None:
            md = msg.metadata
            if any(r["seq"] == md.sequence.stream for r in self.lease[-5:]):
                return  # (the current value, delivered again to a consumer made again)
            op = (msg.headers or {}).get("KV-Operation", "PUT") if msg.headers else "PUT"
            self.lease.append(
                {
                    "t": md.timestamp.timestamp(),
                    "seen": time.time(),
                    "op": str(op),
                    "holder": bytes(msg.data or b"").decode(errors="replace"),
                    "seq": md.sequence.stream,
                }
            )

        if self._lease_sub is not None:
            with contextlib.suppress(Exception):
                await self._lease_sub.unsubscribe()
        self._lease_sub = await js.subscribe(subject, cb=stored, ordered_consumer=True)

    async def watch_lease_again(self) -> None:
        """Once the wiretap's connection is back (a broker restart), the lease watched anew at once: an
        ordered consumer notices a lost consumer only after missed heartbeats (it took 14 s), and
        what the broker holds now is delivered first."""
        # (or the fleet bucket lost: its stream deleted, or the broker back on an older or empty store,
        # where an ordered consumer goes on from a sequence the new stream may never reach)
        healed = sum(1 for _, b in self.adv.tap.gaps if b != float("inf")) + sum(
            1 for loss in self.m.timeline.stores_lost if _loses_lease(loss) and loss.get("back")
        )
        if healed > self._healed:
            self._healed = healed
            try:
                await self.watch_lease()
            except Exception as exc:  # (the broker away again, the bucket not declared again yet: next look)
                self._healed -= 1
                if not self._watch_failing:
                    self.adv.say("lease watch not made again yet", error=repr(exc)[:200])
                self._watch_failing = True
            else:
                self._watch_failing = False

    def lease_gaps(self) -> list[list[float]]:
        return lease_gaps(self.adv.tap.gaps, self.m.timeline.stores_lost, self.lease, time.time())

    # -- the evaluator's requests ------------------------------------------------------------------
    async def client(self) -> Any:
        async with self._client_lock:
            if self._client is None:
                from rollfleet.trainer_client import RolloutClient

                self._client = await RolloutClient.connect(
                    self.m.url("trainer"),
                    namespace=self.m.namespace,
                    client_id=EVAL_CLIENT,
                    topology=self.adv.topology,
                    fail_fast=True,
                )
            return self._client

    async def submit(
        self,
        kind: str,
        key: str,
        prompt: list[int],
        max_tokens: int,
        deadline_s: float,
        version: int,
        retry: str,
        **constraint: Any,
    ) -> dict[str, Any]:
        """One evaluator request, journaled before and after, awaited to its answer."""
        from rollfleet.schemas import RolloutPayload, SamplingParams

        client = await self.client()
        t0 = time.time()
        rec: dict[str, Any] = {
            "kind": kind,
            "key": key,
            "version": version,
            "t0": t0,
            "deadline": t0 + deadline_s,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "retry": retry,
            "answer": None,
        }
        self.journal.write({"ev": "submit", **rec})
        payload = RolloutPayload(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens))
        try:
            handle = await client.submit(
                payload, idempotency_key=key, timeout=deadline_s, retry_policy=retry, **constraint
            )
            result = await handle.result(deadline_s + 20.0)
            rec["answer"] = {**describe_result(result), "t": time.time()}
        except TimeoutError:
            rec["answer"] = {"kind": "hang", "t": time.time()}
        except Exception as exc:
            rec["answer"] = {**describe_error(exc), "t": time.time()}
        self.journal.write({"ev": "answer", "key": key, **rec["answer"]})
        return rec

    def prompt(self, key: str) -> list[int]:
        r = random.Random(f"eval-prompt:{self.adv.cfg.seed}:{key}")
        return [r.randrange(1, 200) for _ in range(r.randint(3, 9))]

    def latest(self) -> int:
        return max((v for v, _, _ in self.m.timeline.commits), default=0)

    async def eval_wait(self, p: dict[str, Any]) -> bool:
        if not p.get("hide_s"):
            return await self._eval_wait(p)
        # Its version's directory unreadable for a moment as the requests come (a flaky mount): no
        # controller is started or stopped meanwhile, so the one acting sees the moment, and after it.
        async with self._controllers_lock:
            asked = asyncio.ensure_future(self._eval_wait(p))
            await asyncio.sleep(float(p["hide_s"]))
        return await asked

    async def _eval_wait(self, p: dict[str, Any]) -> bool:
        # ``back`` committed versions before the latest (the oldest there is, early in a run): a
        # version a publisher fault left uncommitted is nobody's to serve, and never asked for here
        committed = sorted({v for v, _, _ in self.m.timeline.commits})
        latest = committed[-1] if committed else 0
        v = committed[max(0, len(committed) - 1 - int(p.get("back", 2)))] if committed else 0
        if v >= latest:
            self.adv.say("eval wait skipped", reason="no version older than the latest yet", latest=latest)
            return False
        keys = []
        for _ in range(int(p.get("count", 2))):
            self._evals_n += 1
            keys.append(f"eval-{self.adv.cfg.seed}-{self._evals_n}")
        hidden = None
        if p.get("hide_s") and not self.adv.publisher_fault and (hidden := self.m.hide(v)) is not None:
            self.adv.damaged += 1
            self.adv.spawn(self._unhide(v, float(p["hide_s"])))
        self.adv.say(
            "evaluation waits for a held replica",
            version=v,
            latest=latest,
            keys=keys,
            deadline_s=p["deadline_s"],
            hidden_s=p.get("hide_s") if hidden is not None else None,
        )
        recs = await asyncio.gather(
            *(
                self.submit(
                    "wait",
                    k,
                    self.prompt(k),
                    24,
                    float(p["deadline_s"]),
                    v,
                    "replayable",
                    exact_version=v,
                    wait_for_replica=True,
                )
                for k in keys
            )
        )
        self.evals += recs
        self.adv.say(
            "evaluation answered",
            version=v,
            answers={r["key"]: (r["answer"] or {}).get("cls") or (r["answer"] or {}).get("kind") for r in recs},
        )
        return True

    async def _until(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            await asyncio.sleep(0.05)
        return False

    def _followers(self) -> set[str]:
        return {i["wp"].worker_id for i in self.counted() if i["held"] is None}

    async def _unhide(self, v: int, seconds: float) -> None:
        t = time.time()
        await asyncio.sleep(seconds)
        self.m.unhide(v)
        self.adv.damaged -= 1
        self.m.timeline.hidden.append((v, t, time.time()))
        self.adv.say("store dir back", version=v, after_s=round(seconds, 2))

    async def burst(self, count: int) -> list[asyncio.Task[dict[str, Any]]]:
        """``count`` long resumable jobs on the followers (each 3,000 tokens: 9 s of echo at least)."""
        latest = self.latest()
        tasks = []
        for _ in range(count):
            self._evals_n += 1
            k = f"burst-{self.adv.cfg.seed}-{self._evals_n}"
            tasks.append(
                asyncio.ensure_future(
                    self.submit("burst", k, self.prompt(k), 3000, 40.0, latest, "resume", min_version=latest)
                )
            )
        return tasks

    async def reask_bursts(self) -> None:
        """Each answered burst job's key asked again at the end: the same one answer must come back."""
        if self._client is None:
            return
        for rec in self.bursts:
            if (rec.get("answer") or {}).get("kind") != "result":
                continue
            try:
                again = await self._client.result(rec["key"], timeout=4.0)
                rec["again"] = describe_result(again)
            except Exception as exc:
                rec["again"] = describe_error(exc)

    # -- the events ----------------------------------------------------------------------------------
    async def event(self, kind: str, p: dict[str, Any]) -> bool:
        if kind == "eval_wait":
            return await self.eval_wait(p)
        if kind == "kill_starting":
            return await self.kill_starting(p)
        if kind == "scale_in":
            async with self._controllers_lock:
                return await self.scale_in(p)
        if kind == "autoscaler_second":
            async with self._controllers_lock:
                acting = self.acting()
                c = self.start_controller(acting.bounds if acting is not None else None)
            self.adv.say("second autoscaler", controller=c.name, for_s=p["for_s"])
            await asyncio.sleep(float(p["for_s"]))
            if c.alive:
                async with self._controllers_lock:
                    await self.term(c)
                self.adv.say("autoscaler stopped", controller=c.name, why="second's time over", how=c.how)
            return True
        async with self._controllers_lock:
            return await self.controller_fault(kind, p)

    async def controller_fault(self, kind: str, p: dict[str, Any]) -> bool:
        """The acting controller SIGKILLed or SIGTERMed (and started again), or frozen."""
        c = self.acting() or (self.live()[0] if self.live() else None)
        if c is None:
            self.adv.say(f"{kind} skipped", reason="no controller running")
            return False
        if kind == "autoscaler_pause":
            self.adv.say("SIGSTOP autoscaler", controller=c.name, for_s=p["for_s"])
            await self.pause(c, float(p["for_s"]))
            self.adv.say("SIGCONT autoscaler", controller=c.name)
            return True
        if kind == "autoscaler_kill":
            self.kill(c)
            self.adv.say("SIGKILL autoscaler", controller=c.name, pid=c.proc.pid)
        else:
            self.adv.say("SIGTERM autoscaler", controller=c.name, pid=c.proc.pid)
            await self.term(c)
        await asyncio.sleep(float(p.get("after", 1.0)))
        self.start_controller(c.bounds)
        return True

    def starting(self) -> list[WorkerProc]:
        """Autoscaled workers alive whose registry entry (as the wiretap saw it) is not serving yet."""
        out = []
        for wp in self.autoscaled():
            status = self.registry_state(wp.worker_id)
            if wp.told_to_stop is None and (status is None or status.state == "starting"):
                out.append(wp)
        return out

    async def kill_starting(self, p: dict[str, Any]) -> bool:
        for attempt in range(2):
            done = await self._kill_starting(p, provoke=attempt > 0)
            if done is not None:
                return done
        self.adv.say("kill starting skipped", reason="each replica was ready (or gone) before the kill")
        return False

    async def _kill_starting(self, p: dict[str, Any], provoke: bool) -> bool | None:
        """None: the replica it would have killed was ready first (try again)."""
        victims = [] if provoke else self.starting()
        if not victims:
            ready = [wp for wp in self.autoscaled() if wp.told_to_stop is None and wp.worker_id not in self.adv.busy]
            if not ready:
                self.adv.say("kill starting skipped", reason="no autoscaled worker")
                return False
            first = self.rng.choice(ready)
            t = time.time()
            self.m.kill_worker(first)
            self.adv.say("SIGKILL worker", worker=first.worker_id, victim="ready, so that a replica starts")
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline:
                victims = [wp for wp in self.starting() if wp.start >= t - 0.5]
                if victims:
                    break
                await asyncio.sleep(0.05)
            else:
                self.adv.say("kill starting skipped", reason="no replica started within 15 s")
                return True
        await asyncio.sleep(float(p.get("after", 0.5)))
        alive = [wp for wp in victims if wp.alive and wp in self.starting()]
        if not alive:
            return None
        wp = self.rng.choice(alive)
        status = self.registry_state(wp.worker_id)
        self.m.kill_worker(wp)
        self.adv.say(
            "SIGKILL starting worker",
            worker=wp.worker_id,
            age_s=round(time.time() - wp.start, 2),
            registry=status.state if status is not None else None,
        )
        return True

    async def scale_in(self, p: dict[str, Any]) -> bool:
        lo, hi = self.bounds
        during = p["during"]
        followers = [i for i in self.counted() if i["held"] is None]
        if len(followers) < 2:  # (a scale-in of the followers needs two: one to retire, one to serve)
            raised = await self.hand_over((max(lo, 2), max(hi, 2)), "two followers, for a scale-in")
            if raised is None:
                return False
            deadline = time.monotonic() + 25.0
            while time.monotonic() < deadline:
                followers = [i for i in self.counted() if i["held"] is None]
                serving = [
                    i
                    for i in followers
                    if (s := self.registry_state(i["wp"].worker_id)) is not None and s.state == "ready"
                ]
                if len(serving) >= 2:
                    break
                await asyncio.sleep(0.2)
            else:
                self.adv.say("scale in skipped", reason="no second follower came up")
                return False
        bursts: list[asyncio.Task[dict[str, Any]]] = []
        if during == "resume":  # (first: the lowered controller is sized by the fleet these jobs find)
            # (two a follower: the burst itself asks for no more followers; the retire order takes a
            # starting replica first, so the fleet is let settle until none starts)
            bursts = await self.burst(2 * len(followers))
            await self._until(
                lambda: self._followers() <= self._holding_resume() and not self._followers() & self._starting_ids(),
                10.0,
            )
        # (a lease that lapsed, or was released, would let the lowered controller act at once, before
        # the moment: one that holds it is waited for)
        await self._until(lambda: self.acting_now() is not None, 15.0)
        # One follower fewer than now, the held replicas kept: the maximum one below the fleet's size,
        # the minimum at most the followers left.
        counted = self.counted()
        n, nf = len(counted), len([i for i in counted if i["held"] is None])
        lowered = (min(lo, nf - 1), max(min(lo, nf - 1), n - 1))
        standby = self.start_controller(lowered)
        if not await self.waiting(standby):
            self.bursts += list(await asyncio.gather(*bursts))
            return False
        if during == "activation":  # (every follower preparing the version published now, reads slowed)
            self.m.set_slow(float(p.get("slow_s", 2.0)))
            self.adv.spawn(self.adv.publish("for a scale-in during its activation"))
            await self._until(lambda: self._followers() <= self._activating(), 10.0)
        moment = {
            "at": time.time(),
            "during": during,
            "bounds": list(lowered),
            "fleet": n,
            "activating": sorted(self._activating()),
            "holding_resume": sorted(self._holding_resume()),
        }
        self.adv.say("scale in", **moment)
        for c in self.live():
            if c is not standby:
                await self.term(c)
                self.adv.say("autoscaler stopped", controller=c.name, why="bounds lowered", how=c.how)
        deadline = time.monotonic() + 10.0
        retired: list[str] = []
        while time.monotonic() < deadline and not retired:
            self._read_logs()
            retired = [r["worker_id"] for r in self.retires if r["controller"] == standby.name]
            await asyncio.sleep(0.05)
        moment["retired"] = retired
        moment["retired_activating"] = sorted(set(retired) & (self._activating() | set(moment["activating"])))
        moment["retired_holding_resume"] = sorted(set(retired) & set(moment["holding_resume"]))
        self.scale_ins.append(moment)
        self.adv.say(
            "scaled in",
            retired=retired,
            activating=moment["retired_activating"],
            holding_resume=moment["retired_holding_resume"],
        )
        await asyncio.sleep(float(p.get("for_s", 5.0)))
        self.m.set_slow(None)
        await self.hand_over(self.bounds, "bounds back")
        if bursts:
            self.bursts += [r for r in await asyncio.gather(*bursts)]
        return True

    def _starting_ids(self) -> set[str]:
        return {wp.worker_id for wp in self.starting()}

    def _activating(self) -> set[str]:
        return {
            wp.worker_id
            for wp in self.autoscaled()
            if (s := self.registry_state(wp.worker_id)) is not None and s.state in ("preparing", "activating")
        }

    def _holding_resume(self) -> set[str]:
        """Workers holding a resumable job now (delivered, not acked or handed back), by the wiretap."""
        tap = self.adv.tap
        out = set()
        for d in tap.deliveries[-400:]:
            if d.worker is None or d.retry != "resume":
                continue
            if any(k in ("+ACK", "-NAK", "+TERM") for _, k in tap.acks.get(d.ack, [])):
                continue
            out.add(d.worker)
        return out

    # -- the run ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        await self.watch_lease()
        self.start_controller()
        self._scanner = asyncio.ensure_future(self._scan_forever())

    async def quiet_tail(self) -> None:
        """The load over and no event left: the fleet watched ``QUIET_TAIL_S`` more, so that it is
        judged settled a while (and shrinks towards its minimum, after the scale-in grace)."""
        await asyncio.sleep(QUIET_TAIL_S)

    def keep_one(self) -> None:
        """(settling) at least one controller runs at the end, as a supervisor keeps one."""
        if not self.live():
            self.start_controller()

    def facts(self, t0: float) -> dict[str, Any]:
        """Everything the oracle judges of the autoscaler (``oracle_autoscale``), as plain data."""
        self.scan()
        workers = []
        for pid, info in self.workers.items():
            wp = info["wp"]
            workers.append(
                {
                    "worker_id": wp.worker_id,
                    "pid": pid,
                    "start": wp.start,
                    "end": wp.end,
                    "how": wp.how,
                    "stops": wp.stops,
                    "held": info["held"],
                    "parent": info["parent"],
                    "leaving_at": wp.told_to_stop,
                }
            )
        # The harness's own workers (``--hf``, ``--sglang`` beside the controllers') are replicas the
        # planner counts too: counted in the fleet's size, launched by no controller.
        for wp in self.m.timeline.workers:
            if not wp.autoscaled:
                workers.append(
                    {
                        "worker_id": wp.worker_id,
                        "pid": wp.proc.pid,
                        "start": wp.start,
                        "end": wp.end,
                        "how": wp.how,
                        "stops": wp.stops,
                        "held": None,
                        "parent": None,
                        "leaving_at": wp.told_to_stop,
                        "fixed": True,
                    }
                )
        return {
            "t0": t0,
            "t_end": time.time(),
            "bounds": list(self.bounds),
            "policy": {"interval_s": INTERVAL_S, "lease_ttl_s": LEASE_TTL_S, "need_s": NEED_S},
            "controllers": [c.record() for c in self.controllers],
            "workers": workers,
            "retires": self.retires,
            "lease": self.lease,
            "lease_gaps": self.lease_gaps(),
            "evals": self.evals,
            "bursts": self.bursts,
            "scale_ins": self.scale_ins,
            "decisions": self.decisions,
        }

    async def close(self) -> None:
        """Controllers first (so none launches more), then the workers they left (the machine's close)."""
        if self._scanner is not None:
            self._scanner.cancel()
        for c in self.live():
            c.proc.send_signal(signal.SIGTERM)
        for c in list(self.controllers):
            await self.term(c, 10.0)
        if self._lease_sub is not None:
            with contextlib.suppress(Exception):
                await self._lease_sub.unsubscribe()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._client.close(), 10.0)
        self.scan()  # (the workers they left: the machine stops them with its own)
        self.journal.close()


def _loses_lease(loss: dict[str, Any]) -> bool:
    """Whether a store loss (``Timeline.stores_lost``) took the fleet bucket's writes (the lease's)."""
    return loss.get("kind") != "delete_stream" or loss.get("target") == "registry"


def lease_gaps(
    tap_gaps: list[list[float]], losses: list[dict[str, Any]], lease: list[dict[str, Any]], now: float
) -> list[list[float]]:
    """When the lease's writes may have gone unseen, each until the first write seen after it (one
    stored meanwhile and replaced is gone for good, the bucket keeping one): the wiretap's
    connection away; the fleet bucket lost (its stream deleted: the watch's consumer went with it;
    the broker back on an older or an empty store), from the first write it lost."""
    spans = [[a, b if b != float("inf") else now] for a, b in tap_gaps]
    spans += [
        [float(x["lost_from"]) if x.get("kind") == "rollback" else float(x["at"]), float(x.get("back") or now)]
        for x in losses
        if _loses_lease(x)
    ]
    out = []
    for a, end in spans:
        after = [r["seen"] for r in lease if r["seen"] >= end]
        out.append([a, min(after) if after else end + LEASE_TTL_S])
    return out


def _stamp(text: Any) -> float:
    """A log line's ISO time stamp as unix time (now, if it has none)."""
    if not isinstance(text, str):
        return time.time()
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


async def autoscaler_event(adv: Any, kind: str, p: dict[str, Any]) -> bool:
    """One of ``AUTOSCALER_KINDS``; skipped (False) in a run whose fleet no controller sizes."""
    fleet = getattr(adv, "autoscale", None)
    if fleet is None:
        adv.say(f"{kind} skipped", reason="no autoscaler in this run (--autoscale MIN:MAX)")
        return False
    return bool(await fleet.event(kind, p))
