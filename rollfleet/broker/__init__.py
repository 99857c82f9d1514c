"""The broker: run the embedded nats-server and declare a namespace's topology."""

from rollfleet.broker.server import EmbeddedBroker, check_server_binary, find_server_binary, free_port
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    TopologyConfig,
    bind_job_consumer,
    bind_replica_consumer,
    declare_job_consumer,
    declare_replica_consumer,
    ensure_job_consumer,
    ensure_results_consumer,
    ensure_topology,
    queue_depths,
)

__all__ = [
    "DEFAULT_TOPOLOGY",
    "EmbeddedBroker",
    "TopologyConfig",
    "bind_job_consumer",
    "bind_replica_consumer",
    "check_server_binary",
    "declare_job_consumer",
    "declare_replica_consumer",
    "ensure_job_consumer",
    "ensure_results_consumer",
    "ensure_topology",
    "find_server_binary",
    "free_port",
    "queue_depths",
]
