"""The ``rollfleet`` command: broker, declare, worker, permissions, status (and up, in its own module)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rollfleet.cli import event_loop
from rollfleet.cli.event_loop import EVENT_LOOP_ENV, LOOP_CHOICES
from rollfleet.runtime import logs
from rollfleet.schemas import Names
from rollfleet.schemas.errors import InvalidRequest, RollfleetError

DEFAULT_URL = "nats://127.0.0.1:4222"


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_conn(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=DEFAULT_URL, help="broker URL(s), comma-separated (default %(default)s)")
    p.add_argument("--namespace", "-n", default="default", help="run namespace (default %(default)s)")
    p.add_argument("--token", default=None, help="broker auth token")
    p.add_argument("--creds", default=None, help="NATS credentials file")
    p.add_argument("--tls-ca", default=None, help="CA bundle for TLS to the broker")
    p.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="client key (mutual TLS)")


def _conn_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if args.token:
        opts["token"] = args.token
    if args.creds:
        opts["creds_file"] = args.creds
    if args.tls_ca:
        opts["tls_ca"] = args.tls_ca
    if args.tls_cert:
        opts["tls_cert"], opts["tls_key"] = args.tls_cert, args.tls_key
    return opts


def _topology(args: argparse.Namespace) -> Any:
    from rollfleet.broker.topology import TopologyConfig

    fields: dict[str, Any] = {}
    if getattr(args, "replicas", None):
        fields["replicas"] = args.replicas
    if getattr(args, "ack_wait", None):
        fields["ack_wait_s"] = args.ack_wait
    if getattr(args, "duplicate_window", None):
        fields["duplicate_window_s"] = args.duplicate_window
    if getattr(args, "max_msg_bytes", None):
        fields["max_msg_bytes"] = args.max_msg_bytes
    if getattr(args, "max_deliver", None):
        fields["max_deliver"] = args.max_deliver
    return TopologyConfig(**fields)


def _add_topology(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=None, help="stream replicas (3 on a 3-node cluster)")
    p.add_argument("--ack-wait", type=float, default=None, help="seconds before an unacked job is redelivered")
    p.add_argument("--duplicate-window", type=float, default=None, help="idempotency window in seconds")
    p.add_argument("--max-deliver", type=int, default=None, help="deliveries of a job before the broker gives it up")
    p.add_argument(
        "--max-msg-bytes", type=int, default=None, help="largest stored message; larger answers go in chunks"
    )


def _add_worker_settings(p: argparse.ArgumentParser) -> None:
    """``rollfleet worker``'s flags for the table of worker settings: their defaults and help are
    the table's (``workers/worker_settings.py``), never written here."""
    from rollfleet.workers.worker_settings import WORKER_SETTINGS, shown

    for s in WORKER_SETTINGS:
        if s.flag is None:
            continue
        if isinstance(s.default, bool):  # (a switch: off unless given)
            p.add_argument(s.flag, action="store_true", help=s.meaning)
        else:
            parse = _positive_int if isinstance(s.default, int) else float
            p.add_argument(
                s.flag, type=parse, default=s.flag_default, help=f"{s.meaning} (default {shown(s.flag_default)})"
            )


def _worker_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``WorkerConfig``'s table settings as ``rollfleet worker`` was given them."""
    from rollfleet.workers.worker_settings import WORKER_DEFAULTS, WORKER_SETTINGS

    values = {s.field: getattr(args, s.dest) for s in WORKER_SETTINGS if s.flag is not None}
    if not args.store:  # (nothing to catch up with)
        values["catch_up_wait_s"] = WORKER_DEFAULTS["catch_up_wait_s"]
    return values


