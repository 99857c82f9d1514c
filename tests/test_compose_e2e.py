"""`docker compose` for real: docker-compose.yml and the Dockerfile, run in containers.

One compose project per run (a unique project name and namespace), in this order:

1. the worker image (slim: echo only) and the demo image (hf + demo extras) build through compose;
2. ``up -d --scale worker=3``: the broker turns healthy, three workers register, a trainer on
   the host (published port) and one inside the compose network (``compose run``) both submit
   version-constrained jobs, and every worker serves some;
3. the host trainer publishes into the store the workers mount (ROLLFLEET_WEIGHTS): every
   worker activates the new version and results report it;
4. a worker container killed mid-job loses nothing; scaling down to one worker drains the
   others (every job answered once, their registry entries deleted, no stop time-out);
5. ``--profile demo up --exit-code-from demo-trainer`` runs the demo to completion and its
   summary and plot are copied out;
6. ``down`` leaves nothing running, ``down -v`` removes the volumes.

Build times, image sizes and per-worker memory go to .rollfleet/compose/measurements.json.
Skipped where no Docker engine with Compose v2 is reachable (see ``make compose``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rollfleet.broker import free_port
from rollfleet.broker.kv import read_replicas
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests import compose_trainer

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
TRAINER_SCRIPT = REPO / "tests" / "compose_trainer.py"
MEASUREMENTS = REPO / ".rollfleet" / "compose" / "measurements.json"
SLIM_IMAGE, DEMO_IMAGE = "rollfleet:latest", "rollfleet:demo"
WORKERS = 3
# Echo jobs take a while (so kills and scale-downs hit running jobs); a holder that dies loses
# its jobs to others after 5 s instead of 30 s.
WORKER_ARGS = "--echo-latency 0.4 --ack-wait 5"
PROFILES = ("--profile", "demo", "--profile", "objects")


def _run(cmd: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def docker_setup() -> tuple[list[str] | None, str]:
    """The Compose v2 command, or None and why not."""
    if shutil.which("docker") is None:
        return None, "no `docker` CLI on PATH"
    try:
        info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30)
    except subprocess.TimeoutExpired:
        info = None
    if info is None or info.returncode != 0:
        why = (info.stderr.strip().splitlines() or ["time-out"])[-1] if info else "time-out"
        host = os.environ.get("DOCKER_HOST", "unset, so the default socket")
        return None, f"no Docker engine reachable (DOCKER_HOST {host}): {why}"
    for cmd in (["docker", "compose"], ["docker-compose"]):
        try:
            out = _run([*cmd, "version", "--short"], timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and re.match(r"v?([2-9]|\d\d)\.", out.stdout.strip()):
            return cmd, ""
    return None, "Docker Compose v2 is needed (`docker compose` or docker-compose >= 2)"


@dataclass
class Stack:
    """One compose project: the commands, its settings, the host's weight store, figures."""

    compose: list[str]
    project: str
    namespace: str
    weights: Path
    port: int
    env: dict[str, str]
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def __call__(self, *args: str, timeout: float = 300, check: bool = True, stdin: Any = None) -> str:
        cmd = [*self.compose, "-f", str(COMPOSE_FILE), "-p", self.project, *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=REPO, stdin=stdin)
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
        return out.stdout

    def containers(self, service: str | None = None, *, running_only: bool = True) -> list[str]:
        """Container names of this project (or one service), running or all."""
        cmd = ["docker", "ps", "--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            cmd += ["--filter", f"label=com.docker.compose.service={service}"]
        cmd += ["--format", "{{.Names}}"] + ([] if running_only else ["-a"])
        return sorted(_run(cmd, env=self.env).stdout.split())

    def hostnames(self, service: str) -> dict[str, str]:
        """Container name -> hostname (the worker id's prefix: ``<hostname>-<pid>``)."""
        names = self.containers(service)
        if not names:
            return {}
        out = _run(["docker", "inspect", "--format", "{{.Name}} {{.Config.Hostname}}", *names], env=self.env)
        return dict(line.strip("/").split() for line in out.stdout.splitlines())

    def record(self, **figures: Any) -> None:
        self.figures.update(figures)
        MEASUREMENTS.parent.mkdir(parents=True, exist_ok=True)
        MEASUREMENTS.write_text(json.dumps(self.figures, indent=2))
        for key, value in figures.items():
            print(f"compose measurement: {key} = {value}", flush=True)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    compose, why = docker_setup()
    if compose is None:
        if os.environ.get("ROLLFLEET_REQUIRE_DOCKER"):
            pytest.fail(f"ROLLFLEET_REQUIRE_DOCKER is set but {why}")
        pytest.skip(why)
    run_id = uuid.uuid4().hex[:8]
    root = Path(tempfile.mkdtemp(prefix="rollfleet-compose-"))
    root.chmod(0o755)  # the store must be readable by the image's user (uid 10001)
    weights = root / "weights"
    weights.mkdir(mode=0o755)
    port = free_port()
    env = {
        **os.environ,
        "ROLLFLEET_NAMESPACE": f"ce{run_id}",
        "ROLLFLEET_WEIGHTS": str(weights),
        "ROLLFLEET_NATS_PORT": str(port),
        "ROLLFLEET_EXTRAS": "",  # explicitly empty: the slim image, not a default
        "ROLLFLEET_WORKER_ARGS": WORKER_ARGS,
        "ROLLFLEET_OBJECTS_NAMESPACE": f"ob{run_id}",
        "ROLLFLEET_S3_PORT": str(free_port()),
        "ROLLFLEET_GATEWAY_PORT": str(free_port()),
        "ROLLFLEET_API_KEY": "compose-key",
    }
    for key in [k for k in env if k.startswith("AWS_")]:
        del env[key]  # the objects profile's workers take the local object-store's settings
    network = os.environ.get("ROLLFLEET_BUILD_NETWORK") or os.environ.get("DOCKER_OFFLINE_BUILD_NETWORK")
    if network:
        env["ROLLFLEET_BUILD_NETWORK"] = network
    s = Stack(compose, f"rollfleet-test-{run_id}", f"ce{run_id}", weights, port, env)
    s.figures.update(compose=" ".join(compose), project=s.project)
    try:
        yield s
    finally:
        s(*PROFILES, "down", "-v", "--remove-orphans", "--timeout", "10", check=False, timeout=180)
        shutil.rmtree(root, ignore_errors=True)


# -- the trainers ------------------------------------------------------------------------------


class HostTrainer:
    """A trainer on the host: a tiny checkpoint, a publisher writing into the workers' store."""

    def __init__(self, store: Path | str, base: Path) -> None:
        if not base.exists():
            base.mkdir(parents=True)
            rng = np.random.default_rng(0)
            tensors = {
                "model.embed_tokens.weight": rng.standard_normal((256, 64)).astype(np.float32),
                "model.norm.weight": np.ones(64, np.float32),
            }
            save_file(tensors, str(base / "model.safetensors"))  # mode 0600, as safetensors writes checkpoints
            (base / "config.json").write_text(json.dumps({"model_type": "test"}))
        self.publisher = PolicyPublisher(store, base)
        self.tensors = load_file(str(base / "model.safetensors"))

    def step(self) -> dict[str, np.ndarray]:
        self.tensors = {name: t + np.float32(0.01) for name, t in self.tensors.items()}
        return self.tensors


@pytest.fixture(scope="module")
def host_trainer(stack: Stack) -> HostTrainer:
    return HostTrainer(stack.weights, stack.weights.parent / "base")


async def in_network_trainer(s: Stack, *args: str) -> dict[str, Any]:
    """tests/compose_trainer.py inside the compose network (a one-off container of the worker image)."""
    cmd = [*s.compose, "-f", str(COMPOSE_FILE), "-p", s.project, "run", "--rm", "--no-deps", "-T"]
    cmd += ["--entrypoint", "python", "worker", "-", "--nats", "nats://nats:4222", "--namespace", s.namespace, *args]
    with open(TRAINER_SCRIPT, "rb") as script:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=s.env, cwd=REPO
        )
        out, err = await asyncio.wait_for(proc.communicate(), 300)
    lines = out.decode().strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"in-network trainer exited {proc.returncode}: {err.decode()[-3000:]}"
    return json.loads(lines[-1])


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        await asyncio.sleep(interval)


def served_by(results: list[dict[str, Any]]) -> Counter[str]:
    return Counter(r["worker_id"] for r in results)


async def registry(client: RolloutClient) -> dict[str, Any]:
    """Every registry entry (live or stale), by worker id."""
    return await read_replicas(await client.js.key_value(client.names.fleet_bucket))


def memory_mib(names: list[str], env: dict[str, str]) -> dict[str, float]:
    """Current memory use of containers, MiB (docker stats)."""
    if not names:
        return {}
    out = _run(["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}", *names], env=env, timeout=60)
    units = {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0, "kB": 1e3 / 2**20, "MB": 1e6 / 2**20}
    mem = {}
    for line in out.stdout.splitlines():
        m = re.match(r"(\S+) ([\d.]+)(\w+) /", line)
        if m:
            mem[m.group(1)] = round(float(m.group(2)) * units[m.group(3)], 2)
    return mem


# -- 1. images -----------------------------------------------------------------------------------


def test_images_build_slim_and_hf(stack: Stack) -> None:
    t0 = time.perf_counter()
    stack("build", "worker", timeout=900)
    slim_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    stack("--profile", "demo", "build", "demo-trainer", timeout=900)
    hf_s = time.perf_counter() - t0
    sizes = {}
    for image in (SLIM_IMAGE, DEMO_IMAGE):
        out = _run(["docker", "image", "inspect", "--format", "{{.Size}}", image], env=stack.env)
        assert out.returncode == 0, out.stderr
        sizes[image] = int(out.stdout)
    stack.record(build_slim_s=round(slim_s, 2), build_hf_demo_s=round(hf_s, 2), image_bytes=sizes)

    def inside(image: str, code: str) -> str:
        out = _run(["docker", "run", "--rm", "--entrypoint", "python", image, "-c", code], env=stack.env, timeout=120)
        assert out.returncode == 0, f"{image}: {out.stderr[-2000:]}"
        return out.stdout.strip()

    # ROLLFLEET_EXTRAS="" really gives the slim image: no torch; the echo worker's CLI works.
    assert inside(SLIM_IMAGE, "import importlib.util as u, rollfleet.cli; print(u.find_spec('torch'))") == "None"
    # The demo image has the hf engine and the plot's matplotlib.
    assert inside(DEMO_IMAGE, "import torch, transformers, matplotlib; print('ok')") == "ok"
    assert sizes[SLIM_IMAGE] < sizes[DEMO_IMAGE] / 2


# -- 2. a scaled fleet serves trainers on the host and in the network ----------------------------


async def test_scaled_fleet_serves_host_and_in_network_trainers(stack: Stack, host_trainer: HostTrainer) -> None:
    t0 = time.perf_counter()
    stack("up", "-d", "--no-build", "--scale", f"worker={WORKERS}", timeout=300)
    stack.record(up_s=round(time.perf_counter() - t0, 2))
    [nats] = stack.containers("nats")
    health = _run(["docker", "inspect", "--format", "{{.State.Health.Status}}", nats], env=stack.env)
    assert health.stdout.strip() == "healthy"
    hosts = stack.hostnames("worker")
    assert len(hosts) == WORKERS

    async with await RolloutClient.connect(stack.url, namespace=stack.namespace, client_id="host-trainer") as client:

        async def all_registered() -> bool:
            return {r.host for r in (await registry(client)).values()} == set(hosts.values())

        await eventually(all_registered, timeout=60, interval=0.5)  # waiting for a first version
        record = await client.publish_policy(host_trainer.publisher, host_trainer.tensors)
        assert record.version == 0
        ready = await client.wait_for_version(0, replicas=WORKERS, timeout=60)
        worker_ids = {r.worker_id for r in ready}
        assert {r.host for r in ready} == set(hosts.values())

        handles = await compose_trainer.submit(client, 30, tag="host-v0", min_version=0)
        network, host = await asyncio.gather(
            in_network_trainer(
                stack, "--jobs", "30", "--exact-version", "0", "--client-id", "net-trainer", "--tag", "net-v0"
            ),
            compose_trainer.collect(handles),
        )
    for name, out in (("host", host), ("in-network", network)):
        assert not out["errors"], f"{name} trainer: {out['errors']}"
        assert len(out["results"]) == 30
        assert all(r["version_start"] == r["version_end"] == 0 for r in out["results"])
    by_worker = served_by(host["results"] + network["results"])
    assert set(by_worker) == worker_ids, f"every worker serves some: {dict(by_worker)}"
    stack.record(jobs_by_worker_v0=dict(by_worker))
    # The gateway service: one HTTP request on its published port, with its bearer key, served
    # by one of the fleet's workers at version 0 (the echo engine's tokens: sum(prompt) + i).
    gateway = f"http://127.0.0.1:{stack.env['ROLLFLEET_GATEWAY_PORT']}"
    key = {"Authorization": "Bearer compose-key"}
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as http:

        async def gateway_healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get("/health")).status_code == 200
            return False

        await eventually(gateway_healthy, timeout=60, interval=0.5)
        assert (await http.post("/generate", json={"input_ids": [1]})).status_code == 401
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3},
                "weight_version": {"exact_version": 0}}  # fmt: skip
        answer = await http.post("/generate", json=body, headers=key)
    assert answer.status_code == 200, answer.text
    assert answer.json()["output_ids"] == [11, 12, 13]
    assert answer.json()["meta_info"]["rollfleet"]["replica"] in worker_ids


