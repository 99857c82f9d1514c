"""A local fleet: the embedded broker and N workers as child processes (``rollfleet up``).

Workers run in their own processes, as they would on other machines; they die with this
process (PDEATHSIG on Linux), so an interrupted ``up`` leaves no orphans. The broker's
store survives for the next start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from rollfleet.broker import EmbeddedBroker, check_server_binary
from rollfleet.cli.status import collect_status
from rollfleet.runtime.logs import get_logger
from rollfleet.runtime.processes import die_with_parent
from rollfleet.schemas.errors import ServiceUnavailable

log = get_logger("rollfleet.cli.up")


@dataclass
class LocalFleet:
    home: Path = Path(".rollfleet")
    namespace: str = "default"
    workers: int = 2
    engine: str = "echo"
    port: int = 0  # broker port; 0 picks a free one
    store_dir: Path | None = None  # policy store the workers follow (hf engine)
    follow_versions: bool = True  # without a store (echo): activate each committed version anyway
    metrics_base_port: int | None = 0  # worker i serves metrics on base+i; 0: free ports; None: off
    worker_args: list[str] = field(default_factory=list)
    broker: EmbeddedBroker | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        assert self.broker is not None
        return self.broker.url

    def start_broker(self) -> str:
        self.home.mkdir(parents=True, exist_ok=True)
        self.broker = EmbeddedBroker(
            store_dir=self.home / "broker",
            port=self.port,
            binary=check_server_binary(),
            log_file=self.home / "nats.log",
        ).start()
        return self.broker.url

    def start_workers(self) -> None:
        logs_dir = self.home / "logs"
        logs_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.workers):
            worker_id = f"{self.engine}-{i}"
            cmd = [sys.executable, "-m", "rollfleet", "worker", "--nats", self.url, "--namespace", self.namespace]
            cmd += ["--engine", self.engine, "--worker-id", worker_id]
            if self.store_dir is not None:
                cmd += ["--store", str(self.store_dir), "--local-dir", str(self.home / "replicas" / worker_id)]
            elif self.follow_versions:
                cmd += ["--follow-versions"]
            if self.metrics_base_port is not None:
                # 0: the worker binds a free port itself and says which in its registry entry (a
                # port found free here could be taken before the worker binds it).
                port = self.metrics_base_port + i if self.metrics_base_port else 0
                if port:
                    self.metrics_ports[worker_id] = port
                cmd += ["--metrics-port", str(port)]
            cmd += self.worker_args
            env = {**os.environ, "ROLLFLEET_LOG_JSON": "1"}
            with open(logs_dir / f"{worker_id}.log", "ab") as out:
                self.procs[worker_id] = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
                )

    async def wait_ready(self, timeout: float = 180.0) -> dict[str, object]:
        """Until every worker is registered and ready; fails early if one exits."""
        deadline = time.monotonic() + timeout
        while True:
            for worker_id, proc in self.procs.items():
                if proc.poll() is not None:
                    log_file = self.home / "logs" / f"{worker_id}.log"
                    tail = log_file.read_text(errors="replace")[-1500:] if log_file.exists() else ""
                    raise ServiceUnavailable(f"worker {worker_id} exited with {proc.returncode}: {tail}")
            snapshot = await collect_status(self.url, self.namespace)
            ready = {r["worker_id"] for r in snapshot["replicas"] if r["live"] and r["state"] == "ready"}
            if set(self.procs) <= ready:
                for r in snapshot["replicas"]:  # the ports workers picked themselves (metrics_url)
                    url = str(r.get("metrics_url") or "")
                    if r["worker_id"] in self.procs and r["worker_id"] not in self.metrics_ports and url:
                        with suppress(ValueError):
                            self.metrics_ports[r["worker_id"]] = int(url.rsplit(":", 1)[1].split("/", 1)[0])
                return snapshot
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"workers not ready after {timeout:.0f}s: ready={sorted(ready)}")
            await asyncio.sleep(0.3)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM every worker (they drain), then stop the broker last."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.broker is not None:
            self.broker.stop()

    def describe(self) -> str:
        lines = [
            f"broker     {self.url}   (store {self.home.resolve() / 'broker'})",
            f"namespace  {self.namespace}",
        ]
        if self.store_dir is not None:
            lines.append(f"policy     {self.store_dir.resolve()}")
        for worker_id, proc in self.procs.items():
            metrics = self.metrics_ports.get(worker_id)
            where = f"metrics http://127.0.0.1:{metrics}/metrics" if metrics else "metrics off"
            lines.append(f"worker     {worker_id:<10} pid {proc.pid:<8} {where}")
        lines.append(f"logs       {(self.home / 'logs').resolve()}")
        return "\n".join(lines)
