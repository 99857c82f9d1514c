"""The inference server's process: launched here, or a URL attached to.

A launched server runs in its own session (so stopping it stops its children too), its output
appended to a log file; the adapter waits until it answers its health path. Part of
``HTTPServerEngine`` (``http_server``), whose configuration (``host``, ``port``, ``env``,
``log_file``, ``startup_timeout_s``, ``health_path``) and HTTP client (``_http``) it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from rollfleet.schemas.errors import EngineFailure, InvalidRequest

# Every request goes on a fresh connection. A kept-alive one can be closed by the server just as a
# request goes out on it (uvicorn's keep-alive timer, 5 s for vLLM and SGLang alike, fires when
# the server's event loop comes back from a long reload, ahead of the bytes already waiting), and
# the request then fails with ReadError, which reads as the engine failing it: no expiry on the
# client's side closes that race, whose clock is the server's. On loopback a connection costs
# about a tenth of a millisecond; a generation costs far more.
POOL_LIMITS = httpx.Limits(max_keepalive_connections=0)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """Launching, waiting for and stopping the server (``process``: None for an attached one)."""

    process: asyncio.subprocess.Process | None

    def _launch_env(self) -> dict[str, str] | None:
        """The environment of a launched server (None: this process's)."""
        return {**os.environ, **self.env} if self.env else None

    async def _launch(self, model_path: str, version: int) -> None:
        port = self.port or free_port(self.host)
        cmd = self._launch_command(model_path, version, port)
        out: Any = asyncio.subprocess.DEVNULL
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_file.open("ab")
        # Own session, so close() stops the server's engine and worker children too.
        self.process = await asyncio.create_subprocess_exec(
            *cmd, stdout=out, stderr=asyncio.subprocess.STDOUT, env=self._launch_env(), start_new_session=True
        )
        if out is not asyncio.subprocess.DEVNULL:
            out.close()
        self.url = f"http://{self.host}:{port}"

    async def _connect(self, checkpoint_dir: Path | None, version: int, model_path: str | None) -> None:
        """Launch (without a URL) or attach, then wait until the server answers ``/health``."""
        if self.url is None:
            if model_path is None:
                raise InvalidRequest(f"launching {self.server_name} needs a model path or a checkpoint dir")
            await self._launch(model_path, version)
        self._client = httpx.AsyncClient(base_url=self.url or "", timeout=self.control_timeout_s, limits=POOL_LIMITS)
        await self._wait_healthy()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.returncode is not None:
                raise EngineFailure(
                    f"{self.server_name} server exited with code {self.process.returncode} while starting"
                    + (f" (log: {self.log_file})" if self.log_file else "")
                )
            try:
                r = await self._http.get(self.health_path, timeout=5.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.5)
        raise EngineFailure(
            f"{self.server_name} server at {self.url} not healthy after {self.startup_timeout_s:.0f}s ({last})"
        )

    async def _exited(self, wait_s: float = 0.0) -> str | None:
        """A launched server's exit, as one line (None while it runs or for an attached server);
        ``wait_s``: give a process that is dying that long to be reaped."""
        if self.process is None:
            return None
        if self.process.returncode is None and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.process.wait()), wait_s)
        if self.process.returncode is None:
            return None
        return f"{self.server_name} server exited with code {self.process.returncode}"

    async def _stop_process(self) -> None:
        """Stop a launched server and every child of its session (SIGTERM, then SIGKILL after 30 s)."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):  # children that outlived their parent
                os.killpg(self.process.pid, signal.SIGKILL)
