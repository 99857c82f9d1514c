"""The path a newcomer takes: `rollfleet --help`, `rollfleet up --help`, `rollfleet up` (what it
prints, and echo workers that follow versions), the README's training-loop snippet run against a
real `rollfleet up`, `rollfleet status` showing a busy replica busy, and the demo's units."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import running_worker, wait_until
from rollfleet.broker import free_port
from rollfleet.cli.main import build_parser
from rollfleet.cli.status import collect_status, render_table
from rollfleet.schemas import VersionRecord
from rollfleet.trainer_client import RolloutClient
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import REPO, payload

COMMANDS = ("broker", "declare", "worker", "up", "gateway", "autoscale", "permissions", "status", "replay")
README_URL = "nats://127.0.0.1:4222"


def cli(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "rollfleet", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    return proc.stdout


def test_rollfleet_help_describes_itself_and_every_command() -> None:
    text = cli("--help")
    assert "module" not in text and "external rollout service" in text, text  # for users, not developers
    listed = {m.group(1) for m in re.finditer(r"^    (\w+)\s+\S", text, re.MULTILINE)}
    assert listed == set(COMMANDS), text  # each command on its own line, with what it does
    assert "rollfleet up" in text and "rollfleet status" in text  # where to start


def test_up_help_explains_every_flag_with_its_default() -> None:
    text = " ".join(cli("up", "--help").split())  # argparse wraps lines: compare word by word
    assert "print the broker URL, namespace, policy store and base a trainer uses" in text
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in commands.choices["up"]._actions:
        assert action.help, f"{action.option_strings} has no help"
    for default in ("worker processes to start (default: 2)", "(default: echo)", "(default: default)",
                    "(default: .rollfleet)", "(default: 4222)", "(default: 9400)", "(default: True)",
                    "default: HOME/store"):  # fmt: skip
        assert default in text, default


class Up:
    """A real `rollfleet up` child process, read line by line until its fleet is ready."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rollfleet", "up", *args, "--port", str(self.port), "--metrics-base-port", "0"]
        env = {**os.environ, "ROLLFLEET_LOG_LEVEL": "warning", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )  # fmt: skip
        self.lines: list[str] = []

    async def ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not any("fleet ready" in line for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines)
            line = await asyncio.to_thread(self.proc.stdout.readline)  # type: ignore[union-attr]
            self.lines.append(line)
        return "".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def connect_line(text: str) -> str:
    return next(line.strip() for line in text.splitlines() if line.strip().startswith("RolloutClient.connect("))


async def test_up_prints_its_connect_line_and_echo_workers_follow_versions(tmp_path: Path) -> None:
    up = Up(["--workers", "2", "--engine", "echo", "--namespace", "quick", "--home", str(tmp_path / "home")], tmp_path)
    try:
        text = await up.ready(90)
        async with await RolloutClient.connect(up.url, namespace="quick", client_id="trainer-0") as client:
            await client.wait_for_version(0, replicas=2, timeout=20)
            # A commit without a store: echo workers have no weights to read, yet follow it.
            await client.commit_version(VersionRecord(version=1, kind="delta", base_version=0))
            await client.wait_for_version(1, replicas=2, timeout=20)
            result = await (await client.submit(payload(), exact_version=1)).result(20)
            assert result.version_start == 1
        line = next((line.strip() for line in text.splitlines() if "RolloutClient.connect(" in line), None)
        assert line == f'RolloutClient.connect("{up.url}", namespace="quick", client_id="trainer-0")', text
        assert up.stop() == 0
    finally:
        up.stop()


