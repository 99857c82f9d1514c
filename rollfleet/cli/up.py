"""``rollfleet up``: one command to a running local fleet."""

from __future__ import annotations

import argparse
import asyncio
import json
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


def trainer_hint(
    url: str, namespace: str, engine: str, store: Path | None, base: Path | None, version: int | None, follow: bool
) -> str:
    """What a trainer needs to use this fleet, as lines to paste: the README's training-loop
    snippet with the values this ``up`` chose (a wrong namespace or store is a silent wait)."""
    q = json.dumps  # Python string literals in double quotes, as the README writes them
    lines = [
        "a trainer connects with:",
        f"    RolloutClient.connect({q(url)}, namespace={q(namespace)}, client_id={q('trainer-0')})",
    ]
    if store is not None and base is not None:
        lines += [
            f"and publishes into the store the workers follow, from their base (latest committed version: {version}):",
            f"    PolicyPublisher({q(str(store.resolve()))}, base_checkpoint_dir={q(str(base.resolve()))})",
        ]
    elif follow:
        lines.append(
            f"{engine} workers read no weights: they activate each version committed in namespace {namespace}"
            " (client.publish_policy with a PolicyPublisher on a store and base of your own)"
        )
    else:
        lines.append(f"{engine} workers stay at version 0 (--no-follow-versions): submit with min_version=0")
    return "\n".join(lines)


async def cmd_up(args: argparse.Namespace) -> int:
    from rollfleet.policy_store.bucket import is_store_url

    home = Path(args.home)
    store = model_dir = None
    version: int | None = None
    if args.engine == "hf":
        if bool(args.model_dir) == bool(args.tiny_model):
            raise InvalidRequest("the hf engine needs exactly one of --model-dir or --tiny-model")
        model_dir = Path(args.model_dir) if args.model_dir else home / "models" / "tiny"
        if args.tiny_model and not (model_dir / "config.json").exists():
            from rollfleet.models import build_model_dir

            build_model_dir(model_dir, preset="tiny")
        if args.store and is_store_url(args.store):  # a local fleet's store lives on this machine
            raise InvalidRequest(f"rollfleet up keeps its policy store on this machine: --store {args.store} is a URL")
        store = Path(args.store) if args.store else home / "store"
    fleet = LocalFleet(
        home=home,
        namespace=args.namespace,
        workers=args.workers,
        engine=args.engine,
        port=args.port,
        store_dir=store,
        follow_versions=args.follow_versions,
        metrics_base_port=args.metrics_base_port,
        worker_args=list(args.worker_arg),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.autoscale is not None:
        return await _up_autoscaled(args, fleet, stop, store, model_dir)
    try:
        url = fleet.start_broker()
        if store is not None and model_dir is not None:
            version = await seed_store(url, args.namespace, store, model_dir)
            print(f"policy version {version} committed from {model_dir}", flush=True)
        fleet.start_workers()
        ready = asyncio.create_task(fleet.wait_ready())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()
            print(fleet.describe(), flush=True)
            hint = trainer_hint(url, args.namespace, args.engine, store, model_dir, version, args.follow_versions)
            print(hint, flush=True)
            print(f"fleet ready: {args.workers} {args.engine} workers. Ctrl-C stops everything.", flush=True)
            await stop.wait()
        else:
            ready.cancel()
    finally:
        print("stopping: draining workers, then the broker", flush=True)
        await asyncio.to_thread(fleet.stop)
        print(f"stopped; the broker store stays in {home / 'broker'}", flush=True)
    return 0


async def _autoscaled_ready(url: str, namespace: str, replicas: int, controller: asyncio.Task[None]) -> None:
    """Until ``replicas`` live replicas are ready (the control loop's failure raised)."""
    from rollfleet.cli.status import collect_status

    while True:
        snapshot = await collect_status(url, namespace)
        if sum(r["live"] and r["state"] == "ready" for r in snapshot["replicas"]) >= replicas:
            return
        if controller.done():
            controller.result()
        await asyncio.sleep(0.3)


async def _up_autoscaled(
    args: argparse.Namespace, fleet: LocalFleet, stop: asyncio.Event, store: Path | None, model_dir: Path | None
) -> int:
    """``up --autoscale MIN:MAX``: the broker, and the control loop with its local driver in this
    process in place of a fixed set of workers (they die with it)."""
    from rollfleet.autoscale.controller import Controller, ControllerConfig
    from rollfleet.autoscale.drivers.local import LocalDriver
    from rollfleet.autoscale.planner import Policy

    lo, hi = args.autoscale
    version: int | None = None
    controller: Controller | None = None
    task: asyncio.Task[None] | None = None
    halt = asyncio.Event()
    try:
        url = fleet.start_broker()
        if store is not None and model_dir is not None:
            version = await seed_store(url, args.namespace, store, model_dir)
            print(f"policy version {version} committed from {model_dir}", flush=True)
        driver = LocalDriver(
            url=url,
            namespace=args.namespace,
            engine=args.engine,
            home=fleet.home,
            store=store,
            follow_versions=args.follow_versions,
            worker_args=list(args.worker_arg),
            prefix=args.engine,
        )
        controller = Controller(
            ControllerConfig(url=url, namespace=args.namespace, policy=Policy(min_replicas=lo, max_replicas=hi)), driver
        )
        task = asyncio.create_task(controller.run(halt), name="autoscale")
        waiting = asyncio.create_task(_autoscaled_ready(url, args.namespace, lo, task))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            waiting.result()
            print(f"broker     {url}   (store {fleet.home.resolve() / 'broker'})", flush=True)
            print(f"namespace  {args.namespace}", flush=True)
            print(f"autoscale  {lo}..{hi} {args.engine} workers (rollfleet status shows the plan)", flush=True)
            print(f"logs       {(fleet.home / 'logs').resolve()}", flush=True)
            hint = trainer_hint(url, args.namespace, args.engine, store, model_dir, version, args.follow_versions)
            print(hint, flush=True)
            print(f"fleet ready: autoscaling {lo}..{hi} {args.engine} workers. Ctrl-C stops everything.", flush=True)
            await stop.wait()
        else:
            waiting.cancel()
    finally:
        print("stopping: draining workers, then the broker", flush=True)
        halt.set()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)  # (the driver drains its workers)
        await asyncio.to_thread(fleet.stop)
        print(f"stopped; the broker store stays in {fleet.home / 'broker'}", flush=True)
    return 0
