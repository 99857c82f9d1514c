"""The 3-node JetStream cluster and the leaf node of broker_config/, started from their files.

One cluster serves the whole module (forming it and electing a meta leader takes a few
seconds); each test uses its own namespace.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from harness import (
    LEAF_PORTS,
    LocalCluster,
    NatsProcess,
    render_config,
    start_cluster,
    start_worker_process,
    terminate,
    wait_until,
)
from rollfleet.broker import TopologyConfig, ensure_job_consumer, ensure_topology
from rollfleet.schemas import Names
from tests.deploy_helpers import BROKER_CONFIG, CLUSTER_DIR, ECHO_V0, run_cli

pytestmark = pytest.mark.timeout(120)

R3 = TopologyConfig(replicas=3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("cluster"), CLUSTER_DIR)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def ns() -> str:
    return "c" + uuid.uuid4().hex[:8]


async def declared(js: Any, names: Names, cfg: TopologyConfig) -> bool:
    await ensure_topology(js, names, cfg)
    return True


async def connect_when_ready(servers: list[str], timeout: float = 20.0) -> nats.NATS:
    """Connect and wait until JetStream answers, i.e. the cluster has elected a meta leader."""
    nc = await nats.connect(servers=servers, connect_timeout=2, max_reconnect_attempts=-1)
    try:
        await wait_until(
            lambda: nc.jetstream(timeout=2).account_info(),
            timeout,
            what="JetStream meta leader election",
            interval=0.2,
            retry_errors=True,
        )
    except BaseException:
        await nc.close()
        raise
    return nc


async def test_cluster_forms_and_declares_r3_streams(cluster: LocalCluster, ns: str) -> None:
    nc = await connect_when_ready(cluster.urls)
    try:
        js = nc.jetstream(timeout=10)
        names = Names(ns)
        created = await wait_until(
            lambda: ensure_topology(js, names, R3), 20, what="declaring R3 streams", interval=0.2, retry_errors=True
        )
        assert names.jobs_stream in created

        for stream in (names.jobs_stream, names.results_stream, names.events_stream, f"KV_{names.policy_bucket}"):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            # The leader plus two replicas, one on each node.
            assert info.cluster is not None and info.cluster.leader, stream
            peers = {p.name for p in info.cluster.replicas or []} | {info.cluster.leader}
            assert peers == {"rf-node-a", "rf-node-b", "rf-node-c"}, (stream, peers)
    finally:
        await nc.close()


async def test_cluster_round_trip_across_nodes(cluster: LocalCluster, ns: str) -> None:
    """A job stored through node A is pulled through node C; its result is read through node B."""
    names = Names(ns)
    trainer = await connect_when_ready([cluster.nodes["a"].url])
    worker = await connect_when_ready([cluster.nodes["c"].url])
    reader = await connect_when_ready([cluster.nodes["b"].url])
    try:
        await wait_until(
            lambda: declared(trainer.jetstream(timeout=10), names, R3),
            20,
            what="declaring",
            interval=0.2,
            retry_errors=True,
        )
        tjs, wjs, rjs = trainer.jetstream(), worker.jetstream(), reader.jetstream()

        # A new R3 stream answers once its leader is elected: the first store may need a retry.
        ack = await wait_until(
            lambda: tjs.publish(names.job_subject("min", 0), b"job-1", headers={"Nats-Msg-Id": "k1"}),
            20,
            what="the first store on the new R3 stream",
            interval=0.2,
            retry_errors=True,
        )
        assert ack.stream == names.jobs_stream
        # The same idempotency key again is a duplicate, not a second job (R3 dedup).
        assert (await tjs.publish(names.job_subject("min", 0), b"job-1", headers={"Nats-Msg-Id": "k1"})).duplicate

        consumer = await ensure_job_consumer(wjs, names, "min", 0, R3)
        sub = await wjs.pull_subscribe_bind(consumer, stream=names.jobs_stream)
        # The new R3 consumer answers pulls once its own leader is elected (503 until then).
        [job] = await wait_until(
            lambda: sub.fetch(1, timeout=2), 20, what="the first pull on the new R3 consumer", interval=0.2,
            retry_errors=True,
        )
        assert job.data == b"job-1"
        subject = names.result_subject("trainer-0", "k1", "job1", "w1")
        await wjs.publish(subject, b"result-1", headers={"Nats-Msg-Id": "h:job1"})
        await job.ack_sync()

        msg = await rjs.get_last_msg(names.results_stream, subject)
        assert msg.data == b"result-1"

        # Work queue: acked means gone (the ack is applied through the stream's Raft log, so the
        # leader's view may take a moment on a loaded machine).
        async def gone() -> bool:
            return (await tjs.stream_info(names.jobs_stream)).state.messages == 0

        await wait_until(gone, 10, what="the acked job removed", interval=0.1)
    finally:
        for conn in (trainer, worker, reader):
            await conn.close()


@pytest.fixture(scope="module")
def leaf(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsProcess]:
    """The region leaf node of broker_config/leaf/, dialing the cluster's leaf ports."""
    workdir = tmp_path_factory.mktemp("leaf")
    conf = render_config(BROKER_CONFIG / "leaf" / "region-leaf.conf", workdir / "leaf.conf", cluster.port_map)
    node = NatsProcess(
        name="leaf", config=conf, port=cluster.port_map[LEAF_PORTS["client"]], log_file=workdir / "leaf.log"
    )
    try:
        node.start().wait_listening()
        yield node
    finally:
        node.stop()


