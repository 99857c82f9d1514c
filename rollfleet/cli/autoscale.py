"""``rollfleet autoscale``: the fleet's control loop, and its flags (shared with ``up --autoscale``)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any


def parse_bounds(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (``1:8``)."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, e.g. 1:8, got {text!r}") from None
    if not sep or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise argparse.ArgumentTypeError(f"expected 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return bounds


# The policy's flags: (flag, the Policy field it sets, its type, help). One table for the parser and
# for the Policy built from what it parsed, so a flag cannot be declared and then dropped.
_POLICY_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--target-utilization", "target_utilization", float, "(waiting + running jobs) per slot a class is sized for"),
    ("--target-wait", "target_wait_s", float, "seconds the oldest job may wait before one replica more"),
    ("--hysteresis", "hysteresis", float, "scale in only to a size whose load fits (1 - this) of its slots"),
    ("--cooldown", "cooldown_s", float, "seconds between two changes of direction of one class"),
    ("--scale-in-grace", "scale_in_grace_s", float,
     "seconds the signal must ask for fewer replicas before a class shrinks"),
    ("--hold-after", "hold_after_s", float, "seconds demand for an old version lasts before a replica is held there"),
    ("--max-per-version", "max_per_version", int, "held replicas per version"),
    ("--slots-per-replica", "slots_per_replica", int, "a replica's capacity until one registers its own"),
    ("--startup", "startup_s", float,
     "seconds a replica takes to start until one the controller launched was measured (launch to serving)"),
    ("--trend-window", "trend_window_s", float,
     "seconds of load the trend is judged over; a rising one is sized for a start-up time ahead (0: off)"),
)  # fmt: skip


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    from rollfleet.autoscale.planner import Policy

    defaults = Policy()
    for flag, field, kind, text in _POLICY_FLAGS:
        metavar = flag.removeprefix("--").upper().replace("-", "_")
        p.add_argument(flag, dest=field, metavar=metavar, type=kind, default=getattr(defaults, field), help=text)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between looks at the broker")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=10.0,
        help="seconds a silent controller keeps the lease; a second controller waits for it",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve /metrics and /keda (KEDA's metrics-api scaler) on this port (0: a free one)",
    )
    p.add_argument("--http-host", default="127.0.0.1", help="address of the HTTP endpoint")


def policy_from(args: argparse.Namespace, bounds: tuple[int, int]) -> Any:
    from rollfleet.autoscale.planner import Policy

    fields = {field: getattr(args, field) for _, field, _, _ in _POLICY_FLAGS}
    return Policy(min_replicas=bounds[0], max_replicas=bounds[1], **fields)


def add_parser(sub: Any, add_conn: Any, add_topology: Any, formatter: Any) -> None:
    p = sub.add_parser(
        "autoscale",
        help="size the fleet on its demand: replicas following latest, and replicas held at old versions asked for",
        description="Read the demand the broker holds (jobs per version, pinned sessions, refused requests), plan "
        "the fleet (a pure function of that signal, the fleet and the policy) and carry the plan out through a "
        "driver. One controller acts at a time (a lease on the broker; a second waits). Every decision is one log "
        "line with the signal that caused it.",
        formatter_class=formatter,
    )
    add_conn(p)
    add_topology(p)  # (what it declares, when the namespace is missing, must be the fleet's)
    p.add_argument("--bounds", type=parse_bounds, default="1:8", metavar="MIN:MAX", help="the fleet's size")
    p.add_argument(
        "--driver",
        default="local",
        choices=["local", "compose", "kubernetes", "none"],
        help="local: worker processes on this host; compose: the worker service of a Compose project; "
        "kubernetes: a worker Deployment (in-cluster); none: plan and publish only (KEDA scales)",
    )
    add_policy_flags(p)
    g = p.add_argument_group("local driver (worker processes on this host)")
    g.add_argument("--engine", default="echo", choices=["echo", "hf", "sglang", "vllm"])
    g.add_argument(
        "--store", default=None, help="the policy store directory workers follow (else echo follows versions)"
    )
    g.add_argument("--home", default=".rollfleet", help="workers' logs and local checkpoints")
    g.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `rollfleet worker` argument, e.g. --worker-arg=--capacity=8 (repeatable)",
    )
    c = p.add_argument_group("compose driver (the worker service of a Docker Compose project)")
    c.add_argument("--compose-file", default="docker-compose.yml", help="the project's compose file")
    c.add_argument("--project", default="rollfleet", help="the Compose project name (docker compose -p)")
    c.add_argument("--service", default="worker", help="the worker service to scale")
    k = p.add_argument_group("kubernetes driver (in-cluster, the pod's service account)")
    k.add_argument("--deployment", default="rollfleet-worker", help="the worker Deployment (the followers)")
    k.add_argument("--k8s-namespace", default="", help="its Kubernetes namespace (default: the pod's own)")
    g.add_argument("--id-prefix", default="auto", help="worker ids are PREFIX-<hex> and PREFIX-v<V>-<hex>")
    g.add_argument(
        "--stop-workers",
        action="store_true",
        help="stop the workers when the controller stops (else they run on, found again by the next one)",
    )


def compose_driver(args: argparse.Namespace) -> Any:
    import shutil

    from rollfleet.autoscale.drivers.compose import ComposeDriver

    compose = ["docker", "compose"] if shutil.which("docker-compose") is None else ["docker-compose"]
    return ComposeDriver(Path(args.compose_file), args.project, service=args.service, compose=compose)


def local_driver(args: argparse.Namespace, url: str, keep_workers: bool) -> Any:
    from rollfleet.autoscale.drivers.local import LocalDriver

    return LocalDriver(
        url=url,
        namespace=args.namespace,
        engine=args.engine,
        home=Path(args.home),
        store=Path(args.store) if args.store else None,
        worker_args=list(args.worker_arg),
        prefix=args.id_prefix,
        keep_workers=keep_workers,
    )


async def cmd_autoscale(args: argparse.Namespace, connect_options: dict[str, Any], topology: Any) -> int:
    from rollfleet.autoscale.controller import Controller, ControllerConfig

    driver: Any
    if args.driver == "compose":
        driver = compose_driver(args)
    elif args.driver == "kubernetes":
        from rollfleet.autoscale.drivers.kubernetes import KubernetesDriver

        driver = KubernetesDriver(args.deployment, namespace=args.k8s_namespace)
    elif args.driver == "none":
        from rollfleet.autoscale.drivers.base import PlanOnly

        driver = PlanOnly()
    else:
        driver = local_driver(args, args.nats, keep_workers=not args.stop_workers)
    config = ControllerConfig(
        url=args.nats,
        namespace=args.namespace,
        policy=policy_from(args, args.bounds),
        interval_s=args.interval,
        lease_ttl_s=args.lease_ttl,
        http_host=args.http_host,
        http_port=args.http_port,
        store=Path(args.store) if args.store else None,
        connect_options=connect_options,
        topology=topology,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await Controller(config, driver).run(stop)
    return 0