# -- 3. workers follow published versions --------------------------------------------------------


async def test_workers_follow_published_versions(stack: Stack, host_trainer: HostTrainer) -> None:
    async with await RolloutClient.connect(stack.url, namespace=stack.namespace, client_id="host-trainer") as client:
        # (Waits for fresh heartbeats: a view read at connect can find them late on a busy host.)
        before = {r.worker_id for r in await client.wait_for_version(0, replicas=WORKERS, timeout=60)}
        assert len(before) == WORKERS
        record = await client.publish_policy(host_trainer.publisher, host_trainer.step())
        assert record.version == 1 and record.kind == "delta"
        t0 = time.perf_counter()
        ready = await client.wait_for_version(1, replicas=WORKERS, timeout=60)
        stack.record(activation_all_workers_s=round(time.perf_counter() - t0, 3))
        assert {r.worker_id for r in ready} == before and all(r.active_version == 1 for r in ready)

        handles = await compose_trainer.submit(client, 24, tag="host-v1", exact_version=1)
        network, host = await asyncio.gather(
            in_network_trainer(
                stack, "--jobs", "24", "--min-version", "1", "--client-id", "net-trainer", "--tag", "net-v1"
            ),
            compose_trainer.collect(handles),
        )
    for name, out in (("host", host), ("in-network", network)):
        assert not out["errors"], f"{name} trainer: {out['errors']}"
        assert all(r["version_start"] == r["version_end"] == 1 for r in out["results"]), out["results"]
    by_worker = served_by(host["results"] + network["results"])
    assert set(by_worker) == before, f"every worker serves version 1: {dict(by_worker)}"
    stack.record(
        echo_worker_mib=memory_mib(stack.containers("worker"), stack.env),
        nats_mib=memory_mib(stack.containers("nats"), stack.env),
    )


# -- 4. a killed worker loses nothing; scaling down drains ---------------------------------------


