"""The machine adversary's broker as a three-node JetStream cluster (``--cluster``), and its faults.

Each node is a nats-server with the run's own auth config, joined to the other two by routes;
every process is given the three client URLs and the streams and buckets are R3
(``TopologyConfig(replicas=3)``), as broker_config/cluster/ documents for a deployment. A node's
faults, each on one node at a time (the victim at random, or the leader of the jobs stream):

``node_kill``   SIGKILL, started again on its own store after ``down_s``; its clients fail over.
``node_pause``  SIGSTOP for ``for_s``, then SIGCONT: alive, heard by nobody, its Raft terms stale.
``node_cut``    cut off from the other two for ``for_s`` while its own clients stay connected to
                it (a minority partition): every route packet it sends is dropped by iptables.
                The owner match needs each node under a uid of its own (``setpriv``), so a cut
                needs root and iptables; without them it is skipped, with the reason.

A single-node broker's ``broker_restart`` and ``pause_broker`` become ``node_kill`` and
``node_pause`` here (a whole cluster is never down at once: that is what R3 is for).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rollfleet.broker import EmbeddedBroker, free_port

NODES = ("a", "b", "c")
CUT_COMMENT = "rollfleet-adversary"  # every rule this module adds carries it (and is removed by it)
NODE_KINDS = ("node_kill", "node_pause", "node_cut")


@dataclass
class ClusterNode(EmbeddedBroker):
    """One node: an EmbeddedBroker on fixed ports (its peers and clients know them across its
    restarts), started under ``uid`` when given (so iptables can tell its packets apart)."""

    name: str = "a"
    uid: int | None = None
    route_port: int = 0
    http_port: int = 0
    peers: list[int] = field(default_factory=list)  # every node's route port (its own included)

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
        if self.uid is None:
            return cmd
        # (setpriv sets the parent-death signal again after the uid change, which clears it)
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--pdeathsig=TERM", *cmd]


def cut_rules(node: ClusterNode, others: list[ClusterNode]) -> list[list[str]]:
    """The iptables rules (``-A`` form) that drop every route packet ``node`` sends: on the
    connections it opened to its peers' route ports, and on those they opened to its own. Its
    peers' packets still reach it, unanswered: both sides see a route go silent."""
    assert node.uid is not None
    owner = ["-m", "owner", "--uid-owner", str(node.uid)]
    tag = ["-m", "comment", "--comment", CUT_COMMENT]
    peer_ports = ",".join(str(o.route_port) for o in others)
    return [
        ["OUTPUT", "-o", "lo", "-p", "tcp", *owner, "-m", "multiport", "--dports", peer_ports, *tag, "-j", "DROP"],
        ["OUTPUT", "-o", "lo", "-p", "tcp", *owner, "--sport", str(node.route_port), *tag, "-j", "DROP"],
    ]


def why_no_cut() -> str | None:
    """Why ``node_cut`` cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (each node under a uid of its own, and iptables)"
    for tool in ("iptables", "setpriv"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    probe = subprocess.run(["iptables", "-L", "OUTPUT", "-n"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"iptables refused: {probe.stderr.decode(errors='replace').strip()[:200]}"
    return None


class NodeCluster:
    """Three ClusterNodes on one machine with the same config (its auth included)."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir = Path(workdir)
        self.cut_unavailable = why_no_cut()
        # A uid range of this process's own, so that parallel runs never match each other's rules.
        base = None if self.cut_unavailable else 200_000 + (os.getpid() % 100_000) * 4
        # The nodes' config and stores where their uids can reach them (a work directory may lie
        # under one only its owner may enter, as pytest's do); their logs stay in ``workdir``.
        self.home = Path(tempfile.mkdtemp(prefix="rf-adv-cluster-"))
        self.home.chmod(0o711)
        shutil.copyfile(config, self.home / "nats.conf")
        (self.home / "nats.conf").chmod(0o644)
        config = self.home / "nats.conf"
        ports = _distinct_ports(3 * len(NODES))
        routes = ports[len(NODES) : 2 * len(NODES)]
        self.nodes: dict[str, ClusterNode] = {}
        for i, name in enumerate(NODES):
            store = self.home / f"nats-{name}"
            self.nodes[name] = ClusterNode(
                store_dir=store,
                port=ports[i],
                config=config,
                log_file=self.workdir / f"nats-{name}.log",
                name=name,
                uid=None if base is None else base + i,
                route_port=routes[i],
                http_port=ports[2 * len(NODES) + i],
                peers=list(routes),
            )
        self.cut: set[str] = set()

    def start(self, timeout: float = 60.0) -> NodeCluster:
        for node in self.nodes.values():  # (a node listens for clients before its peers are up)
            self.start_node(node.name)
        self.wait_ready(timeout)
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
        """Start one node on its store (handed to its uid), as an ``EmbeddedBroker`` starts."""
        node = self.nodes[name]
        node.store_dir = Path(node.store_dir)
        node.store_dir.mkdir(parents=True, exist_ok=True)
        if node.uid is not None:
            for path in [node.store_dir, *node.store_dir.rglob("*")]:
                os.lchown(path, node.uid, node.uid)
        node.start(timeout=30.0)

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
        self._rules(name, "-A")
        self.cut.add(name)

    def heal(self, name: str) -> None:
        self._rules(name, "-D")  # (a rule already gone is no error: heal may run twice)
        self.cut.discard(name)

    def _rules(self, name: str, action: str) -> None:
        others = [n for n in self.nodes.values() if n.name != name]
        for rule in cut_rules(self.nodes[name], others):
            subprocess.run(["iptables", action, *rule], check=action == "-A", capture_output=True)

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
        shutil.rmtree(self.home, ignore_errors=True)


def _distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports
