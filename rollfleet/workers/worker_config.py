"""A worker's configuration: every setting of a replica, with its default from the one table of
worker settings (``worker_settings.py``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.broker.topology import DEFAULT_TOPOLOGY, TopologyConfig
from rollfleet.schemas import DEFAULT_LIMITS, Limits
from rollfleet.workers.worker_settings import worker_default


@dataclass
class WorkerConfig:
    nats_url: str
    namespace: str
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    version: int = 0
    # Every default below that is a number or a switch comes from the one table of worker settings
    # (``worker_settings.py``: what each means, its ``rollfleet worker`` flag), written nowhere else.
    capacity: int = worker_default("capacity")
    heartbeat_s: float = worker_default("heartbeat_s")
    aging_s: float = worker_default("aging_s")
    wait_pull_s: float = worker_default("wait_pull_s")
    hot_s: float = worker_default("hot_s")
    max_waiting_pulls: int = worker_default("max_waiting_pulls")
    rebalance_s: float = worker_default("rebalance_s")
    standby_s: float = worker_default("standby_s")
    progress_s: float = worker_default("progress_s")
    health_s: float = worker_default("health_s")
    drain_timeout_s: float = worker_default("drain_timeout_s")
    exact_drain_s: float = worker_default("exact_drain_s")
    # Weights: follow published versions from a store (store_dir + local_dir), or serve a
    # fixed checkpoint (model_dir) at ``version``. Neither: a model-free engine such as echo,
    # which follows committed versions only with ``follow_versions``.
    store_dir: Path | str | None = None  # a directory or an object store URL (s3://, gs://, az://)
    store_endpoint: str | None = None  # an S3-compatible endpoint for an s3:// store
    local_dir: Path | None = None
    model_dir: Path | None = None
    follow_versions: bool = worker_default("follow_versions")
    catch_up_wait_s: float = worker_default("catch_up_wait_s")
    resync_s: float = worker_default("resync_s")
    pre_read_hook: str | None = None
    prepare_timeout_s: float = worker_default("prepare_timeout_s")
    verify_live: bool = worker_default("verify_live")
    checkpoint_tokens: int = worker_default("checkpoint_tokens")
    checkpoint_s: float = worker_default("checkpoint_s")
    hold_version: int | None = None  # serve this version of the store and no other (see VersionSync)
    metrics_port: int | None = None  # Prometheus endpoint; 0 picks a free port
    limits: Limits = DEFAULT_LIMITS
    topology: TopologyConfig = DEFAULT_TOPOLOGY
    connect_options: dict[str, Any] = field(default_factory=dict)