async def test_killed_worker_loses_nothing_and_scale_down_drains(stack: Stack) -> None:
    async with await RolloutClient.connect(stack.url, namespace=stack.namespace, client_id="host-trainer") as client:
        hosts = stack.hostnames("worker")
        assert len(hosts) == WORKERS
        # Kill one worker while every worker holds jobs (36 jobs of 0.4 s for 12 slots).
        handles = await compose_trainer.submit(client, 36, tag="kill", min_version=1)
        first = await handles[0]
        victim = next(name for name, host in hosts.items() if first.worker_id.startswith(host + "-"))
        killed_at = time.time()
        kill = _run(["docker", "kill", victim], env=stack.env)
        assert kill.returncode == 0, kill.stderr
        out = await compose_trainer.collect(handles)
        assert not out["errors"], out["errors"]
        keys = [r["key"] for r in out["results"]]
        assert sorted(keys) == sorted(f"kill-{i}" for i in range(36))
        redelivered = [r for r in out["results"] if r["delivery_attempt"] > 1]
        assert redelivered, "the kill hit no running job (nothing was redelivered)"
        assert all(not r["worker_id"].startswith(hosts[victim] + "-") for r in redelivered)
        stack.record(killed_mid_job_redelivered=len(redelivered))

        # Back to three (the killed container starts again), then down to one under load.
        stack("up", "-d", "--no-build", "--scale", f"worker={WORKERS}")
        await client.wait_for_version(1, replicas=WORKERS, timeout=60)
        before = stack.hostnames("worker")
        handles = await compose_trainer.submit(client, 60, tag="scale", min_version=1)
        await handles[0]
        t0 = time.perf_counter()
        stack("up", "-d", "--no-build", "--scale", "worker=1", timeout=180)
        scale_down_s = time.perf_counter() - t0
        out = await compose_trainer.collect(handles)
        after = stack.hostnames("worker")
        entries = await registry(client)
    assert not out["errors"], out["errors"]
    assert sorted(r["key"] for r in out["results"]) == sorted(f"scale-{i}" for i in range(60))
    assert len(after) == 1
    removed = set(before.values()) - set(after.values())
    assert len(removed) == WORKERS - 1
    # Drained: they served jobs of this batch, then deleted their registry entries, within the
    # grace period. Only the killed process's entry may remain, stale: a killed worker cannot
    # deregister (its restart may run under another pid, so another worker id).
    now = time.time()
    seen = {k: (e.state, e.host, e.is_live(now), round(now - e.heartbeat_at, 1)) for k, e in entries.items()}
    why = f"killed {first.worker_id}, before {before}, after {after}, registry {seen}"
    drained = {r["worker_id"] for r in out["results"] if r["worker_id"].rsplit("-", 1)[0] in removed}
    assert drained, why
    assert not drained & set(entries), why
    # The killed one's entry was never refreshed after the kill: it stops counting as live
    # within 3 heartbeat intervals of its last refresh (60 s with the default 20 s).
    for worker_id, entry in entries.items():
        if not (entry.host in after.values() and entry.is_live(now)):
            assert worker_id == first.worker_id and entry.heartbeat_at <= killed_at, why
    dead = {w for w, e in entries.items() if w == first.worker_id and e.heartbeat_at <= killed_at}
    live = {e.host for w, e in entries.items() if e.is_live(now) and w not in dead}
    assert live == set(after.values()), why
    assert scale_down_s < 30, f"scale-down took {scale_down_s:.1f}s: workers were killed, not drained"
    stack.record(scale_down_s=round(scale_down_s, 2), jobs_by_worker_scale=dict(served_by(out["results"])))


# -- 4b. the objects profile: workers follow a bucket, no shared volume ------------------------------


