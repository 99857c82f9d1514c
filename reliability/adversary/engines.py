"""Engine servers under the machine adversary: a worker attached to its own SGLang server.

With ``--sglang N`` the adversary adds N ``rollfleet worker --engine sglang`` replicas (ids
``s1``, ``s2``), each attached (``--sglang-url``) to a server process of its own: the keyed
SGLang stand-in (``harness.sglang_keyed``), launched on the trainer's base checkpoint
(the store's version 0) under SGLang's default label. Its tokens are a function of the bytes it
loaded, so the oracle's ``served`` recomputes every one of them from the trainer's weights, as
it does the keyed echo workers'.

The events (``reliability.adversary.schedule.engines``, stream ``engines:<seed>``, drawn only with such a
worker):

- ``engine_kill``: SIGKILL the server, start it again ``after`` s later on its launch checkpoint
  (same port; it reports SGLang's ``default`` label and holds version 0's bytes). A worker that
  took it back as its last activated version would label version-0 tokens with a later version
  (issue defect 2): ``served`` sees it.
- ``engine_pause_error``: the server answers ``/pause_generation`` with HTTP 500 for ``for_s``
  s, and a version is published meanwhile, so that an activation meets the refusal (issue defect
  6: the adapter's gate left closed for ever).
- ``engine_freeze``: SIGSTOP the server for ``for_s`` s, then SIGCONT.

Every server's life, freeze and refusal window goes into ``Timeline.engines``; the oracle counts a
worker whose server is dead or frozen as unable to serve, and judges that the replica serves
again once its server is back (``available``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.processes import spawn
from rollfleet.runtime.processes import terminate

SGLANG_POOL = ("s1", "s2")  # worker ids of sglang replicas (broker users of their own)
ENGINE_KINDS = ("engine_kill", "engine_pause_error", "engine_freeze")


@dataclass
class EngineServerProc:
    """One life of the engine server a worker is attached to."""

    worker_id: str
    proc: Any  # subprocess.Popen[bytes]
    log: Path
    start: float
    port: int
    model_path: str
    end: float | None = None
    how: str = ""
    stops: list[list[float]] = field(default_factory=list)  # [SIGSTOP, SIGCONT]
    refusing: list[list[float]] = field(default_factory=list)  # [from, to]: pauses answered HTTP 500

    @property
    def alive(self) -> bool:
        return bool(self.proc.poll() is None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self) -> dict[str, Any]:
        """As the oracle reads it (``save_inputs``)."""
        return {
            "worker_id": self.worker_id,
            "start": self.start,
            "end": self.end,
            "how": self.how,
            "stops": self.stops,
            "refusing": self.refusing,
        }


class EngineServers:
    """The engine servers of a machine's sglang workers, one per worker id, each on a fixed port
    (a restarted one comes back where its worker looks for it)."""

    def __init__(self, workdir: Path, child_env: dict[str, str], cwd: Path, lives: list[Any]) -> None:
        self.workdir = workdir
        self.child_env = child_env
        self.cwd = cwd
        self.lives = lives  # Timeline.engines: every life, in order
        self.current: dict[str, EngineServerProc] = {}
        self.ports: dict[str, int] = {}

    def url(self, worker_id: str) -> str:
        return f"http://127.0.0.1:{self.ports[worker_id]}"

    def start(self, worker_id: str, model_path: Path) -> EngineServerProc:
        from rollfleet.broker import free_port

        old = self.current.get(worker_id)
        assert old is None or not old.alive, f"the engine server of {worker_id} is running"
        port = self.ports.setdefault(worker_id, free_port())
        log = self.workdir / "logs" / f"engine-{worker_id}.{len(self.lives)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "harness.sglang_keyed", "--model-path", str(model_path),
               "--port", str(port), "--token-delay", "0.003"]  # fmt: skip
        proc = spawn(cmd, log, env=self.child_env, cwd=self.cwd)
        es = EngineServerProc(worker_id, proc, log, time.time(), port, str(model_path))
        self.lives.append(es)
        self.current[worker_id] = es
        return es

    def ensure(self, worker_id: str, model_path: Path) -> EngineServerProc:
        """The worker's server, started if it has none running."""
        es = self.current.get(worker_id)
        return es if es is not None and es.alive else self.start(worker_id, model_path)

    async def healthy(self, es: EngineServerProc, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and es.alive:
            if await asyncio.to_thread(_get_ok, f"{es.url}/health"):
                return True
            await asyncio.sleep(0.1)
        return False

    def kill(self, es: EngineServerProc, how: str = "killed") -> None:
        if es.alive:
            terminate(es.proc, 10.0, signal.SIGKILL)
        if es.end is None:
            es.end, es.how = time.time(), es.how or how

    async def refuse_pauses(self, es: EngineServerProc, for_s: float) -> bool:
        """Make the server answer ``/pause_generation`` with HTTP 500 for ``for_s`` s."""
        body = json.dumps({"for_s": for_s}).encode()
        t0 = time.time()
        ok = await asyncio.to_thread(_post_ok, f"{es.url}/_fault/pause_error", body)
        if ok:
            es.refusing.append([t0, t0 + for_s])
        return ok

    def close(self) -> None:
        for es in self.lives:
            if es.alive:
                terminate(es.proc, 5.0)
            if es.end is None:
                es.end, es.how = time.time(), es.how or "stopped at the end"


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return bool(r.status == 200)
    except Exception:
        return False


def _post_ok(url: str, body: bytes) -> bool:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5.0) as r:
            return bool(r.status == 200)
    except Exception:
        return False


