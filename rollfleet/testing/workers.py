"""Brokers and workers in this process: a broker on a temporary store, a worker as a task."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from rollfleet.broker import EmbeddedBroker
from rollfleet.workers.engines import Engine
from rollfleet.workers.worker import Worker, WorkerConfig


@contextlib.contextmanager
def temp_broker(prefix: str = "rf-") -> Iterator[EmbeddedBroker]:
    """A nats-server with JetStream on a temporary store, stopped and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        broker = EmbeddedBroker(store_dir=Path(tmp) / "nats", log_file=Path(tmp) / "nats.log").start()
        try:
            yield broker
        finally:
            broker.stop()


@contextlib.asynccontextmanager
async def running_worker(
    url: str, namespace: str, version: int = 0, engine: Engine | None = None, **config: Any
) -> AsyncIterator[Worker]:
    """A started worker in this process (the echo engine unless given one); drained on exit.
    Heartbeats and polls are fast (0.5 s) unless ``config`` says otherwise."""
    from rollfleet.workers.engines.echo import EchoEngine

    config.setdefault("heartbeat_s", 0.5)
    config.setdefault("poll_s", 0.5)
    worker = Worker(WorkerConfig(nats_url=url, namespace=namespace, version=version, **config), engine or EchoEngine())
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()
