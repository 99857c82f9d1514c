"""Real child processes: ``rollfleet worker`` and any other command, with log files, by name."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollfleet.runtime.processes import die_with_parent, terminate

# Children log JSON lines at info level, so tests can read their structured events.
CHILD_LOG_ENV = {"ROLLFLEET_LOG_JSON": "1", "ROLLFLEET_LOG_LEVEL": "info"}


def rollfleet_command(*args: str) -> list[str]:
    """The ``rollfleet`` CLI run by this interpreter (so a venv's install is the one used)."""
    return [sys.executable, "-m", "rollfleet", *args]


def worker_command(url: str, namespace: str, worker_id: str, *args: str) -> list[str]:
    """A ``rollfleet worker`` command line (echo engine at version 0 unless ``args`` say otherwise)."""
    return rollfleet_command("worker", "--nats", url, "--namespace", namespace, "--worker-id", worker_id, *args)


_ROOT = str(Path(__file__).resolve().parents[1])  # the checkout: harness/ lies beside the package


def _with_harness(env: dict[str, str]) -> dict[str, str]:
    """A child's environment with the checkout on its path, after whatever it had: a child that
    runs ``-m harness...`` or imports it finds it from any working directory (``harness/`` is
    not installed with the package), and a ``PYTHONPATH`` naming another checkout still wins."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return env if _ROOT in paths else {**env, "PYTHONPATH": os.pathsep.join([*paths, _ROOT])}


def spawn(
    cmd: Sequence[str],
    log_path: Path | None = None,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    tie_to_parent: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout and stderr appended to ``log_path`` (or discarded).

    ``tie_to_parent``: the child gets SIGTERM when this process dies, so a crashed test run
    leaves no orphans. Otherwise it runs in its own session (nothing is sent to it on our death).
    """
    out: Any = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=_with_harness({**os.environ, **(env or {})}),
            preexec_fn=die_with_parent if tie_to_parent else None,
            start_new_session=not tie_to_parent,
        )
    finally:
        if log_path:
            out.close()


def start_worker_process(
    url: str,
    namespace: str,
    worker_id: str,
    *args: str,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    heartbeat: float = 0.5,
) -> subprocess.Popen[bytes]:
    """A real ``rollfleet worker`` process with a fast heartbeat, logging JSON to ``log_path``."""
    cmd = worker_command(url, namespace, worker_id, "--heartbeat", str(heartbeat), *args)
    return spawn(cmd, log_path, env={**CHILD_LOG_ENV, **(env or {})}, cwd=cwd)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    """SIGTERM every process at once (workers drain in parallel), then kill what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        terminate(proc, max(0.1, deadline - time.monotonic()))


async def sigterm_then_kill(proc: subprocess.Popen[bytes], timeout: float, poll_s: float = 0.05) -> bool:
    """SIGTERM ``proc`` (a drain) and wait up to ``timeout`` without blocking the event loop; SIGKILL
    it if it is still running then. Whether it had to be killed."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        await asyncio.sleep(poll_s)
    if proc.poll() is None:
        terminate(proc, 5.0, signal.SIGKILL)
        return True
    return False


def check_alive(procs: Sequence[subprocess.Popen[bytes]], what: str) -> None:
    dead = [p.args for p in procs if p.poll() is not None]
    if dead:
        raise RuntimeError(f"{what} exited early: {dead}")


class ProcessGroup:
    """Real child processes of one test or scenario, by name, each logging to ``<workdir>/<name>.log``;
    ``close`` stops whatever is left."""

    def __init__(self, workdir: Path, cwd: Path | None = None) -> None:
        self.workdir = Path(workdir)
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def spawn(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = spawn(cmd, self.log(name), env={**CHILD_LOG_ENV, **(env or {})}, cwd=self.cwd)
        self.procs[name] = proc
        return proc

    def worker(
        self,
        url: str,
        namespace: str,
        worker_id: str,
        *args: str,
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """A real ``rollfleet worker`` process (echo engine unless ``args`` say otherwise)."""
        cmd = worker_command(url, namespace, worker_id, "--heartbeat", "0.5", *args)
        return self.spawn(name or worker_id, cmd, env)

    def module(self, name: str, module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``python -m MODULE ARGS`` as a named process."""
        return self.spawn(name, [sys.executable, "-m", module, *args], env)

    def alive(self, prefix: str = "") -> list[str]:
        return [n for n, p in self.procs.items() if n.startswith(prefix) and p.poll() is None]

    def kill(self, name: str) -> None:
        terminate(self.procs[name], 10.0, signal.SIGKILL)

    def stop(self, name: str, timeout: float = 15.0) -> int | None:
        return terminate(self.procs[name], timeout)

    def close(self) -> None:
        stop_all(list(self.procs.values()), timeout=5.0)

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log(name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_events(self, name: str, event: str) -> list[dict[str, Any]]:
        """The structured (JSON) log lines of one process with ``event``."""
        out: list[dict[str, Any]] = []
        try:
            lines = self.log(name).read_text(errors="replace").splitlines()
        except OSError:
            return out
        for line in lines:
            if line.startswith("{"):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if doc.get("event") == event:
                    out.append(doc)
        return out

    async def wait_log(self, name: str, needle: str, timeout: float) -> bool:
        """Whether ``needle`` appears in the log of ``name`` within ``timeout`` (or before it exits)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.tail(name, 1 << 24):
                return True
            if self.procs[name].poll() is not None:
                return needle in self.tail(name, 1 << 24)
            await asyncio.sleep(0.05)
        return False
