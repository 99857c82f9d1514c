"""The machine adversary's broker as a three-node JetStream cluster (``--cluster``), and its faults.

Each node is a nats-server with the run's own auth config, joined to the other two by routes;
every process is given the three client URLs and the streams and buckets are R3
(``TopologyConfig(replicas=3)``), as broker_config/cluster/ documents for a deployment. A node's
faults, each on one node at a time (the victim at random, or the leader of the jobs stream):

``node_kill``   SIGKILL, started again on its own store after ``down_s``; its clients fail over.
``node_pause``  SIGSTOP for ``for_s``, then SIGCONT: alive, heard by nobody, its Raft terms stale.
``node_cut``    cut off from the other two for ``for_s`` while its own clients stay connected to
                it (a minority partition): every route byte it sends is held. Each route runs
                through a relay of the harness (``harness.cluster.RouteRelays``: one
                per ordered pair of nodes, in this process), so a cut needs no root and no
                firewall, and runs wherever the cluster does.

A single-node broker's ``broker_restart`` and ``pause_broker`` become ``node_kill`` and
``node_pause`` here (a whole cluster is never down at once: that is what R3 is for).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from harness.cluster import RouteRelays
from rollfleet.broker import EmbeddedBroker, free_port

NODES = ("a", "b", "c")
NODE_KINDS = ("node_kill", "node_pause", "node_cut")


@dataclass
class ClusterNode(EmbeddedBroker):
    """One node: an EmbeddedBroker on fixed ports (its peers and clients know them across its
    restarts), whose routes go out through ``peers`` (the relays to its peers' route ports) and
    which advertises ``advertise`` for routes (where nobody answers: no route a peer learns of
    by gossip goes around the relays)."""

    name: str = "a"
    route_port: int = 0
    http_port: int = 0
    peers: list[int] = field(default_factory=list)  # the ports it dials for its routes
    advertise: int | None = None

    @property
    def server_name(self) -> str:
        return f"rf-node-{self.name}"

    def command(self) -> list[str]:
        routes = ",".join(f"nats-route://127.0.0.1:{p}" for p in self.peers)
        cmd = [
            *super().command(),
            "--server_name", self.server_name, "--cluster_name", "rf-adversary",
            "--cluster", f"nats://127.0.0.1:{self.route_port}", "--routes", routes,
            "-m", str(self.http_port),
        ]  # fmt: skip
        return cmd if self.advertise is None else [*cmd, "--cluster_advertise", f"127.0.0.1:{self.advertise}"]


class NodeCluster:
    """Three ClusterNodes on one machine with the same config (its auth included), their routes
    through ``RouteRelays``."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir = Path(workdir)
        # The nodes' stores outside the work directory (removed at ``stop``); their logs in it.
        self.home = Path(tempfile.mkdtemp(prefix="rf-adv-cluster-"))
        ports = _distinct_ports(3 * len(NODES))
        routes = dict(zip(NODES, ports[len(NODES) : 2 * len(NODES)], strict=True))
        self.relays = RouteRelays(routes)
        self.nodes: dict[str, ClusterNode] = {}
        for i, name in enumerate(NODES):
            self.nodes[name] = ClusterNode(
                store_dir=self.home / f"nats-{name}",
                port=ports[i],
                config=config,
                log_file=self.workdir / f"nats-{name}.log",
                name=name,
                route_port=routes[name],
                http_port=ports[2 * len(NODES) + i],
                advertise=self.relays.nowhere_port,
            )
        self.cut: set[str] = set()

    def start(self, timeout: float = 60.0) -> NodeCluster:
        self.relays.start()
        for node in self.nodes.values():
            node.peers = self.relays.dials(node.name)
        try:
            for node in self.nodes.values():  # (a node listens for clients before its peers are up)
                self.start_node(node.name)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until every node's JetStream knows the meta leader (before, a stream cannot be declared)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._meta_leader(node) for node in self.nodes.values()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the cluster elected no JetStream meta leader in {timeout:g} s:\n{self.logs()[-3000:]}")

    @staticmethod
    def _meta_leader(node: ClusterNode) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/jsz", timeout=1) as resp:
                return (json.loads(resp.read()).get("meta_cluster") or {}).get("leader")
        except (OSError, ValueError):
            return None

    def start_node(self, name: str) -> None:
        """Start one node on its store, as an ``EmbeddedBroker`` starts."""
        self.nodes[name].start(timeout=30.0)

    @property
    def first(self) -> ClusterNode:
        return self.nodes[NODES[0]]

    def url(self, user: str | None = None, password: str | None = None) -> str:
        creds = f"{user}:{password}@" if user else ""
        return ",".join(f"nats://{creds}127.0.0.1:{n.port}" for n in self.nodes.values())

    @property
    def monitor_ports(self) -> list[int]:
        return [n.http_port for n in self.nodes.values()]

    def by_server_name(self, server_name: str | None) -> str | None:
        return next((n.name for n in self.nodes.values() if n.server_name == server_name), None)

    def pick(self, rng: random.Random, leader: str | None, exclude: set[str]) -> str | None:
        """A live node to attack: ``leader`` (a node's name) when given and free, else one at random."""
        free = [n for n in NODES if n not in exclude and self.nodes[n].alive()]
        if leader in free:
            return leader
        return rng.choice(free) if free else None

    def cut_off(self, name: str) -> None:
        self.relays.cut(name)
        self.cut.add(name)

    def heal(self, name: str) -> None:
        self.relays.heal(name)  # (a node not cut is no error: heal may run twice)
        self.cut.discard(name)

    def logs(self) -> str:
        parts = []
        for node in self.nodes.values():
            try:
                parts.append((node.log_file or Path("/nonexistent")).read_text(errors="replace"))
            except OSError:
                continue
        return "\n".join(parts)

    def stop(self) -> None:
        for name in list(self.cut):
            self.heal(name)
        for node in self.nodes.values():
            node.stop()
        self.relays.stop()
        shutil.rmtree(self.home, ignore_errors=True)


def _distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports
