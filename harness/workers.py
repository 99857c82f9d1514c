"""Brokers and workers in this process: a broker on a temporary store, a worker as a task."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from harness.monitor import BrokerCounters
from rollfleet.broker import EmbeddedBroker, free_port
from rollfleet.workers.engines import Engine
from rollfleet.workers.worker import Worker, WorkerConfig


@contextlib.contextmanager
def temp_broker(prefix: str = "rf-", *, monitor: bool = False) -> Iterator[EmbeddedBroker]:
    """A nats-server with JetStream on a temporary store, stopped and removed afterwards.
    ``monitor``: with its monitoring endpoint on, for :func:`broker_counters`."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        extra = ["-m", str(free_port())] if monitor else []
        broker = EmbeddedBroker(store_dir=Path(tmp) / "nats", log_file=Path(tmp) / "nats.log", extra_args=extra)
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()


def broker_counters(broker: EmbeddedBroker) -> BrokerCounters:
    """The counters of a broker started with its monitoring endpoint (``-m <port>``)."""
    args = broker.extra_args
    assert "-m" in args and broker.proc is not None, "start the broker with monitor=True (-m <port>)"
    return BrokerCounters([(int(args[args.index("-m") + 1]), broker.proc.pid)])


@contextlib.asynccontextmanager
async def running_worker(
    url: str, namespace: str, version: int = 0, engine: Engine | None = None, **config: Any
) -> AsyncIterator[Worker]:
    """A started worker in this process (the echo engine unless given one); drained on exit.
    Heartbeats are fast (0.5 s: a dead replica goes stale in 1.5 s) unless ``config`` says otherwise."""
    from rollfleet.workers.engines.echo import EchoEngine

    config.setdefault("heartbeat_s", 0.5)
    worker = Worker(WorkerConfig(nats_url=url, namespace=namespace, version=version, **config), engine or EchoEngine())
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()