DESCRIPTION = """\
rollfleet: an external rollout service for asynchronous RL. A trainer submits rollout jobs
through a NATS JetStream broker; workers anywhere pull the jobs their policy version may serve
and follow the versions the trainer publishes.

Start here: `rollfleet up` runs a local broker and workers and prints how a trainer connects;
`rollfleet status` shows the fleet. `rollfleet COMMAND --help` explains each command."""


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, except flags that have none (off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: each subcommand's flags are built by its own ``_add_*_command``, in the
    order ``rollfleet --help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="rollfleet", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default=None, help="debug, info, warning (env ROLLFLEET_LOG_LEVEL)")
    parser.add_argument(
        "--event-loop",
        choices=LOOP_CHOICES,
        default=None,
        help=f"the loop of worker, gateway, up: auto (worker and gateway on uvloop where installed), uvloop, "
        f"asyncio (env {EVENT_LOOP_ENV})",
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _add_broker_command(sub)
    _add_declare_command(sub)
    _add_worker_command(sub)
    _add_up_command(sub)
    _add_permissions_command(sub)
    _add_gateway_command(sub)
    from rollfleet.cli.autoscale import add_parser as add_autoscale

    add_autoscale(sub, _add_conn, _add_topology, _DefaultsFormatter)
    _add_status_command(sub)
    from rollfleet.cli.replay import add_parser as add_replay

    add_replay(sub, _add_conn)
    return parser


def _add_broker_command(sub: Any) -> None:
    """``rollfleet broker``: the embedded nats-server, its store and the namespaces it declares."""
    p = sub.add_parser("broker", help="run the embedded nats-server and declare a namespace")
    p.add_argument("--store", default=".rollfleet/broker", help="JetStream store directory")
    p.add_argument("--port", type=int, default=4222)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--config", default=None, help="nats-server config (default: the packaged single-node one)")
    p.add_argument("--namespace", "-n", action="append", default=None, help="namespace(s) to declare")
    _add_topology(p)


def _add_declare_command(sub: Any) -> None:
    """``rollfleet declare``: a namespace's streams and buckets, on a broker already running."""
    p = sub.add_parser("declare", help="declare a namespace's streams and buckets on a running broker")
    _add_conn(p)
    _add_topology(p)


def _add_worker_command(sub: Any) -> None:
    """``rollfleet worker``: where it connects, what it serves and follows, then each engine's own flags."""
    p = sub.add_parser("worker", help="run a rollout worker")
    _add_conn(p)
    _add_topology(p)
    p.add_argument("--engine", default="echo", choices=["echo", "hf", "sglang", "vllm"])
    p.add_argument("--worker-id", default=None)
    _add_worker_policy_flags(p)
    _add_echo_engine_flags(p)
    _add_session_cache_flags(p)
    _add_hf_engine_flags(p)
    _add_server_engine_flags(p)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")


def _add_worker_policy_flags(p: argparse.ArgumentParser) -> None:
    """``rollfleet worker``: which weights it serves (a fixed version or checkpoint, or the policy store it
    follows), with the table of worker settings among them."""
    p.add_argument("--version", type=int, default=None, help="serve this fixed version (no policy following)")
    p.add_argument(
        "--hold-version",
        type=int,
        default=None,
        help="with --store: serve this version from the store and no other, for pinned sessions and exact "
        "jobs that still need it (the rest of the fleet moves on)",
    )
    _add_worker_settings(p)
    p.add_argument(
        "--store",
        default=None,
        help="policy store to follow: a directory, or s3://bucket/prefix (gs://, az://); credentials come from "
        "the environment (AWS_ACCESS_KEY_ID, ...), never from the command line",
    )
    p.add_argument(
        "--store-endpoint",
        default=None,
        metavar="URL",
        help="with an s3:// store: an S3-compatible endpoint (MinIO, Ceph, R2); also AWS_ENDPOINT_URL",
    )
    p.add_argument("--local-dir", default=None, help="host-local checkpoint directory (with --store)")
    p.add_argument("--model-dir", default=None, help="serve this fixed checkpoint (without --store)")
    p.add_argument("--pre-read-hook", default=None, help="module:function run before reading a version")


def _add_echo_engine_flags(p: argparse.ArgumentParser) -> None:
    """``rollfleet worker --engine echo``: the timings and token rules of the model-free engine."""
    p.add_argument("--echo-latency", type=float, default=0.0, help="echo engine: seconds per job")
    p.add_argument("--echo-token-latency", type=float, default=0.0, help="echo engine: seconds per token")
    p.add_argument(
        "--echo-startup",
        type=_non_negative_float,
        default=0.0,
        help="echo engine: seconds its start takes (a GPU server's start takes tens of seconds)",
    )
    p.add_argument(
        "--echo-whole-requests",
        action="store_true",
        help="echo engine: report no tokens while generating, as an HTTP engine (resumable jobs run in segments)",
    )
    p.add_argument(
        "--echo-prefill-latency", type=float, default=0.0, help="echo engine: seconds per prompt token not cached"
    )
    p.add_argument(
        "--echo-keyed",
        action="store_true",
        help="echo engine: each token a function of the weights it loaded, the context and the seed, so a checker "
        "holding a version's weights can recompute it (needs --store or --model-dir)",
    )


def _add_session_cache_flags(p: argparse.ArgumentParser) -> None:
    """``rollfleet worker``: the session context cache of the in-process engines (echo, hf)."""
    p.add_argument(
        "--session-cache-mb",
        type=_non_negative_float,
        default=2048.0,
        help="echo, hf: memory for sessions' cached contexts (0: none)",
    )
    p.add_argument(
        "--session-ttl",
        type=_non_negative_float,
        default=600.0,
        help="echo, hf: drop a session's context idle this long",
    )


def _add_hf_engine_flags(p: argparse.ArgumentParser) -> None:
    """``rollfleet worker --engine hf``: the in-process Hugging Face engine."""
    p.add_argument("--device", default="auto", help="hf engine: cpu, cuda, auto")
    p.add_argument("--dtype", default=None, help="hf engine: float32, bfloat16 (default: the checkpoint's)")
    p.add_argument("--max-batch", type=int, default=32, help="hf engine: sequences decoded together")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="hf, vllm: every request run alone (batch-invariant); sglang: --enable-deterministic-inference",
    )