async def test_leaf_node_region_reaches_hub_jetstream(cluster: LocalCluster, leaf: NatsProcess, ns: str) -> None:
    """A worker connected only to the region's leaf node pulls jobs from and stores results in the hub."""
    names = Names(ns)
    trainer = await connect_when_ready(cluster.urls)
    try:
        tjs = trainer.jetstream(timeout=10)
        await wait_until(lambda: declared(tjs, names, R3), 20, what="declaring", interval=0.2, retry_errors=True)
        await tjs.publish(names.job_subject("exact", 0), b"far-job", headers={"Nats-Msg-Id": "far"})

        # Until the leaf's link to the hub is up, JetStream requests through it get no answer.
        worker = await connect_when_ready([leaf.url])
        try:
            wjs = worker.jetstream(timeout=10)
            consumer = await ensure_job_consumer(wjs, names, "exact", 0, R3)
            sub = await wjs.pull_subscribe_bind(consumer, stream=names.jobs_stream)
            # A new R3 consumer answers 503 until its leader is elected: the first fetch may need a retry.
            [job] = await wait_until(
                lambda: sub.fetch(1, timeout=10), 30, what="the first fetch", interval=0.2, retry_errors=True
            )
            assert job.data == b"far-job"
            await wjs.publish(names.result_subject("trainer-0", "far", "job1", "far-worker"), b"far-result")
            await job.ack_sync()
            # KV traffic crosses too (registry entries), through the leaf's domain mapping.
            fleet = await wjs.key_value(names.fleet_bucket)
            await fleet.put(names.replica_key("far-worker"), b"{}")
        finally:
            await worker.close()

        far = names.result_subject("trainer-0", "far", "job1", "far-worker")
        got = await tjs.get_last_msg(names.results_stream, far)
        assert got.data == b"far-result"
        entry = await (await tjs.key_value(names.fleet_bucket)).get(names.replica_key("far-worker"))
        assert entry.value == b"{}"
    except BaseException:
        print(leaf.log_tail())
        raise
    finally:
        await trainer.close()


async def test_leaf_rollfleet_round_trip(cluster: LocalCluster, leaf: NatsProcess, ns: str, tmp_path: Path) -> None:
    """The real worker process in the remote region (leaf only) serves a client in the hub."""
    from rollfleet.schemas import RolloutPayload, SamplingParams
    from rollfleet.trainer_client import RolloutClient

    nc = await connect_when_ready([leaf.url])  # the leaf's link to the hub is up
    await nc.close()
    declared = await asyncio.to_thread(run_cli, "declare", "--nats", cluster.url, "--namespace", ns, "--replicas", "3")
    assert declared.returncode == 0, declared.stderr + declared.stdout
    worker = start_worker_process(leaf.url, ns, "w-deploy", *ECHO_V0, log_path=tmp_path / "worker.log")
    try:
        async with await RolloutClient.connect(cluster.url, namespace=ns, client_id="trainer-0") as client:
            payload = RolloutPayload(prompt_token_ids=[4, 5, 6], sampling=SamplingParams(max_tokens=2))

            async def round_trip() -> Any:
                return await asyncio.wait_for(await client.submit(payload, min_version=0), 10)

            result = await wait_until(
                round_trip, 25, what="a round trip through the leaf node", interval=0.5, retry_errors=True
            )
            assert result.version_start == 0 and result.outputs
    except BaseException:
        print((tmp_path / "worker.log").read_text(errors="replace")[-4000:])
        print(leaf.log_tail())
        raise
    finally:
        code = terminate(worker, 15)
    assert code == 0, f"worker exit code {code} after SIGTERM"


