"""The nats-server configs of ``broker_config/`` run as they are written, on free ports.

The configs carry the documented ports (4222, 6222, ...) so a person can run them verbatim.
The harness copies them with every documented port mapped to a free loopback port and every
store directory moved under a temporary directory; nothing else changes.

``RouteRelays`` puts a relay on every route of a cluster on one machine, so that a node can be
cut off from its peers while it runs (the machine adversary's ``node_cut``); ``cut_plan`` says
what a cut holds.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from harness.link import LinkProxy
from rollfleet.broker import check_server_binary, free_port
from rollfleet.broker.server import wait_for_port
from rollfleet.runtime.processes import terminate
from rollfleet.schemas import Names

_T = TypeVar("_T")

NODES = ("a", "b", "c")

# The ports the configs document (see broker_config/README.md).
CLUSTER_PORTS = {
    "a": {"client": 4222, "route": 6222, "leaf": 7422, "http": 8222},
    "b": {"client": 4223, "route": 6223, "leaf": 7423, "http": 8223},
    "c": {"client": 4224, "route": 6224, "leaf": 7424, "http": 8224},
}
LEAF_PORTS = {"client": 4225, "http": 8225}

_STORE_DIR = re.compile(r'^(\s*store_dir:\s*)"[^"]*"', re.MULTILINE)


def render_config(src: Path, dst: Path, port_map: Mapping[int, int], store_dir: Path | None = None) -> Path:
    """Copy a config, replacing each documented port number and (if given) the store dir."""
    text = src.read_text()
    if port_map:
        pattern = re.compile(r"(?<![\d.])(" + "|".join(str(p) for p in port_map) + r")(?!\d)")
        text = pattern.sub(lambda m: str(port_map[int(m.group(1))]), text)
    if store_dir is not None:
        text, n = _STORE_DIR.subn(lambda m: f'{m.group(1)}"{store_dir}"', text)
        assert n == 1, f"{src} should set exactly one store_dir"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text)
    return dst


@dataclass
class NatsProcess:
    """One nats-server started from a config file; always stopped by ``stop``."""

    name: str
    config: Path
    port: int
    log_file: Path
    env: Mapping[str, str] | None = None
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsProcess:
        cmd = [str(check_server_binary()), "-c", str(self.config), *self.extra_args]
        env = {**os.environ, **(self.env or {})}
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_listening(self, timeout: float = 20.0) -> None:
        try:
            wait_for_port("127.0.0.1", self.port, timeout, self.proc)
        except Exception as exc:
            raise AssertionError(f"{self.name} did not start: {exc}\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.proc, timeout)


@dataclass
class LocalCluster:
    """The 3-node cluster of broker_config/cluster/, on free loopback ports."""

    nodes: dict[str, NatsProcess]
    port_map: dict[int, int]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes.values()]

    @property
    def url(self) -> str:
        """All three servers, comma-separated: how clients and workers should be given a cluster."""
        return ",".join(self.urls)

    def leaf_port(self, node: str) -> int:
        return self.port_map[CLUSTER_PORTS[node]["leaf"]]

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{node.log_tail()}" for name, node in self.nodes.items())


def cluster_port_map() -> dict[int, int]:
    """Every documented cluster and leaf port -> a distinct free loopback port."""
    documented = [p for ports in CLUSTER_PORTS.values() for p in ports.values()] + list(LEAF_PORTS.values())
    mapped: dict[int, int] = {}
    while len(mapped) < len(documented):
        port = free_port()
        if port not in mapped.values():
            mapped[documented[len(mapped)]] = port
    return mapped


def start_cluster(workdir: Path, cluster_dir: Path) -> LocalCluster:
    """Start node-a/b/c from the configs in ``cluster_dir`` (``broker_config/cluster``); the
    caller must ``stop()`` it (also on failure)."""
    port_map = cluster_port_map()
    nodes: dict[str, NatsProcess] = {}
    cluster = LocalCluster(nodes=nodes, port_map=port_map)
    try:
        for name in NODES:
            conf = render_config(
                cluster_dir / f"node-{name}.conf",
                workdir / "conf" / f"node-{name}.conf",
                port_map,
                store_dir=workdir / f"store-{name}",
            )
            node = NatsProcess(
                name=f"node-{name}",
                config=conf,
                port=port_map[CLUSTER_PORTS[name]["client"]],
                log_file=workdir / f"node-{name}.log",
            )
            nodes[name] = node.start()
        for node in nodes.values():
            node.wait_listening()
    except BaseException:
        cluster.stop()
        raise
    return cluster


async def kill_stream_leader(cluster: LocalCluster, js: Any, stream: str) -> str:
    """SIGKILL the node whose server leads ``stream``; returns that server's name."""
    info = await js.stream_info(stream)
    leader = info.cluster.leader if info.cluster else None
    node = next((n for n in cluster.nodes if f"rf-node-{n}" == leader), "a")
    process = cluster.nodes[node].proc
    assert process is not None
    process.kill()
    return f"rf-node-{node}"