def _add_server_engine_flags(p: argparse.ArgumentParser) -> None:
    """``rollfleet worker --engine sglang|vllm``: the engines that are HTTP servers, attached to or launched."""
    p.add_argument("--sglang-url", default=None, help="sglang engine: attach to this server")
    p.add_argument("--sglang-arg", action="append", default=[], help="sglang engine: extra launch_server argument")
    p.add_argument(
        "--sglang-pull-dir",
        default=None,
        help="sglang engine: activate through the server's /pull_weights from --store into this host-local directory",
    )
    p.add_argument("--vllm-url", default=None, help="vllm engine: attach to this server (else launch one)")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="vllm engine: launch the server with this Python, one that has vLLM (e.g. .venv-vllm/bin/python)",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="vllm engine: extra server argument (--vllm-arg=--dtype=float32)",
    )
    p.add_argument("--vllm-log", default=None, help="vllm engine: append the launched server's output to this file")


def _add_up_command(sub: Any) -> None:
    """``rollfleet up``: a local fleet, its size, where it keeps its files and what its workers serve."""
    from rollfleet.cli.autoscale import parse_bounds

    p = sub.add_parser(
        "up",
        help="start a local fleet (the embedded broker and N workers) and print how a trainer connects",
        description="Start the embedded broker and N worker processes on this machine, wait until every "
        "worker is ready, and print the broker URL, namespace, policy store and base a trainer uses. "
        "Ctrl-C drains the workers and stops everything; the broker's store is kept for the next start.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--workers", type=_positive_int, default=2, metavar="N", help="worker processes to start")
    p.add_argument(
        "--engine",
        default="echo",
        choices=["echo", "hf"],
        help="echo: no model, made-up tokens (try the request path without torch); hf: a Hugging Face "
        "model (--tiny-model or --model-dir) whose weights follow the policy store",
    )
    p.add_argument("--namespace", "-n", default="default", metavar="NS", help="run namespace; a trainer uses the same")
    p.add_argument(
        "--home", default=".rollfleet", metavar="DIR", help="broker store, replica checkpoints, logs (and hf's store)"
    )
    p.add_argument("--port", type=int, default=4222, help="broker port (0: a free one)")
    p.add_argument(
        "--metrics-base-port",
        type=int,
        default=9400,
        metavar="PORT",
        help="worker i serves Prometheus metrics on base+i (0: free ports)",
    )
    _add_up_model_flags(p)
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `rollfleet worker` argument for every worker, e.g. --worker-arg=--capacity=8 (repeatable)",
    )
    p.add_argument(
        "--autoscale",
        type=parse_bounds,
        default=None,
        metavar="MIN:MAX",
        help="size the fleet on its demand between MIN and MAX workers (rollfleet autoscale's local driver) "
        "instead of --workers",
    )


