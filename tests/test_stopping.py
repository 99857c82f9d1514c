"""Processes stop when told, at every stage, and leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import rollfleet_command, start_worker_process, terminate, wait_until
from rollfleet.broker import free_port
from rollfleet.trainer_client import RolloutClient
from tests.helpers import REPO


def pids_with(needle: str) -> list[int]:
    """Live processes whose command line contains ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State"))
            except (OSError, StopIteration):
                continue
            if needle in cmdline and "zombie" not in state:
                found.append(int(entry.name))
    return found


def stops_within(proc: subprocess.Popen[bytes], seconds: float) -> float:
    t0 = time.monotonic()
    proc.wait(seconds)
    return time.monotonic() - t0


async def test_sigkill_of_up_leaves_no_broker_and_no_workers(tmp_path: Path) -> None:
    port = free_port()
    cmd = rollfleet_command("up", "--workers", "1", "--engine", "echo", "--home", str(tmp_path / "home"))
    cmd += ["--port", str(port), "--metrics-base-port", "0", "--namespace", "killed"]
    up = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while "fleet ready" not in (line := up.stdout.readline()):  # type: ignore[union-attr]
            assert time.monotonic() < deadline and up.poll() is None, line
        broker = pids_with(f"-p {port}")
        workers = pids_with(f"nats://127.0.0.1:{port}")
        assert len(broker) == 1 and len(workers) == 1, (broker, workers)
        up.send_signal(signal.SIGKILL)
        up.wait(5)
        await wait_until(lambda: not pids_with(f"-p {port}"), 15, what="the broker to exit after its parent")
        await wait_until(lambda: not pids_with(f"nats://127.0.0.1:{port}"), 15, what="the worker to exit")
    finally:
        terminate(up, 5.0, signal.SIGKILL)
        for pid in pids_with(f"-p {port}") + pids_with(f"nats://127.0.0.1:{port}"):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_still_connecting_stops_on_sigterm(tmp_path: Path) -> None:
    dead_port = free_port()  # nothing listens there: the worker keeps trying to connect
    worker = start_worker_process(f"nats://127.0.0.1:{dead_port}", "ns", "w", log_path=tmp_path / "w.log")
    try:
        # Trying to connect (it says so once a dial failed): its signal handlers are in place by
        # then. (A fixed sleep was not enough on a loaded host: the SIGTERM came during imports.)
        log = tmp_path / "w.log"
        deadline = time.monotonic() + 60
        while "nats error" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.poll() is None, log.read_text()[-2000:]  # still trying
        worker.send_signal(signal.SIGTERM)
        stops_within(worker, 10)  # (it would keep trying to connect for good)
        assert worker.returncode == 0, (tmp_path / "w.log").read_text()[-2000:]
    finally:
        terminate(worker, 5.0, signal.SIGKILL)


async def test_a_worker_catching_up_stops_on_sigterm(nats_url: str, namespace: str, tmp_path: Path) -> None:
    """Following an empty store, a worker waits for a first commit (up to an hour by default);
    SIGTERM ends that wait at once, and its registry entry goes with it."""
    args = ("--store", str(tmp_path / "store"), "--local-dir", str(tmp_path / "local"))
    worker = start_worker_process(nats_url, namespace, "waiting", *args, log_path=tmp_path / "w.log")
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: [r.state for r in client.fleet.replicas()] == ["starting"], 20)
            worker.send_signal(signal.SIGTERM)
            stops_within(worker, 10)  # (not the hour its wait for a first commit would last)
            assert worker.returncode == 0
            await client.fleet.refresh()
            assert client.fleet.replicas(live_only=False) == []
    finally:
        terminate(worker, 5.0, signal.SIGKILL)


def test_status_against_no_broker_fails_fast_in_one_line() -> None:
    for url in (f"nats://127.0.0.1:{free_port()}", "nats://no-such-host.invalid:4222"):
        out = subprocess.run(  # (a status that kept retrying would run into the time-out)
            [sys.executable, "-m", "rollfleet", "status", "--nats", url], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2, (url, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rollfleet: error:") and "cannot connect" in lines[0], lines
