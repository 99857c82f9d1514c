"""`rollfleet up`, `rollfleet status` and the workers' Prometheus metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from harness import running_worker, wait_until
from rollfleet.broker import free_port
from rollfleet.models import build_model_dir
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests.helpers import REPO, payload


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric(values: dict[str, float], prefix: str, **labels: str) -> float:
    for name, value in values.items():
        if name.startswith(prefix + "{") and all(f'{k}="{v}"' in name for k, v in labels.items()):
            return value
    return 0.0


async def test_up_runs_a_fleet_and_stops_it_cleanly(tmp_path: Path) -> None:
    port = free_port()
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "rollfleet", "up", "--workers", "2", "--engine", "echo", "--home", str(home)]
    cmd += ["--port", str(port), "--metrics-base-port", "0", "--namespace", "upns"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "ROLLFLEET_LOG_LEVEL": "warning"},
    )  # fmt: skip
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not any("fleet ready" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stdout.readline())  # type: ignore[union-attr]
        text = "".join(lines)
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        metrics_ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)/metrics", text)]
        assert len(pids) == 2 and len(metrics_ports) == 2 and f"nats://127.0.0.1:{port}" in text
        url = f"nats://127.0.0.1:{port}"
        status = subprocess.run(
            [sys.executable, "-m", "rollfleet", "status", "--nats", url, "-n", "upns", "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        snapshot = json.loads(status.stdout)
        assert sorted(r["worker_id"] for r in snapshot["replicas"]) == ["echo-0", "echo-1"]
        assert all(r["state"] == "ready" and r["live"] for r in snapshot["replicas"])
        async with await RolloutClient.connect(url, namespace="upns", client_id="c") as client:
            results = [await (await client.submit(payload(), min_version=0)).result(10) for _ in range(4)]
        done = sum(metric(scrape(p), "rollfleet_jobs_total", outcome="ok") for p in metrics_ports)
        assert done == 4 and {r.worker_id for r in results} <= {"echo-0", "echo-1"}
        table = subprocess.run(
            [sys.executable, "-m", "rollfleet", "status", "--nats", url, "-n", "upns"],
            cwd=REPO, capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        assert "echo-0" in table and "queue depth" in table
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in pids:  # no orphans
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {pid} outlived `rollfleet up`")
    assert (home / "broker" / "jetstream").is_dir()  # the store survives for the next start


async def test_metrics_move_with_jobs_and_activations(nats_url: str, namespace: str, tmp_path: Path) -> None:
    base = build_model_dir(tmp_path / "base", preset="tiny")
    store = tmp_path / "store"
    publisher = PolicyPublisher(store, base)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        from safetensors.torch import load_file

        tensors = load_file(str(base / "model.safetensors"))
        await client.publish_policy(publisher, tensors)
        # The echo engine ignores weights, but the worker still prepares and activates versions.
        async with running_worker(
            nats_url, namespace, store_dir=store, local_dir=tmp_path / "local", metrics_port=0
        ) as worker:
            port = worker.metrics.port
            assert port is not None
            before = scrape(port)
            for _ in range(3):
                await (await client.submit(payload(), min_version=0)).result(10)
            for t in tensors.values():
                t.view(-1)[:3] += torch.tensor(1.0, dtype=t.dtype)
            await client.publish_policy(publisher, tensors)
            await client.wait_for_version(1, timeout=20)
            await wait_until(lambda: metric(scrape(port), "rollfleet_activations_total") == 1, timeout=10)
            # Announced first, then served: the served-version gauge follows a moment later.
            await wait_until(lambda: metric(scrape(port), "rollfleet_active_version") == 1, timeout=10)
            after = scrape(port)
    assert (
        metric(after, "rollfleet_jobs_total", outcome="ok") - metric(before, "rollfleet_jobs_total", outcome="ok") == 3
    )
    assert metric(after, "rollfleet_active_version") == 1
    assert metric(after, "rollfleet_wire_bytes_total") > 0 and metric(after, "rollfleet_update_density") > 0
    assert after["rollfleet_queue_wait_seconds_count" + _labels(after, "rollfleet_queue_wait_seconds_count")] == 3
    assert metric(after, "rollfleet_pause_seconds_count") == 1 and metric(after, "rollfleet_prepare_seconds_count") == 1


def _labels(values: dict[str, float], prefix: str) -> str:
    name = next(n for n in values if n.startswith(prefix + "{"))
    return name[len(prefix) :]