async def test_cluster_rollfleet_round_trip(cluster: LocalCluster, ns: str, tmp_path: Path) -> None:
    """The real pieces: `rollfleet declare --replicas 3`, a worker process on one node, a client on another."""
    from rollfleet.schemas import RolloutPayload, SamplingParams
    from rollfleet.trainer_client import RolloutClient

    nc = await connect_when_ready(cluster.urls)  # the meta leader is elected before the CLI runs
    await nc.close()
    declared = await asyncio.to_thread(run_cli, "declare", "--nats", cluster.url, "--namespace", ns, "--replicas", "3")
    assert declared.returncode == 0, declared.stderr + declared.stdout

    worker = start_worker_process(cluster.nodes["c"].url, ns, "w-deploy", *ECHO_V0, log_path=tmp_path / "worker.log")
    try:
        async with await RolloutClient.connect(
            cluster.nodes["a"].url + "," + cluster.nodes["b"].url, namespace=ns, client_id="trainer-0"
        ) as client:
            payload = RolloutPayload(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))

            async def round_trip() -> Any:
                handle = await client.submit(payload, min_version=0)
                return await asyncio.wait_for(handle, 10)

            # The first submit can fail fast (retryably) until the worker has registered.
            result = await wait_until(
                round_trip, 25, what="a round trip through the cluster", interval=0.5, retry_errors=True
            )
        assert result.version_start == 0 and result.version_end == 0
        assert result.worker_id
        assert result.outputs

        nc = await connect_when_ready(cluster.urls)
        try:
            info = await nc.jetstream().stream_info(Names(ns).jobs_stream)
            assert info.config.num_replicas == 3
        finally:
            await nc.close()
    except BaseException:
        print((tmp_path / "worker.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        code = terminate(worker, 15)
    assert code == 0, f"worker exit code {code} after SIGTERM"


async def test_r3_streams_survive_losing_the_leader(cluster: LocalCluster, ns: str) -> None:
    """Stop the node leading the jobs stream: a stored job is still served, new jobs still stored.

    The node is restarted from its config and store afterwards and catches up, so the module's
    cluster is whole again for any later test.
    """
    names = Names(ns)
    victim: str | None = None
    nc = await connect_when_ready(cluster.urls)
    try:
        js = nc.jetstream(timeout=10)
        await wait_until(lambda: declared(js, names, R3), 20, what="declaring", interval=0.2, retry_errors=True)
        await js.publish(names.job_subject("min", 0), b"before", headers={"Nats-Msg-Id": "before"})
        leader_name = (await js.stream_info(names.jobs_stream)).cluster.leader  # type: ignore[union-attr]
        victim = next(key for key in cluster.nodes if f"rf-node-{key}" == leader_name)
        survivors = [node.url for key, node in cluster.nodes.items() if key != victim]
        cluster.nodes[victim].stop()
        await nc.close()

        nc = await connect_when_ready(survivors)
        js = nc.jetstream(timeout=5)

        async def new_leader() -> bool:
            info = await js.stream_info(names.jobs_stream)
            return info.cluster is not None and info.cluster.leader not in (None, leader_name)

        await wait_until(new_leader, 20, what="a new jobs-stream leader", interval=0.2, retry_errors=True)
        # Duplicate detection survived the failover too: the same key is still a duplicate.
        again = await js.publish(names.job_subject("min", 0), b"before", headers={"Nats-Msg-Id": "before"})
        assert again.duplicate
        await js.publish(names.job_subject("min", 0), b"after", headers={"Nats-Msg-Id": "after"})
        consumer = await ensure_job_consumer(js, names, "min", 0, R3)
        sub = await js.pull_subscribe_bind(consumer, stream=names.jobs_stream)
        # The new R3 consumer answers pulls once its own leader is elected (503 until then).
        jobs: list[Any] = []

        async def pulled() -> bool:
            jobs.extend(await sub.fetch(2 - len(jobs), timeout=2))
            return len(jobs) == 2

        await wait_until(pulled, 20, what="both jobs pulled from the new R3 consumer", interval=0.2, retry_errors=True)
        assert sorted(m.data for m in jobs) == [b"after", b"before"]
        for m in jobs:
            await m.ack_sync()
    finally:
        await nc.close()
        if victim is not None:
            node = cluster.nodes[victim]
            if node.proc is None or node.proc.poll() is not None:
                node.start()
                node.wait_listening()
