"""Shared pieces of the fleet benchmarks (brokers, processes, CPU time and the broker's counters
come from ``harness``): percentiles, machine load, a streaming JetStream pull (the
baseline's receive loop), and the baseline worker itself.

``python -m benchmarks._fleet baseline-worker ...`` runs the baseline worker as its own process,
so the baseline has the same process layout as rollfleet's ``rollfleet worker`` processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

REPO = Path(__file__).resolve().parents[1]
_STATUS = "Status"
_PENDING = "Nats-Pending-Messages"


# -- numbers -----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def machine_load() -> dict[str, float]:
    one, five, _ = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "cpus": float(os.cpu_count() or 1)}


# -- a streaming pull: what a careful hand-written consumer does --------------------------------


class PullStream:
    """Keeps pull requests for ``want(n)`` messages outstanding on a durable pull consumer and hands
    each message to ``on_msg`` as it arrives (no batch-completion wait, no polling).

    nats-py's ``fetch(batch)`` returns only when the batch is full or its timeout passes, so at one
    message in flight it waits out the timeout; this is the "consume" pattern instead (as nats.go's
    ``Consume``): expired requests are re-issued for what they did not deliver.
    """

    def __init__(self, nc: NATS, stream: str, consumer: str, on_msg: Callable[[Msg], Awaitable[None] | None]) -> None:
        self._nc = nc
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._on_msg = on_msg
        self._sub: Any = None
        self.expires_s = 10.0

    async def start(self) -> PullStream:
        self._sub = await self._nc.subscribe(self._inbox, cb=self._cb)
        return self

    async def want(self, n: int) -> None:
        """Ask for ``n`` more messages, delivered whenever they become available."""
        if n > 0:
            request = {"batch": n, "expires": int(self.expires_s * 1e9)}
            await self._nc.publish(self._api, json.dumps(request).encode(), reply=self._inbox)

    async def _cb(self, msg: Msg) -> None:
        headers = msg.headers or {}
        if _STATUS in headers:  # 408: a request expired with this many undelivered; ask again
            left = int(headers.get(_PENDING, "0") or 0)
            if headers[_STATUS] != "408":
                await asyncio.sleep(0.05)
            await self.want(left)
            return
        result = self._on_msg(msg)
        if result is not None:
            await result

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None


# -- the baseline worker ---------------------------------------------------------------------


async def baseline_worker(
    url: str,
    stream: str,
    consumer: str,
    capacity: int,
    result_bytes: int,
    results_prefix: str,
    stop: asyncio.Event,
) -> int:
    """Pull a job, publish its result (JetStream publish, awaiting the store's ack), ack the job.

    The minimal honest equivalent of a rollfleet worker: up to ``capacity`` jobs at once, a pull
    request outstanding for every free slot, the reply address and idempotency key in headers.
    """
    nc = await nats.connect(url, name="baseline-worker")
    js = nc.jetstream()
    body = os.urandom(result_bytes)
    done = 0
    tasks: set[asyncio.Task[None]] = set()

    async def handle(msg: Msg) -> None:
        nonlocal done
        headers = msg.headers or {}
        key = headers["Nats-Msg-Id"]
        await js.publish(f"{results_prefix}.{headers['Client-Id']}.{key}", body, headers={"Nats-Msg-Id": key})
        await msg.ack()
        done += 1
        await puller.want(1)  # the slot is free again

    def on_msg(msg: Msg) -> None:
        task = asyncio.create_task(handle(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    puller = await PullStream(nc, stream, consumer, on_msg).start()
    await puller.want(capacity)
    await stop.wait()
    await puller.close()
    if tasks:
        await asyncio.wait(list(tasks), timeout=10)
    await nc.drain()
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._fleet")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("baseline-worker")
    p.add_argument("--nats", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--consumer", required=True)
    p.add_argument("--capacity", type=int, default=16)
    p.add_argument("--result-bytes", type=int, required=True)
    p.add_argument("--results-prefix", required=True)
    args = parser.parse_args(argv)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await baseline_worker(
            args.nats, args.stream, args.consumer, args.capacity, args.result_bytes, args.results_prefix, stop
        )

    done = asyncio.run(run())
    print(f"baseline worker done: {done} jobs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
