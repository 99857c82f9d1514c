"""A replica's parts, built from its configuration: its connection, the job runner, the puller,
version sync and its first registry entry. Each builder only maps settings to arguments; the worker wires the
parts to each other and starts them in order (``Worker.start``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollfleet.broker.connection import connect, logs_in
from rollfleet.broker.startup import until_ready
from rollfleet.broker.topology import WORKER_DECLARE_BARE_AFTER_S, wait_for_topology
from rollfleet.broker.types import NATS, JetStreamContext, KeyValue
from rollfleet.schemas import Names, ReplicaStatus
from rollfleet.workers.engines import Engine
from rollfleet.workers.job_puller import JobPuller
from rollfleet.workers.job_runner import JobRunner
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.version_sync import VersionSync
from rollfleet.workers.worker_config import WorkerConfig
from rollfleet.workers.worker_metrics import WorkerMetrics
from rollfleet.workers.worker_status import held_version, starting_status


async def connection(
    cfg: WorkerConfig, names: Names, *, on_reconnect: Callable[[], None]
) -> tuple[NATS, JetStreamContext]:
    """The replica's connection to the broker and its JetStream context, once its namespace is
    declared."""
    nc = await connect(
        cfg.nats_url,
        name=f"rollfleet-worker-{cfg.worker_id}",
        reconnect_hooks=[on_reconnect],
        inbox_prefix=names.inbox_prefix("worker", cfg.worker_id),  # its deliveries are its own
        **cfg.connect_options,
    )
    js = nc.jetstream()
    # (a trainer declares the namespace: a worker started while it is missing waits for it, and
    # one started while the broker is not ready, a cluster electing, tries again; so does each
    # broker read of the start below, should the broker stall meanwhile)
    bare_after_s = WORKER_DECLARE_BARE_AFTER_S if logs_in(cfg.nats_url, cfg.connect_options) else 0.0
    await until_ready(lambda: wait_for_topology(js, names, cfg.topology, bare_after_s=bare_after_s), what="namespace")
    return nc, js


def job_runner(
    cfg: WorkerConfig,
    js: JetStreamContext,
    names: Names,
    engine: Engine,
    served: ServedVersion,
    *,
    claims: KeyValue,
    max_payload: int,
    metrics: WorkerMetrics,
    log: Any,
    on_engine_down: Callable[[str], None],
) -> JobRunner:
    """The ``JobRunner`` that runs each pulled job."""
    return JobRunner(
        js,
        names,
        engine,
        worker_id=cfg.worker_id,
        limits=cfg.limits,
        ack_wait_s=cfg.topology.ack_wait_s,
        metrics=metrics,
        log=log,
        served=served,
        claims=claims,
        on_engine_down=on_engine_down,
        max_message_bytes=min(max_payload, cfg.topology.max_msg_bytes),
        checkpoint_tokens=cfg.checkpoint_tokens,
        checkpoint_s=cfg.checkpoint_s,
    )


def job_puller(
    cfg: WorkerConfig,
    nc: NATS,
    js: JetStreamContext,
    names: Names,
    served: ServedVersion,
    scheduler: SubjectScheduler,
    **wiring: Any,
) -> JobPuller:
    """The ``JobPuller`` that decides which jobs to pull and pulls them (not started yet);
    ``wiring``: its ``log``, ``in_flight``, ``run_job`` and ``stopping``."""
    return JobPuller(
        nc,
        js,
        names,
        served,
        scheduler,
        worker_id=cfg.worker_id,
        capacity=cfg.capacity,
        wait_pull_s=cfg.wait_pull_s,
        hot_s=cfg.hot_s,
        max_waiting_pulls=cfg.max_waiting_pulls,
        rebalance_s=cfg.rebalance_s,
        standby_s=cfg.standby_s,
        **wiring,
    )


def version_sync(
    cfg: WorkerConfig,
    js: JetStreamContext,
    names: Names,
    engine: Engine,
    served: ServedVersion,
    *,
    on_activated: Callable[[], None],
    drain_exact: Callable[[int, float], Awaitable[tuple[float, int]]],
    metrics: WorkerMetrics,
) -> VersionSync:
    """The ``VersionSync`` of a replica that follows versions (its checkpoint under ``local_dir``,
    by default ``.rollfleet/replicas/<worker_id>``)."""
    return VersionSync(
        js,
        names,
        engine,
        served,
        cfg.store_dir,
        cfg.local_dir or Path(f".rollfleet/replicas/{cfg.worker_id}"),
        worker_id=cfg.worker_id,
        on_activated=on_activated,
        drain_exact=drain_exact,
        exact_drain_s=cfg.exact_drain_s,
        resync_s=cfg.resync_s,
        pre_read_hook=cfg.pre_read_hook,
        metrics=metrics,
        verify_live=cfg.verify_live,
        prepare_timeout_s=cfg.prepare_timeout_s,
        hold_version=cfg.hold_version,
        store_endpoint=cfg.store_endpoint,
    )


def first_status(cfg: WorkerConfig, engine: Engine, version: int) -> ReplicaStatus:
    """The registry entry of the replica as it starts."""
    follows = cfg.store_dir is not None or cfg.follow_versions
    return starting_status(
        cfg.worker_id,
        version=version,
        engine=engine.name,
        capacity=cfg.capacity,
        heartbeat_s=cfg.heartbeat_s,
        held=held_version(cfg.hold_version, follows, cfg.version),
        now=time.time(),
    )
