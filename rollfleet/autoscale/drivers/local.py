"""Worker processes on this host: ``rollfleet worker`` started and stopped by signal.

A replica following ``latest`` is started as ``rollfleet up`` starts one (``--store`` and a
local directory of its own, or ``--follow-versions`` for a model-free engine); one held at
version V with ``--hold-version V`` (a store) or ``--version V`` (the echo engine, which
reads no weights). Retiring is SIGTERM: the worker drains.

Worker ids are ``<prefix>-<n>`` and ``<prefix>-v<V>-<n>``. With ``keep_workers`` (``rollfleet
autoscale`` alone) the workers live in sessions of their own and outlive the controller; a
controller that starts again finds them by their command lines (``/proc``) and retires them as
its own, so nothing it needs to know lives only in its memory. Without it (``rollfleet up
--autoscale``) they die with it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from rollfleet.autoscale.drivers.base import Run
from rollfleet.runtime.logs import get_logger
from rollfleet.runtime.processes import die_with_parent

log = get_logger("rollfleet.autoscale.local")


def command_flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in a command line (``--name value`` or ``--name=value``); None if absent."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _worker_of(argv: list[str], namespace: str, prefix: str, url: str | None = None) -> tuple[str, int | None] | None:
    """(worker id, held version) of a ``rollfleet worker`` command line of this driver's; None
    for any other process. ``url``: only a worker of that broker (another fleet on this host may
    use the same namespace and prefix: its workers are not this controller's to count or retire)."""
    if "worker" not in argv or not any(a.endswith("rollfleet") or a == "rollfleet" for a in argv):
        return None
    worker_id = command_flag(argv, "--worker-id")
    if (command_flag(argv, "--namespace") or "default") != namespace or not worker_id:
        return None
    if url is not None and command_flag(argv, "--nats") != url:
        return None
    if not worker_id.startswith(prefix + "-"):
        return None
    held = command_flag(argv, "--hold-version")
    if held is None and "--follow-versions" not in argv and "--store" not in argv:
        held = command_flag(argv, "--version") or "0"
    return worker_id, int(held) if held is not None else None


@dataclass
class _Proc:
    pid: int
    held: int | None
    started_at: float
    popen: subprocess.Popen[bytes] | None = None  # None: adopted from an earlier controller
    retiring: bool = False

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # (a zombie of a process that is not our child is reaped by its own parent)
        with suppress(OSError):
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            return state != "Z"
        return True


@dataclass
class LocalDriver:
    url: str
    namespace: str = "default"
    engine: str = "echo"
    home: Path = Path(".rollfleet")
    store: Path | None = None  # the policy store followed (hf); None: --follow-versions
    follow_versions: bool = True
    worker_args: list[str] = field(default_factory=list)
    prefix: str = "auto"
    keep_workers: bool = False  # outlive the controller (and be found again by the next one)
    name: str = "local"
    _procs: dict[str, _Proc] = field(default_factory=dict)
    _adopted: bool = False

    def owns(self, worker_id: str, host: str = "") -> bool:
        return worker_id.startswith(self.prefix + "-")

    def _adopt(self) -> None:
        """Workers of an earlier controller, found by their command lines."""
        proc_dir = Path("/proc")
        if not proc_dir.is_dir():
            return
        for entry in proc_dir.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            found = _worker_of([a for a in argv if a], self.namespace, self.prefix, self.url)
            if found is not None and found[0] not in self._procs:
                worker_id, held = found
                self._procs[worker_id] = _Proc(int(entry.name), held, time.time())  # (its entry says when)
                log.info("autoscale adopted a worker", worker_id=worker_id, pid=int(entry.name), held=held)

    async def runs(self) -> list[Run]:
        if not self._adopted:
            self._adopted = True
            self._adopt()
        for worker_id, proc in list(self._procs.items()):
            if not proc.alive():
                del self._procs[worker_id]
        return [Run(w, p.held, p.started_at, p.retiring) for w, p in self._procs.items()]

    def command(self, worker_id: str, held: int | None) -> list[str]:
        cmd = [sys.executable, "-m", "rollfleet", "worker", "--nats", self.url, "--namespace", self.namespace]
        cmd += ["--engine", self.engine, "--worker-id", worker_id]
        if self.store is not None:
            cmd += ["--store", str(self.store), "--local-dir", str(self.home / "replicas" / worker_id)]
            if held is not None:
                cmd += ["--hold-version", str(held)]
        elif held is not None:
            cmd += ["--version", str(held)]  # (a model-free engine: a fixed version is a held one)
        elif self.follow_versions:
            cmd += ["--follow-versions"]
        return cmd + list(self.worker_args)

    async def launch(self, held: int | None) -> str:
        tail = secrets.token_hex(3)
        worker_id = f"{self.prefix}-{tail}" if held is None else f"{self.prefix}-v{held}-{tail}"
        # Started on this (the loop's) thread: a child's PDEATHSIG fires when the thread that
        # started it ends, and this one lives as long as the controller.
        popen = self._spawn(worker_id, held)
        self._procs[worker_id] = _Proc(popen.pid, held, time.time(), popen)
        return worker_id

    def _spawn(self, worker_id: str, held: int | None) -> subprocess.Popen[bytes]:
        logs_dir = self.home / "logs"
        logs_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "ROLLFLEET_LOG_JSON": "1"}
        with open(logs_dir / f"{worker_id}.log", "ab") as out:
            return subprocess.Popen(
                self.command(worker_id, held),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=self.keep_workers,
                preexec_fn=None if self.keep_workers else die_with_parent,
            )

    async def retire(self, worker_id: str, host: str = "") -> None:
        proc = self._procs.get(worker_id)
        if proc is None or proc.retiring:
            return
        proc.retiring = True
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)

    def pids(self) -> dict[str, int]:
        """The worker processes alive now, by worker id."""
        return {w: p.pid for w, p in self._procs.items() if p.alive()}

    def stop_all(self, timeout: float = 60.0) -> None:
        """SIGTERM every worker (they drain) and wait for them; SIGKILL what is left."""
        for proc in self._procs.values():
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            while proc.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.alive():
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            if proc.popen is not None:
                with suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(5)
        self._procs.clear()

    async def close(self) -> None:
        if not self.keep_workers:
            await asyncio.to_thread(self.stop_all)
        for proc in self._procs.values():  # (kept: reap nothing, leave them running)
            proc.popen = None