def readme_quick_path() -> tuple[list[str], str]:
    """The `rollfleet up` command and the Python program of the README's training-loop section."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Using it from a training loop\n", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    up_line = next(line for line in bash.splitlines() if line.startswith("rollfleet up"))
    python = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    return up_line.split("#", 1)[0].split()[2:], python


@pytest.mark.slow
async def test_the_readme_quick_path_runs_against_rollfleet_up(tmp_path: Path) -> None:
    """Copied top to bottom: `rollfleet up` as the README writes it (only its port is free here, as
    other tests' brokers may hold 4222), then its Python program, verbatim but for that port."""
    up_args, program = readme_quick_path()
    assert README_URL in program
    up = Up(up_args, tmp_path)  # in the directory the program runs in: it uses the relative paths
    try:
        text = await up.ready(180)
        printed = connect_line(text)
        assert printed.replace(up.url, README_URL) in program, (printed, text)  # README and `up` agree
        publisher = next(line.strip() for line in text.splitlines() if line.strip().startswith("PolicyPublisher("))
        store, base = re.findall(r'"([^"]+)"', publisher)
        for relative in re.findall(r'"(\.rollfleet/[^"]+)"', program):
            assert (tmp_path / relative).exists(), relative
        assert (tmp_path / ".rollfleet/store").resolve() == Path(store)
        assert (tmp_path / ".rollfleet/models/tiny").resolve() == Path(base)
        script = tmp_path / "train.py"
        script.write_text(program.replace(README_URL, up.url))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run = await asyncio.to_thread(
            subprocess.run, [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
            timeout=240,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "the fleet serves version 1" in run.stdout, run.stdout
        status = json.loads(cli("status", "--nats", up.url, "--json"))  # `status` defaults to up's namespace
        assert sorted(r["active_version"] for r in status["replicas"]) == [1, 1], status
        assert up.stop() == 0
    finally:
        up.stop()


async def test_status_shows_a_busy_replica_busy_and_then_idle(nats_url: str, namespace: str) -> None:
    """The heartbeat is 20 s (the default); the figure must not wait for it."""
    engine = EchoEngine(latency_s=6.0)  # longer than the wait below
    async with (
        running_worker(nats_url, namespace, worker_id="w", heartbeat_s=20.0, engine=engine),
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)

        async def shows(in_flight: int) -> bool:
            snapshot = await collect_status(nats_url, namespace)
            return snapshot["replicas"][0]["in_flight"] == in_flight

        handle = await client.submit(payload(), min_version=0)
        t0 = time.monotonic()
        await wait_until(lambda: shows(1), timeout=4, interval=0.2, what="status to show the job in flight")
        busy_after = time.monotonic() - t0
        table = render_table(await collect_status(nats_url, namespace))
        assert re.search(r"^w\s+ready\s+0\s+-\s+1\s", table, re.MULTILINE), table  # the `in flight` column
        await handle.result(10)
        t1 = time.monotonic()
        await wait_until(lambda: shows(0), timeout=4, interval=0.2, what="status to show the replica idle")
        print(f"status showed the job after {busy_after:.2f} s and the idle replica {time.monotonic() - t1:.2f} s")


def load_demo() -> object:
    spec = importlib.util.spec_from_file_location("async_grpo", REPO / "examples" / "async_grpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_grpo"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_demo_reports_drops_in_samples_and_waste_by_cause(tmp_path: Path) -> None:
    demo: object = load_demo()
    cfg = demo.DemoConfig(out=tmp_path)  # type: ignore[attr-defined]
    step = {"version": 1, "reward": 0.5, "samples": 32, "staleness_mean": 1.0, "staleness_max": 1, "replicas": {}}
    stats = demo.StepStats  # type: ignore[attr-defined]
    cfg.history = [
        stats(step=1, dropped_stale=16, dropped_groups=2, prepare_s=None, pause_s=None, seconds=1,
              utilization=0.5, waste_tokens={"stale": 192, "failed": 8}, **step),
        stats(step=2, dropped_stale=0, dropped_groups=0, prepare_s=None, pause_s=None, seconds=1,
              utilization=0.25, waste_tokens={"stale": 8}, **step),
    ]  # fmt: skip
    lines: list[str] = []
    demo._report(cfg, tmp_path, lambda *a: lines.append(" ".join(map(str, a))))  # type: ignore[attr-defined]
    text = "\n".join(lines)
    assert "samples trained on       64  (dropped as too stale: 16 samples in 2 groups, 20.0% of 80 generated)" in text
    assert "{'stale': 200, 'failed': 8}" in text and "38% of slots busy" in text