def _add_up_model_flags(p: argparse.ArgumentParser) -> None:
    """``rollfleet up``: the base checkpoint and policy store its workers serve, and whether echo follows."""
    p.add_argument("--model-dir", default=None, metavar="DIR", help="hf: the base checkpoint, committed as version 0")
    p.add_argument(
        "--tiny-model", action="store_true", help="hf: build a tiny Qwen3-style model in HOME/models/tiny as the base"
    )
    p.add_argument(
        "--store", default=None, metavar="DIR", help="hf: the policy store the workers follow (default: HOME/store)"
    )
    p.add_argument(
        "--follow-versions",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="echo: activate each version the trainer commits, as hf workers do (--no-follow-versions: "
        "stay at version 0)",
    )


def _add_permissions_command(sub: Any) -> None:
    """``rollfleet permissions``: namespaces and their worker ids in, a nats-server auth config out."""
    p = sub.add_parser(
        "permissions", help="print a nats-server auth config with a trainer and one user per worker, per namespace"
    )
    p.add_argument(
        "spec",
        nargs="+",
        metavar="NAMESPACE=WORKER[,WORKER...]",
        help="a namespace and its worker ids, e.g. run1=w1,w2",
    )


def _add_gateway_command(sub: Any) -> None:
    """``rollfleet gateway``: the HTTP doors (SGLang's and OpenAI's) onto the fleet."""
    p = sub.add_parser(
        "gateway",
        help="serve the fleet over HTTP: SGLang's POST /generate and OpenAI's /v1/completions and chat",
        formatter_class=_DefaultsFormatter,
    )
    _add_conn(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one, printed)")
    p.add_argument(
        "--max-staleness", type=int, default=None, help="constraint of requests that carry none (default: any version)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("ROLLFLEET_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' (env ROLLFLEET_API_KEY)",
    )
    p.add_argument(
        "--client-id",
        default="gateway",
        help="the gateways' client id: any number of live gateways may share it (a key retried through any of them "
        "is one job, answered once)",
    )
    _add_topology(p)  # (what it declares again after a loss must be the fleet's, not the defaults)
    p.add_argument("--model-name", default="rollfleet", help="the model name /v1/models reports")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may wait for its answer")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="the served model's tokenizer files (its chat template), for /v1/chat/completions",
    )