async def wait_failover(
    js: Any,
    names: Names,
    killed: str,
    *,
    min_versions: Iterable[int],
    client_id: str,
    timeout: float = 30.0,
    errors: list[tuple[float, str]] | None = None,
) -> float:
    """Seconds until the fail-over is done: every Raft group on the request path (the jobs and
    results streams, the jobs consumers of ``min_versions``, the client's results consumer) has
    a leader on a live node, and the jobs stream takes a write (a probe on ``exact-999999``,
    purged at once). ``errors`` collects what the look-ups raised meanwhile."""
    t0 = time.monotonic()
    probe = names.job_subject("exact", 999_999)
    groups = [
        lambda: js.stream_info(names.jobs_stream),
        lambda: js.stream_info(names.results_stream),
        *[(lambda v=v: js.consumer_info(names.jobs_stream, names.job_consumer("min", v))) for v in min_versions],
        lambda: js.consumer_info(names.results_stream, names.results_consumer(client_id)),
    ]
    while time.monotonic() - t0 < timeout:
        try:
            leaders = [(await asyncio.wait_for(g(), 1.0)).cluster for g in groups]
            if all(c and c.leader and c.leader != killed for c in leaders):
                await js.publish(probe, b"probe", timeout=1.0)
                break
        except Exception as exc:
            if errors is not None:
                errors.append((round(time.monotonic() - t0, 2), repr(exc)[:80]))
        await asyncio.sleep(0.05)
    seconds = time.monotonic() - t0
    with suppress(Exception):  # the probe is no rollout job
        await js.purge_stream(names.jobs_stream, subject=probe)
    return seconds


def make_dev_certs(script: Path, directory: Path) -> dict[str, str]:
    """Run ``script`` (broker_config/tls/make-dev-certs.sh) for ``directory``; return the
    ROLLFLEET_TLS_* variables it prints."""
    out = subprocess.run(
        ["sh", str(script), str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    env = dict(re.findall(r"^export (ROLLFLEET_TLS_\w+)='([^']*)'$", out.stdout, re.MULTILINE))
    assert set(env) == {"ROLLFLEET_TLS_CA", "ROLLFLEET_TLS_CERT", "ROLLFLEET_TLS_KEY"}, out.stdout
    return env


# -- a node cut off from its peers, by relays on its routes ------------------------------------------

RelayWay = Literal["up", "down"]  # up: what the dialing node sends; down: what the dialed node sends


def cut_plan(node: str, nodes: Iterable[str]) -> list[tuple[tuple[str, str], RelayWay]]:
    """What cutting ``node`` off from its peers holds: each relay ``(dialer, dialed)`` and the way
    on it that carries what ``node`` sends. Its route connections go through the relays it dials
    (held up) and those its peers dial to reach it (held down); its peers' bytes still reach it,
    unanswered, so both sides see the route go silent (as a firewall dropping its packets makes it)."""
    peers = [peer for peer in nodes if peer != node]
    return [((node, peer), "up") for peer in peers] + [((peer, node), "down") for peer in peers]


class RouteRelays:
    """A relay (``LinkProxy``) on every route of a cluster on one machine, one per ordered pair of
    nodes: a node dials each peer's route port only through the relay ``(itself, peer)``
    (``dials``), and advertises for routes an address nobody answers on (``nowhere_port``), so
    that no route a peer learns of by gossip goes around the relays. ``cut(node)`` holds every
    byte the node sends on its routes, until ``heal(node)``, while the node runs and its clients
    stay connected: a minority partition on any machine (no root, no firewall). The relays run on
    an event loop of their own, in a thread, so a caller on any thread (or none) can cut."""

    def __init__(self, route_ports: Mapping[str, int]) -> None:
        self.route_ports = dict(route_ports)
        self.relays: dict[tuple[str, str], LinkProxy] = {}
        self._holds: dict[str, list[asyncio.Future[None]]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="route-relays", daemon=True)
        # Bound and never listening: a connection to it is refused, and no other process takes it.
        self._nowhere = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._nowhere.bind(("127.0.0.1", 0))
        self.nowhere_port = int(self._nowhere.getsockname()[1])

    def start(self) -> RouteRelays:
        self._thread.start()

        async def start_all() -> None:
            for dialer in self.route_ports:
                for dialed, port in self.route_ports.items():
                    if dialed != dialer:
                        self.relays[(dialer, dialed)] = await LinkProxy("127.0.0.1", port).start()

        self._call(start_all())
        return self

    def dials(self, node: str) -> list[int]:
        """The ports ``node`` dials for its routes, one relay per peer."""
        return [relay.port for (dialer, _), relay in self.relays.items() if dialer == node]

    def cut(self, node: str) -> None:
        if node in self._holds:
            return

        async def hold() -> list[asyncio.Future[None]]:
            return [
                asyncio.ensure_future(self.relays[pair].stall(way, _FOREVER_S))
                for pair, way in cut_plan(node, self.route_ports)
            ]

        self._holds[node] = self._call(hold())

    def heal(self, node: str) -> None:
        """Deliver what was held, in order (as TCP delivers what it retransmits), and carry on."""
        holds = self._holds.pop(node, [])

        async def release() -> None:
            for task in holds:
                task.cancel()  # (``stall`` opens its way again as it ends)
            await asyncio.gather(*holds, return_exceptions=True)

        self._call(release())

    def stop(self) -> None:
        if self._thread.is_alive():
            for node in list(self._holds):
                self.heal(node)

            async def close_all() -> None:
                for relay in self.relays.values():
                    await relay.close()

            self._call(close_all())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        self._nowhere.close()

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30.0)


_FOREVER_S = 365 * 24 * 3600.0  # a hold that only ``heal`` ends
