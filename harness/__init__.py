"""The harness that the tests, the benchmarks and the reliability suite share.

Everything here drives real parts: a real nats-server (the embedded broker, or the configs of
``broker_config/`` as written), real ``rollfleet worker`` processes, real signals. Waiting is
bounded; processes are stopped by PID, politely first.

- waiting: :func:`wait_until`
- brokers: :func:`temp_broker`, :func:`start_cluster` / :class:`LocalCluster`, :func:`render_config`;
  a node loss: :func:`kill_stream_leader`, :func:`wait_failover`
- workers: :func:`running_worker` (in this process), :func:`start_worker_process`,
  :class:`ProcessGroup` (named child processes with log files), :class:`LocalFleet`
- stopping: :func:`terminate`, :func:`stop_all`
- weights: :func:`write_base_checkpoint`, :func:`tensors_at` (a model-free checkpoint and trainer)
- measuring the broker: :func:`temp_broker` with ``monitor=True``, :func:`broker_counters`,
  :class:`BrokerCounters` (messages in/out, JetStream API requests, CPU), :func:`cpu_seconds`
"""

from harness.cluster import (
    CLUSTER_PORTS,
    LEAF_PORTS,
    NODES,
    LocalCluster,
    NatsProcess,
    cluster_port_map,
    kill_stream_leader,
    make_dev_certs,
    render_config,
    start_cluster,
    wait_failover,
)
from harness.monitor import BrokerCounters, Counters, cpu_seconds
from harness.processes import (
    ProcessGroup,
    check_alive,
    rollfleet_command,
    spawn,
    start_worker_process,
    stop_all,
    worker_command,
)
from harness.waiting import WaitTimeout, wait_until
from harness.weights import expected_digest, local_digest, tensors_at, write_base_checkpoint
from harness.workers import broker_counters, running_worker, temp_broker
from rollfleet.cli.local_fleet import LocalFleet
from rollfleet.runtime.processes import die_with_parent, terminate

__all__ = [
    "CLUSTER_PORTS",
    "LEAF_PORTS",
    "NODES",
    "BrokerCounters",
    "Counters",
    "LocalCluster",
    "LocalFleet",
    "NatsProcess",
    "ProcessGroup",
    "WaitTimeout",
    "broker_counters",
    "check_alive",
    "cluster_port_map",
    "cpu_seconds",
    "die_with_parent",
    "expected_digest",
    "kill_stream_leader",
    "local_digest",
    "make_dev_certs",
    "render_config",
    "rollfleet_command",
    "running_worker",
    "spawn",
    "start_cluster",
    "start_worker_process",
    "stop_all",
    "temp_broker",
    "tensors_at",
    "terminate",
    "wait_failover",
    "wait_until",
    "worker_command",
    "write_base_checkpoint",
]
