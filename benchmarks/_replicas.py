"""Virtual replicas: many real rollout workers in one process, for fleet-size benchmarks.

``python -m benchmarks._replicas --nats URL --namespace NS --prefix p0 --count 250`` starts
``count`` ``Worker`` instances with the echo engine in one event loop. Each is a whole worker,
exactly as ``rollfleet worker --engine echo --follow-versions`` runs it: its own NATS
connection, its own registry entry and heartbeat, its own pull requests, bell subscription and
version following. Only the process is shared, so a 2-core machine can hold a thousand of them.
It prints ``READY <count>`` once all are started and drains them all on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from rollfleet.broker.topology import TopologyConfig
from rollfleet.runtime import logs
from rollfleet.workers.engines.echo import EchoEngine
from rollfleet.workers.worker import Worker, WorkerConfig


async def host(args: argparse.Namespace) -> int:
    topology = TopologyConfig(replicas=args.replicas, ack_wait_s=args.ack_wait)
    workers = [
        Worker(
            WorkerConfig(
                nats_url=args.nats,
                namespace=args.namespace,
                worker_id=f"{args.prefix}-{i}",
                capacity=args.capacity,
                follow_versions=True,
                topology=topology,
                progress_s=3600.0,
            ),
            EchoEngine(latency_s=args.echo_latency),
        )
        for i in range(args.count)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gate = asyncio.Semaphore(args.start_concurrency)
    t0 = time.monotonic()

    async def start(worker: Worker) -> None:
        async with gate:
            await worker.start()

    await asyncio.gather(*(start(w) for w in workers))
    print(f"READY {len(workers)} in {time.monotonic() - t0:.1f}s", flush=True)
    await stop.wait()
    await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
    print(f"STOPPED jobs_done={sum(w.jobs_done for w in workers)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._replicas")
    parser.add_argument("--nats", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--prefix", required=True, help="worker ids are <prefix>-<i>")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--echo-latency", type=float, default=0.0)
    parser.add_argument("--replicas", type=int, default=1, help="stream replicas (3 on a cluster)")
    parser.add_argument("--ack-wait", type=float, default=30.0)
    parser.add_argument("--start-concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    logs.configure()
    return asyncio.run(host(args))


if __name__ == "__main__":
    sys.exit(main())
