"""Test helpers: workers in this process or as real child processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from rollfleet.broker.topology import TopologyConfig
from rollfleet.processes import terminate
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.workers.engines.echo import EchoEngine
from rollfleet.workers.worker import Worker, WorkerConfig

REPO = Path(__file__).resolve().parents[1]


def payload(tokens: list[int] | None = None, max_tokens: int = 4, **sampling: Any) -> RolloutPayload:
    return RolloutPayload(
        prompt_token_ids=tokens or [1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens, **sampling)
    )


class CountingEcho(EchoEngine):
    """The echo engine, counting what it ran and the peak concurrency (for assertions)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls: list[str] = []
        self.running = 0
        self.peak = 0

    async def generate(self, request_id: str, payload: RolloutPayload) -> Any:
        self.calls.append(request_id)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await super().generate(request_id, payload)
        finally:
            self.running -= 1


@asynccontextmanager
async def running_worker(
    url: str, namespace: str, version: int = 0, engine: Any = None, **config: Any
) -> AsyncIterator[Worker]:
    config.setdefault("heartbeat_s", 0.5)
    config.setdefault("poll_s", 0.5)
    worker = Worker(
        WorkerConfig(nats_url=url, namespace=namespace, version=version, **config), engine or CountingEcho()
    )
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


def worker_process(
    url: str,
    namespace: str,
    worker_id: str,
    *args: str,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A real ``rollfleet worker`` process."""
    cmd = [sys.executable, "-m", "rollfleet", "worker", "--nats", url, "--namespace", namespace]
    cmd += ["--worker-id", worker_id, "--heartbeat", "0.5", *args]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    full_env = {**os.environ, "ROLLFLEET_LOG_JSON": "1", "ROLLFLEET_LOG_LEVEL": "info", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=full_env)
    if out is not subprocess.DEVNULL:
        out.close()
    return proc


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
    return terminate(proc, timeout, sig)


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0, interval: float = 0.05
) -> None:
    """Poll ``check`` until it is true; fail with the time-out otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result  # type: ignore[misc]
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


FAST_TOPOLOGY = TopologyConfig(ack_wait_s=2.0, duplicate_window_s=120.0)