async def engine_event(adv: Any, kind: str, p: dict[str, Any]) -> bool:
    """Inject one engine event on a live sglang worker's server (``adv``: the Adversary); False
    when skipped (no such worker, or another event has it)."""
    m = adv.machine
    servers: EngineServers = m.engines
    live = sorted(w.worker_id for w in m.alive_workers("sglang"))
    targets = [wid for wid in live if f"engine:{wid}" not in adv.busy and wid in servers.current]
    if not targets:
        adv.say(f"{kind} skipped", reason="no sglang worker, or another event has its server")
        return False
    wid = targets[int(p.get("which", 0)) % len(targets)]
    es = servers.current[wid]
    if not es.alive:
        adv.say(f"{kind} skipped", worker=wid, reason="its server is not running")
        return False
    busy = f"engine:{wid}"
    adv.busy.add(busy)
    try:
        if kind == "engine_kill":
            servers.kill(es)
            adv.say("SIGKILL engine server", worker=wid, pid=es.proc.pid)
            await asyncio.sleep(p["after"])
            fresh = servers.start(wid, Path(es.model_path))  # its launch checkpoint, its launch label
            ok = await servers.healthy(fresh)
            adv.say("engine server start", worker=wid, pid=fresh.proc.pid, healthy=ok)
        elif kind == "engine_freeze":
            adv.say("SIGSTOP engine server", worker=wid, for_s=p["for_s"])
            t0 = time.time()
            m.freezes.stop(es.proc)
            try:
                await asyncio.sleep(p["for_s"])
            finally:
                m.freezes.cont(es.proc)
                es.stops.append([t0, time.time()])
            adv.say("SIGCONT engine server", worker=wid)
        elif kind == "engine_pause_error":
            if not await servers.refuse_pauses(es, p["for_s"]):
                adv.say(f"{kind} skipped", worker=wid, reason="the server did not take the fault")
                return False
            adv.say("engine refuses pauses", worker=wid, for_s=p["for_s"])
        else:
            return False
    finally:
        adv.busy.discard(busy)
    if kind == "engine_pause_error":
        # (The server is not held meanwhile: a kill or a freeze may meet the refusal window.)
        if p.get("publish", True):
            # An activation must meet the refusal: publish while the window is open.
            await asyncio.sleep(min(0.5, p["for_s"] / 4))
            adv.spawn(adv.publish("to meet a refused pause"))
        await asyncio.sleep(max(0.0, es.refusing[-1][1] - time.time()))
        if es.end is not None and es.end < es.refusing[-1][1]:
            es.refusing[-1][1] = es.end  # (killed meanwhile: the refusal died with it)
        adv.say("engine takes pauses again", worker=wid, alive=es.alive)
    return True


# -- what the oracle reads of them ---------------------------------------------------------------

ENGINE_BACK_GRACE_S = 5.0  # a restarted server is reloaded (the adapter's health look, 2 s) and registered


def engine_out(lives: list[Any], t: float) -> bool:
    """Whether a worker whose engine server lives are ``lives`` (``start``, ``end``, ``stops``)
    has no server able to answer at ``t``: none running (killed, not yet restarted), or the one
    running frozen (SIGSTOP). Such a worker cannot serve whatever its registry entry says."""
    for es in lives:
        if es.start <= t and (es.end is None or t < es.end):
            return any(a <= t <= b for a, b in es.stops)
    return True


def back_moments(lives: list[Any]) -> list[tuple[float, str]]:
    """The moments a worker's server was back after an engine event, and what the event was: a
    restarted server's start (after the first life), a freeze's end, a refusal window's end."""
    out: list[tuple[float, str]] = []
    for i, es in enumerate(sorted(lives, key=lambda e: e.start)):
        if i > 0:
            out.append((float(es.start), "restarted (SIGKILL)"))
        out += [(float(b), "thawed (SIGSTOP)") for _, b in es.stops]
        out += [
            (float(b), "taking pauses again (they were answered HTTP 500)")
            for _, b in es.refusing
            if es.end is None or b < es.end  # (a window its death ended is no moment back)
        ]
    return sorted(out)


def serves_again(
    back: float,
    bound: float,
    serving_at: list[float],
    delivered_at: list[float],
    results_at: list[float],
) -> tuple[bool, str]:
    """Whether a replica served again after its engine server was back at ``back``: its registry
    said a serving state at some moment of ``[back, back + bound]`` (``serving_at``), and if jobs
    were delivered to it from then (``delivered_at``), it published a result for one within the
    bound after the first (``results_at``). (ok, what went wrong)."""
    if not any(back <= t <= back + bound for t in serving_at):
        return False, f"its registry entry said no serving state for {bound:.0f} s"
    later = sorted(t for t in delivered_at if t >= back)
    if later and not any(later[0] <= t <= later[0] + bound for t in results_at):
        return False, f"jobs were delivered to it from {later[0] - back:.1f} s after, none answered with a result"
    return True, ""
