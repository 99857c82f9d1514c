"""``rollfleet up``: one command to a running local fleet."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from rollfleet.cli.local_fleet import LocalFleet
from rollfleet.schemas.errors import InvalidRequest


async def seed_store(url: str, namespace: str, store: Path, model_dir: Path) -> int:
    """Make ``model_dir`` version 0 of ``store`` (and commit it) unless versions exist already."""
    from rollfleet.trainer_client import PolicyPublisher, RolloutClient

    publisher = PolicyPublisher(store, model_dir)
    async with await RolloutClient.connect(url, namespace=namespace, client_id="rollfleet-up") as client:
        if publisher.latest_version is not None and client.latest_version is not None:
            return client.latest_version
        if publisher.latest_version is None:
            await client.commit_version(await asyncio.to_thread(publisher.record_base))
        else:  # files exist but the broker was reset: commit what the store holds
            from rollfleet.policy_store import list_records

            for record in list_records(store):
                if client.latest_version is None or record.version > client.latest_version:
                    await client.commit_version(record)
        return client.latest_version or 0


async def cmd_up(args: argparse.Namespace) -> int:
    home = Path(args.home)
    store = None
    if args.engine == "hf":
        if bool(args.model_dir) == bool(args.tiny_model):
            raise InvalidRequest("the hf engine needs exactly one of --model-dir or --tiny-model")
        model_dir = Path(args.model_dir) if args.model_dir else home / "models" / "tiny"
        if args.tiny_model and not (model_dir / "config.json").exists():
            from rollfleet.models import build_model_dir

            build_model_dir(model_dir, preset="tiny")
        store = Path(args.store) if args.store else home / "store"
    fleet = LocalFleet(
        home=home,
        namespace=args.namespace,
        workers=args.workers,
        engine=args.engine,
        port=args.port,
        store_dir=store,
        metrics_base_port=args.metrics_base_port,
        worker_args=list(args.worker_arg),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = fleet.start_broker()
        if store is not None:
            version = await seed_store(url, args.namespace, store, model_dir)
            print(f"policy version {version} committed from {model_dir}", flush=True)
        fleet.start_workers()
        ready = asyncio.create_task(fleet.wait_ready())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()
            print(fleet.describe(), flush=True)
            print(f"fleet ready: {args.workers} {args.engine} workers. Ctrl-C stops everything.", flush=True)
            await stop.wait()
        else:
            ready.cancel()
    finally:
        print("stopping: draining workers, then the broker", flush=True)
        await asyncio.to_thread(fleet.stop)
        print(f"stopped; the broker store stays in {home / 'broker'}", flush=True)
    return 0