def _add_status_command(sub: Any) -> None:
    """``rollfleet status``: the fleet, its queues and the latest version, as a table or JSON."""
    p = sub.add_parser("status", help="show the fleet, queue depths and the latest version")
    _add_conn(p)
    p.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        # The processes that own a long-lived loop run on the chosen one; the environment carries
        # the choice to the processes they start (``up``'s workers).
        loop = event_loop.chosen(args.event_loop)
        os.environ[EVENT_LOOP_ENV] = loop
        if args.command == "broker":
            return cmd_broker(args)
        if args.command == "declare":
            return asyncio.run(cmd_declare(args))
        if args.command == "worker":
            return event_loop.run(cmd_worker(args), loop, command="worker")
        if args.command == "up":
            from rollfleet.cli.up import cmd_up

            return event_loop.run(cmd_up(args), loop, command="up")
        if args.command == "status":
            return asyncio.run(cmd_status(args))
        if args.command == "replay":
            from rollfleet.cli.replay import cmd_replay

            return asyncio.run(cmd_replay(args, _conn_options(args)))
        if args.command == "autoscale":
            from rollfleet.cli.autoscale import cmd_autoscale

            return asyncio.run(cmd_autoscale(args, _conn_options(args), _topology(args)))
        if args.command == "gateway":
            return event_loop.run(cmd_gateway(args), loop, command="gateway")
        if args.command == "permissions":
            return cmd_permissions(args)
    except RollfleetError as exc:
        print(f"rollfleet: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


def cmd_broker(args: argparse.Namespace) -> int:
    from rollfleet.broker import EmbeddedBroker, check_server_binary
    from rollfleet.broker.server import DEFAULT_CONFIG

    log = logs.get_logger("rollfleet.broker")
    binary = check_server_binary()
    broker = EmbeddedBroker(
        store_dir=Path(args.store),
        port=args.port,
        host=args.host,
        config=Path(args.config) if args.config else DEFAULT_CONFIG,
        binary=binary,
    )
    broker.start()
    namespaces = args.namespace or ["default"]
    args.nats = broker.url
    for ns in namespaces:
        args.namespace = ns
        asyncio.run(cmd_declare(args, quiet=True))
    log.info("broker running", url=broker.url, store=str(Path(args.store).resolve()), namespaces=namespaces)
    print(f"broker: {broker.url}  store: {Path(args.store).resolve()}", flush=True)
    stop = {"now": False}

    def on_signal(signum: int, _: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop["now"] and broker.alive():
        time.sleep(0.2)
    broker.stop()
    return 0 if stop["now"] else 1


async def cmd_declare(args: argparse.Namespace, quiet: bool = False) -> int:
    from rollfleet.broker import ensure_topology
    from rollfleet.broker.connection import connect
    from rollfleet.schemas import Names

    options = _conn_options(args) if hasattr(args, "token") else {}  # `broker` declares on its own server
    names = Names(args.namespace)
    nc = await connect(args.nats, name="rollfleet-declare", inbox_prefix=names.inbox_prefix("trainer"), **options)
    try:
        created = await ensure_topology(nc.jetstream(), names, _topology(args))
    finally:
        await nc.close()
    if not quiet:
        print(f"namespace {args.namespace}: created {created or 'nothing (already declared)'}")
    return 0


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``make_engine`` for ``rollfleet worker --engine``, from its flags;
    refuses the flag combinations that engine cannot honour."""
    from rollfleet.policy_store.bucket import is_store_url

    options: dict[str, Any] = {}
    sessions = {"session_cache_bytes": int(args.session_cache_mb * 1024**2), "session_ttl_s": args.session_ttl}
    if args.engine == "echo":
        options = {
            "latency_s": args.echo_latency,
            "per_token_s": args.echo_token_latency,
            "streams_tokens": not args.echo_whole_requests,
            "keyed": args.echo_keyed,
            "startup_s": args.echo_startup,
        }
        if args.echo_keyed and not (args.store or args.model_dir):
            raise InvalidRequest("--echo-keyed keys its tokens by the weights it loads: give --store or --model-dir")
        options |= {"prefill_s_per_token": args.echo_prefill_latency, **sessions}
    elif args.engine == "hf":
        options = {"device": args.device, "dtype": args.dtype, "max_batch": args.max_batch, **sessions}
        options["deterministic"] = args.deterministic
    elif args.engine == "sglang":
        options = {"url": args.sglang_url, "launch_args": list(args.sglang_arg)}
        options["deterministic"] = args.deterministic
        if args.sglang_pull_dir:
            if args.store and is_store_url(args.store):
                raise InvalidRequest("--sglang-pull-dir reads the store as a directory; with an object store, omit it")
            options |= {"pull_dir": args.sglang_pull_dir, "store_dir": args.store}
    elif args.engine == "vllm":
        options = {"url": args.vllm_url, "python": args.vllm_python, "launch_args": list(args.vllm_arg)}
        options["log_file"] = args.vllm_log
        options["deterministic"] = args.deterministic
    return options


async def cmd_worker(args: argparse.Namespace) -> int:
    from rollfleet.policy_store.bucket import check_store
    from rollfleet.workers.engines import make_engine
    from rollfleet.workers.worker import Worker, WorkerConfig, default_worker_id

    options = _engine_options(args)
    store = check_store(args.store) if args.store else None  # a URL rollfleet cannot serve: one line
    for flag, value in (("--local-dir", args.local_dir), ("--store", store if isinstance(store, Path) else None)):
        if value:
            try:
                Path(value).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InvalidRequest(f"{flag} {value}: cannot be created: {exc.strerror or exc}") from None
    if not args.health > 0:
        raise InvalidRequest(f"--health must be > 0 seconds, got {args.health}")
    if args.hold_version is not None and (args.hold_version < 0 or not args.store):
        raise InvalidRequest("--hold-version needs --store and a version >= 0")
    if not args.checkpoint_s > 0:
        raise InvalidRequest(f"--checkpoint-s must be > 0 seconds, got {args.checkpoint_s}")
    if args.exact_drain < 0:
        raise InvalidRequest(f"--exact-drain must be >= 0 seconds, got {args.exact_drain}")
    engine = make_engine(args.engine, **options)
    config = WorkerConfig(
        nats_url=args.nats,
        namespace=args.namespace,
        worker_id=args.worker_id or default_worker_id(),
        version=args.version or 0,
        store_dir=store,
        store_endpoint=args.store_endpoint,
        local_dir=Path(args.local_dir) if args.local_dir else None,
        model_dir=Path(args.model_dir) if args.model_dir else None,
        pre_read_hook=args.pre_read_hook,
        metrics_port=args.metrics_port,
        hold_version=args.hold_version,
        topology=_topology(args),
        **_worker_settings(args),
        connect_options=_conn_options(args),
    )
    worker = Worker(config, engine)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # at every stage, connecting and catching up too
        loop.add_signal_handler(sig, worker.request_stop)
    await worker.run()
    if worker.sync is not None and worker.sync.stuck:
        # A prepare stuck in a read was abandoned; its reader threads would block the
        # interpreter's exit (it joins them), so leave without waiting for them.
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_permissions(args: argparse.Namespace) -> int:
    from rollfleet.broker.permissions import render_config

    namespaces: dict[str, list[str]] = {}
    for spec in args.spec:
        namespace, sep, workers = spec.partition("=")
        if not sep or not workers:
            raise InvalidRequest(f"expected NAMESPACE=WORKER[,WORKER...], got {spec!r}")
        Names(namespace)  # validates
        namespaces.setdefault(namespace, []).extend(w for w in workers.split(",") if w)
    sys.stdout.write(render_config(namespaces))
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    from rollfleet.cli.status import collect_status, render_table

    snapshot = await collect_status(args.nats, args.namespace, **_conn_options(args))
    if args.json:
        print(json.dumps(snapshot, indent=2))
    else:
        print(render_table(snapshot))
    return 0


async def cmd_gateway(args: argparse.Namespace) -> int:
    from rollfleet.gateway.app import serve
    from rollfleet.gateway.chat import ChatTemplate
    from rollfleet.trainer_client import RolloutClient

    template = ChatTemplate.from_dir(args.tokenizer) if args.tokenizer is not None else None

    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]

    def started(port: int) -> None:
        on = type(loop).__module__.split(".")[0]  # (uvloop or asyncio: which loop it runs on)
        print(f"rollfleet gateway on http://{args.host}:{port} (namespace {args.namespace}, loop {on})", flush=True)

    from rollfleet.broker.startup import until_ready

    # (a server: started while the broker is not ready, a cluster electing, it tries again)
    client = await until_ready(
        lambda: RolloutClient.connect(
            args.nats,
            namespace=args.namespace,
            client_id=args.client_id,
            shared=True,
            topology=_topology(args),
            **_conn_options(args),
        ),
        what="connect",
    )
    async with client:
        with contextlib.suppress(asyncio.CancelledError):
            await serve(
                client, args.host, args.port, started=started, model_name=args.model_name, api_key=args.api_key,
                default_max_staleness=args.max_staleness, timeout_s=args.timeout, chat_template=template,
            )  # fmt: skip
    return 0