async def test_objects_profile_workers_follow_a_bucket(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = time.perf_counter()
    stack("--profile", "objects", "build", "object-worker", timeout=900)
    build_s = time.perf_counter() - t0
    stack("--profile", "objects", "up", "-d", "--no-build", "--scale", "object-worker=2", "object-worker", timeout=300)
    workers = stack.containers("object-worker")
    assert len(workers) == 2
    mounts = _run(["docker", "inspect", "--format", "{{len .Mounts}}", *workers], env=stack.env).stdout.split()
    assert mounts == ["0", "0"], "object workers mount no weight store"
    s3 = {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local", "AWS_REGION": "us-east-1"}
    s3 |= {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{stack.env['ROLLFLEET_S3_PORT']}", "AWS_ALLOW_HTTP": "true"}
    for key, value in s3.items():
        monkeypatch.setenv(key, value)  # the host trainer reaches the bucket through the published port
    trainer = HostTrainer("s3://rollfleet-weights/objects", stack.weights.parent / "base")
    namespace = stack.env["ROLLFLEET_OBJECTS_NAMESPACE"]
    async with await RolloutClient.connect(stack.url, namespace=namespace, client_id="object-trainer") as client:
        assert (await client.publish_policy(trainer.publisher, trainer.tensors)).version == 0
        ready = await client.wait_for_version(0, replicas=2, timeout=120)
        t0 = time.perf_counter()
        assert (await client.publish_policy(trainer.publisher, trainer.step())).version == 1
        ready = await client.wait_for_version(1, replicas=2, timeout=120)
        activation_s = time.perf_counter() - t0
        handles = await compose_trainer.submit(client, 16, tag="objects-v1", exact_version=1)
        out = await compose_trainer.collect(handles)
    assert not out["errors"], out["errors"]
    assert all(r["version_start"] == r["version_end"] == 1 for r in out["results"]), out["results"]
    assert set(served_by(out["results"])) <= {r.worker_id for r in ready}
    for c in workers:  # each container materialized version 1 from the bucket into its own checkpoint
        marker = _run(["docker", "exec", c, "cat", "/home/rollfleet/replica/rollfleet-version.json"], env=stack.env)
        assert marker.returncode == 0 and json.loads(marker.stdout)["version"] == 1, (c, marker.stdout, marker.stderr)
        cache = _run(["docker", "exec", c, "ls", "-A", "/home/rollfleet/replica/.rollfleet-store"], env=stack.env)
        assert cache.returncode == 0 and cache.stdout.split() == [".rollfleet.lock"], (c, cache.stdout)
    stack.record(build_objects_s=round(build_s, 2), objects_activation_all_workers_s=round(activation_s, 3))


# -- 5. the demo profile ----------------------------------------------------------------------------


def test_demo_profile_runs_to_completion(stack: Stack, tmp_path: Path) -> None:
    peak: dict[str, float] = {}
    done = threading.Event()

    def sample_memory() -> None:
        while not done.is_set():
            for name, mib in memory_mib(stack.containers("demo-worker"), stack.env).items():
                peak[name] = max(peak.get(name, 0.0), mib)
            done.wait(2.0)

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        log = stack("--profile", "demo", "up", "--no-build", "--exit-code-from", "demo-trainer", timeout=600)
    finally:
        done.set()
        sampler.join(30)
    demo_s = time.perf_counter() - t0
    assert "summary" in log and "steps                    30" in log, log[-3000:]
    out = tmp_path / "demo_out"
    stack("--profile", "demo", "cp", "demo-trainer:/home/rollfleet/demo_out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30
    assert summary["reward_end"] > summary["reward_start"]
    assert summary["max_staleness_seen"] <= summary["max_staleness_allowed"] == 1
    assert [s["version"] for s in summary["history"]] == list(range(1, 31))
    assert (out / "rollfleet_demo.png").stat().st_size > 10_000
    assert len(peak) == 2, peak  # two hf workers by default
    stack.record(demo_s=round(demo_s, 2), demo_hf_worker_peak_mib=peak, demo_reward=[
        round(summary["reward_start"], 3), round(summary["reward_end"], 3)])  # fmt: skip


# -- 6. down ----------------------------------------------------------------------------------------


def test_down_stops_everything_and_down_v_removes_the_volumes(stack: Stack) -> None:
    def volumes() -> set[str]:
        cmd = ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={stack.project}"]
        return set(_run(cmd, env=stack.env).stdout.split())

    stack("up", "-d", "--no-build")  # running again after the demo's abort stopped it
    assert stack.containers("nats") and stack.containers("worker")
    t0 = time.perf_counter()
    stack(*PROFILES, "down", timeout=180)  # at once: the worker may not be set up yet
    down_s = time.perf_counter() - t0
    stack.record(down_s=round(down_s, 2))
    assert down_s < 30, f"down took {down_s:.1f}s: a container ignored SIGTERM until its grace period ended"
    assert stack.containers(running_only=False) == []
    net = _run(["docker", "network", "ls", "-q", "--filter", f"name={stack.project}_default"], env=stack.env)
    assert net.stdout.strip() == ""
    kept = volumes()
    assert {f"{stack.project}_nats-store", f"{stack.project}_demo-weights"} <= kept, kept
    stack(*PROFILES, "down", "-v", timeout=180)
    assert volumes() == set()
    # The host store the workers followed is the trainer's: compose leaves it alone.
    assert stat.S_ISDIR(os.stat(stack.weights / "weight_v000001").st_mode)
