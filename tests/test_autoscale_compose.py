"""``rollfleet autoscale --driver compose`` against docker-compose.yml in real containers.

One compose project (the broker and the worker service, slim echo image), the controller on the
host: four one-slot jobs scale the worker service from 1 to 3 containers, every job is answered
once, and once the queue is empty the two extra containers are stopped (they drain) and removed;
then a request for a version the fleet has moved past is refused, the refusal starts a one-off
container held at that version (the service's own command and --hold-version), the request asked
again is served there, and the held container is removed once its demand is gone. Facts are
read from Docker (``docker ps``) and the results stream. Runs in ``make compose``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from harness import wait_until
from rollfleet.autoscale.controller import Controller, ControllerConfig
from rollfleet.autoscale.drivers.compose import ComposeDriver
from rollfleet.autoscale.planner import Policy
from rollfleet.broker import free_port
from rollfleet.schemas import Names
from rollfleet.schemas.errors import NoCompatibleReplica
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests.helpers import payload
from tests.test_compose_e2e import COMPOSE_FILE, REPO, docker_setup

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]


class Project:
    def __init__(self, compose: list[str], name: str, env: dict[str, str]) -> None:
        self.compose, self.name, self.env = compose, name, env

    def __call__(self, *args: str, timeout: float = 600) -> str:
        cmd = [*self.compose, "-f", str(COMPOSE_FILE), "-p", self.name, *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=REPO)
        assert out.returncode == 0, f"{' '.join(args)}: {out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        return out.stdout

    def workers(self, *, every: bool = False) -> list[dict[str, Any]]:
        """The worker service's containers (running; ``every``: stopped ones too)."""
        cmd = ["docker", "ps", "--filter", f"label=com.docker.compose.project={self.name}"]
        cmd += ["--filter", "label=com.docker.compose.service=worker", "--format", "{{json .}}"]
        out = subprocess.run(cmd + (["-a"] if every else []), capture_output=True, text=True, env=self.env, timeout=60)
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def project() -> Iterator[tuple[Project, Path, int, str]]:
    compose, why = docker_setup()
    if compose is None:
        if os.environ.get("ROLLFLEET_REQUIRE_DOCKER"):
            pytest.fail(f"ROLLFLEET_REQUIRE_DOCKER is set but {why}")
        pytest.skip(why)
    run_id = uuid.uuid4().hex[:8]
    root = Path(tempfile.mkdtemp(prefix="rollfleet-autoscale-compose-"))
    root.chmod(0o755)
    weights = root / "weights"
    weights.mkdir(mode=0o755)
    port = free_port()
    namespace = f"as{run_id}"
    env = {
        **os.environ,
        "ROLLFLEET_NAMESPACE": namespace,
        "ROLLFLEET_WEIGHTS": str(weights),
        "ROLLFLEET_NATS_PORT": str(port),
        "ROLLFLEET_GATEWAY_PORT": str(free_port()),
        "ROLLFLEET_EXTRAS": "",
        "ROLLFLEET_WORKER_ARGS": "--echo-latency 1 --capacity 1 --heartbeat 2",
    }
    network = os.environ.get("ROLLFLEET_BUILD_NETWORK") or os.environ.get("DOCKER_OFFLINE_BUILD_NETWORK")
    if network:
        env["ROLLFLEET_BUILD_NETWORK"] = network
    p = Project(compose, f"rollfleet-as-{run_id}", env)
    try:
        p("build", "worker", timeout=1200)
        p("up", "-d", "--wait", "nats")
        yield p, weights, port, namespace
    finally:
        subprocess.run(
            [*compose, "-f", str(COMPOSE_FILE), "-p", p.name, "down", "-v", "--remove-orphans", "--timeout", "10"],
            capture_output=True, env=env, timeout=300, cwd=REPO,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


def _readable(weights: Path) -> None:
    for path in weights.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # (read by the image's user, uid 10001)


async def test_the_compose_driver_scales_the_worker_service_and_holds_an_old_version(project: Any) -> None:
    p, weights, port, namespace = project
    url = f"nats://127.0.0.1:{port}"
    names = Names(namespace)
    policy = Policy(min_replicas=1, max_replicas=3, slots_per_replica=1, cooldown_s=0, scale_in_grace_s=3.0,
                    hysteresis=0.0, target_wait_s=60.0, hold_after_s=0.0)  # fmt: skip
    compose_cmd = p.compose
    driver = ComposeDriver(COMPOSE_FILE, p.name, compose=compose_cmd, env=p.env)
    controller = Controller(ControllerConfig(url=url, namespace=namespace, policy=policy, interval_s=0.5), driver)
    stop = asyncio.Event()
    base = weights.parent / "base"
    base.mkdir()
    tensors = {"w": np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)}
    save_file(tensors, str(base / "model.safetensors"))
    (base / "config.json").write_text(json.dumps({"model_type": "test"}))
    publisher = PolicyPublisher(weights, base)
    async with await RolloutClient.connect(url, namespace=namespace, client_id="c") as client:
        assert (await client.publish_policy(publisher, tensors)).version == 0
        _readable(weights)
        task = asyncio.create_task(controller.run(stop))
        try:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, 300, what="the first worker container")
            assert len(p.workers()) == 1
            handles = [
                await client.submit(payload(), min_version=0, idempotency_key=f"k{i}", timeout=300) for i in range(4)
            ]
            await wait_until(lambda: len(p.workers()) == 3, 300, interval=1, what="three worker containers")
            results = await asyncio.gather(*(h.result(300) for h in handles))
            assert len({r.worker_id for r in results}) >= 2
            await wait_until(
                lambda: len(p.workers(every=True)) == 1, 300, interval=1, what="two containers drained and removed"
            )
            info = await client.js.stream_info(names.results_stream, subjects_filter=names.results_wildcard)
            heads = [s for s in (info.state.subjects or {}) if names.parse_result_subject(s) is not None]
            assert len(heads) == 4  # one answer per job

            # The fleet moves on to version 2, and version 0 is asked for.
            for _ in range(2):
                tensors = {"w": tensors["w"] + np.float32(0.01)}
                record = await client.publish_policy(publisher, tensors)
                _readable(weights)
            await client.wait_for_version(record.version, replicas=1, timeout=120)
            with pytest.raises(NoCompatibleReplica):
                await (await client.submit(payload(), exact_version=0, timeout=60)).result(60)

            async def served() -> Any:
                try:
                    handle = await client.submit(payload(), exact_version=0, idempotency_key="old", timeout=120)
                    return await handle.result(120)
                except NoCompatibleReplica:
                    return None

            result = await wait_until(served, 300, interval=1, what="a container held at version 0")
            assert result.version_start == result.version_end == 0
            held = [c for c in p.workers() if "rollfleet.held=0" in c.get("Labels", "")]
            assert len(held) == 1 and result.worker_id.startswith(held[0]["ID"][:12])
            await wait_until(
                lambda: not [c for c in p.workers(every=True) if "rollfleet.held" in c.get("Labels", "")],
                300, interval=1, what="the held container removed once its demand is gone",
            )  # fmt: skip
            assert len(p.workers()) == 1
        finally:
            stop.set()
            await asyncio.wait_for(task, 300)
