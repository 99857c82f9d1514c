"""The adversary's three-node cluster and its node faults (``reliability.adversary.cluster_nodes``).

The schedule's node events are drawn only for a cluster, from a stream of their own, so every
other event of a seed stays where it was. A node cut off really loses its peers (every byte it
sends on its routes held by the relays its routes run through, ``RouteRelays``: no root, no
firewall) while it keeps running, and joins them again when healed; a node SIGKILLed and
started again on its store catches up. An R3 stream keeps a leader on the majority side
throughout: what the adversary's runs build on.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import nats

from harness import wait_until
from harness.cluster import cut_plan
from reliability.adversary.cluster_nodes import NODE_KINDS, ClusterNode, NodeCluster
from reliability.adversary.schedule import NODE_EVENT_KINDS, make_schedule


def test_node_events_are_drawn_only_for_a_cluster_and_leave_every_other_event_in_place() -> None:
    for seed in (1, 5, 19, 256):
        single = make_schedule(seed, 60.0)
        cluster = make_schedule(seed, 60.0, cluster=True)
        assert not [e for e in single if e.kind in NODE_KINDS]
        nodes = [e for e in cluster if e.kind in NODE_KINDS]
        assert nodes and {e.kind for e in nodes} <= set(NODE_EVENT_KINDS)
        assert [e for e in cluster if e.kind not in NODE_KINDS] == single
        for e in nodes:
            assert e.params["which"] in ("leader", "random")
            assert 0.5 <= e.params.get("down_s", e.params.get("for_s", 0.0)) <= 10.0


def test_a_cut_holds_only_what_the_node_sends_on_its_routes() -> None:
    # Relay (dialer, dialed): "up" carries what the dialer sends, "down" what the dialed one sends.
    assert cut_plan("b", ("a", "b", "c")) == [
        (("b", "a"), "up"), (("b", "c"), "up"),  # the routes b dials
        (("a", "b"), "down"), (("c", "b"), "down"),  # the routes its peers dial to reach it
    ]  # fmt: skip
    assert not [pair for pair, _ in cut_plan("b", ("a", "b", "c")) if "b" not in pair]  # a and c keep theirs


def _routes(node: ClusterNode) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/routez", timeout=2) as resp:
        return int(json.loads(resp.read())["num_routes"])


async def _leader(js: object, stream: str, timeout: float = 30.0, not_on: str | None = None) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = await asyncio.wait_for(js.stream_info(stream), 2.0)  # type: ignore[attr-defined]
            leader = info.cluster.leader if info.cluster else None
            if leader and leader != not_on:
                return str(leader)
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"no leader of {stream} (other than {not_on}) within {timeout:g} s")


async def test_a_cut_node_loses_its_peers_and_a_killed_one_comes_back(tmp_path: Path) -> None:
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 1MB\njetstream { max_file_store: 1GB }\n")
    cluster = await asyncio.to_thread(NodeCluster(tmp_path, conf).start)
    nc = None
    try:
        nc = await nats.connect(cluster.url().split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = nc.jetstream()
        # (Asked until the nodes have elected their meta leader: a fresh cluster on a loaded
        # machine may take longer than one request's 5 s, and a request before it times out.)
        await wait_until(
            lambda: js.add_stream(name="S", subjects=["s.>"], num_replicas=3),
            40.0,
            retry_errors=True,
            what="the stream created",
        )
        leader = cluster.by_server_name(await _leader(js, "S"))
        assert leader is not None
        before = {name: _routes(node) for name, node in cluster.nodes.items()}
        assert all(before.values()), before

        cluster.cut_off(leader)  # (the stream's leader: the others elect one among themselves)
        assert cluster.nodes[leader].alive()
        others = [n for n in cluster.nodes if n != leader]
        # (asked of the majority side: a client of the cut node hears nothing from the others)
        majority = await nats.connect(cluster.nodes[others[0]].url)
        try:
            new = await _leader(majority.jetstream(), "S", timeout=40.0, not_on=f"rf-node-{leader}")
        finally:
            await majority.close()
        assert cluster.by_server_name(new) in others
        cluster.heal(leader)
        await wait_until(lambda: _routes(cluster.nodes[leader]) >= before[leader], 40.0, what="joined again")

        victim = cluster.by_server_name(new)
        assert victim is not None
        cluster.nodes[victim].kill()
        assert not cluster.nodes[victim].alive()
        await _leader(js, "S", timeout=40.0, not_on=new)
        await wait_until(  # (the client may be failing over from the node just killed)
            lambda: js.publish("s.1", b"while a node is down", headers={"Nats-Msg-Id": "one"}, timeout=5.0),
            40.0,
            what="a write while a node is down",
            interval=0.3,
            retry_errors=True,
        )
        await asyncio.to_thread(cluster.start_node, victim)  # on its store: it catches up

        async def caught_up() -> bool:
            info = await js.stream_info("S")
            peers = (info.cluster.replicas or []) if info.cluster else []
            return len(peers) == 2 and all(p.current for p in peers) and info.state.messages == 1

        await wait_until(caught_up, 40.0, what="the restarted node caught up", interval=0.3, retry_errors=True)
    finally:
        if nc is not None:
            await nc.close()
        cluster.stop()
    assert not cluster.cut  # (every hold released)
