"""The services of a Docker Compose project (``docker-compose.yml``): the ``worker`` service scaled,
and containers held at a version started beside it.

- A follower is one more container of the worker service: ``up -d --no-deps --no-recreate
  --scale worker=N worker``, N the followers running plus one. Compose names its worker
  ``<hostname>-<pid>`` (the container's hostname), so its registry entry is matched by host.
- A replica held at version V is a one-off container of the same service with the service's own
  command and ``--hold-version V`` (``run -d --no-deps --label rollfleet.held=V worker ...``): the
  same image, store and broker as every worker.
- Retiring is ``docker stop`` (SIGTERM, then the service's ``stop_grace_period``: the worker
  drains), then ``docker rm``: a container stopped so is not restarted (``restart:
  unless-stopped``), and a later ``--scale`` creates a fresh one instead of reviving it. The stop
  runs in the background: a drain may take its time, the controller does not wait for it.

Everything is read again from Docker at each look (``docker ps`` by the project's labels): a
controller that restarts knows the containers as well as the one before.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from rollfleet.autoscale.drivers.base import Run
from rollfleet.runtime.logs import get_logger

log = get_logger("rollfleet.autoscale.compose")

HELD_LABEL = "rollfleet.held"


async def _run(*cmd: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {err.decode(errors='replace')[-800:]}")
    return out.decode()


def _started(text: str) -> float:
    """``docker ps``'s CreatedAt (``2026-12-06 09:01:02 +0000 UTC``) as unix time."""
    with suppress(ValueError):
        return datetime.strptime(" ".join(text.split()[:3]), "%Y-%m-%d %H:%M:%S %z").timestamp()
    return 0.0


@dataclass
class ComposeDriver:
    compose_file: Path
    project: str
    service: str = "worker"
    compose: list[str] = field(default_factory=lambda: ["docker", "compose"])
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    name: str = "compose"
    _retiring: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # container id -> its stop
    _hosts: dict[str, str] = field(default_factory=dict)  # hostname -> container id (every one seen)
    _command: list[str] | None = None

    def _compose(self, *args: str) -> list[str]:
        return [*self.compose, "-f", str(self.compose_file), "-p", self.project, *args]

    def owns(self, worker_id: str, host: str = "") -> bool:
        return host in self._hosts

    async def _containers(self) -> list[dict[str, str]]:
        out = await _run(
            "docker", "ps", "--no-trunc",
            "--filter", f"label=com.docker.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={self.service}",
            "--format", "{{json .}}", env=self.env,
        )  # fmt: skip
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    async def runs(self) -> list[Run]:
        found = []
        for c in await self._containers():
            cid = c["ID"]
            labels = dict(kv.split("=", 1) for kv in c.get("Labels", "").split(",") if "=" in kv)
            held = labels.get(HELD_LABEL)
            hostname = cid[:12]  # (docker's default hostname: the container id's first 12 digits)
            self._hosts[hostname] = cid
            version = int(held) if held is not None else None
            started = _started(c.get("CreatedAt", ""))
            found.append(Run(hostname, version, started, cid in self._retiring, hostname))
        return found

    async def _service_command(self) -> list[str]:
        """The worker service's command, as compose resolves it (its variables filled in)."""
        if self._command is None:
            config = json.loads(await _run(*self._compose("config", "--format", "json"), env=self.env))
            command = config["services"][self.service]["command"]
            self._command = command if isinstance(command, list) else command.split()
        return list(self._command)

    async def launch(self, held: int | None) -> str:
        if held is None:
            followers = [r for r in await self.runs() if r.held is None and not r.retiring]
            scale = len(followers) + 1
            up = ["up", "-d", "--no-deps", "--no-recreate", "--scale", f"{self.service}={scale}", self.service]
            await _run(*self._compose(*up), env=self.env)
            return f"{self.service} x{scale}"
        name = f"{self.project}-held-v{held}-{secrets.token_hex(3)}"
        command = await self._service_command() + ["--hold-version", str(held)]
        await _run(
            *self._compose("run", "-d", "--no-deps", "--name", name, "--label", f"{HELD_LABEL}={held}", self.service),
            *command,
            env=self.env,
        )
        return name

    async def retire(self, worker_id: str, host: str = "") -> None:
        cid = self._hosts.get(host or worker_id)
        if cid is None or cid in self._retiring:
            return
        self._retiring[cid] = asyncio.create_task(self._stop(cid), name=f"stop-{cid[:12]}")

    async def _stop(self, cid: str) -> None:
        try:
            # (docker stop waits the service's stop_grace_period for the drain, then kills)
            await _run("docker", "stop", cid, env=self.env, timeout=600)
            await _run("docker", "rm", cid, env=self.env)
        except Exception as exc:
            log.warning("retiring a container failed", container=cid[:12], error=repr(exc))
        finally:
            self._retiring.pop(cid, None)

    async def close(self) -> None:
        """Stops in progress are finished (a container half-stopped would be restarted)."""
        if self._retiring:
            await asyncio.gather(*self._retiring.values(), return_exceptions=True)
