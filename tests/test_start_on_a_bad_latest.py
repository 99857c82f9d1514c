"""A worker (re)started while the latest committed version cannot be served: it serves the newest
version it can materialize and verify, degraded, and follows the next good commit; it exits, with a
typed error, only when no version can be served."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import torch
import xxhash
from policy_helpers import make_checkpoint

from harness import start_worker_process, terminate, wait_until
from rollfleet.policy_store.digest import weights_digest
from rollfleet.schemas import ReplicaStatus, VersionActivated, decode
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.workers.version_following import fallback_versions
from tests.helpers import payload


def bump(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for t in tensors.values():
        t.view(-1)[:3] += torch.tensor(0.5, dtype=t.dtype)
    return tensors


def digest_of(tensors: dict[str, torch.Tensor]) -> str:
    """The digest of a set of weights, hashed here from their raw bytes (not by the worker's code)."""
    sums = {
        n: xxhash.xxh3_128(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in tensors.items()
    }
    return weights_digest(sums)


def damage(version_dir: Path) -> None:
    """Flip a byte inside every shard (written anew: a shard may be a hard link to the base)."""
    for shard in version_dir.glob("*.safetensors"):
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.unlink()
        shard.write_bytes(bytes(data))


async def announced(client: RolloutClient) -> list[VersionActivated]:
    """Every activation announced so far (at start-up ones included): what each worker loaded."""
    sub = await client.js.pull_subscribe(client.names.versions_activated, stream=client.names.events_stream)
    out: list[VersionActivated] = []
    try:
        while True:
            out += [decode(m.data, VersionActivated) for m in await sub.fetch(100, timeout=0.3)]
    except TimeoutError:
        pass
    await sub.unsubscribe()
    return out


def start_replica(nats_url: str, namespace: str, store: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    return start_worker_process(
        nats_url, namespace, "w1", "--engine", "echo", "--store", str(store),
        "--local-dir", str(tmp_path / "local"), "--verify-live", log_path=tmp_path / "w1.log",
    )  # fmt: skip


async def started_entry(client: RolloutClient, proc: subprocess.Popen[bytes]) -> ReplicaStatus:
    """The one replica's registry entry once it serves (ready or degraded); fails if it exited."""

    def started() -> bool:
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        return any(r.state in ("ready", "degraded") for r in client.fleet.replicas())

    await wait_until(started, timeout=30)
    [entry] = client.fleet.replicas()
    return entry


def test_fallback_versions_are_every_older_committed_version_in_the_store_newest_first() -> None:
    assert fallback_versions([0, 1, 2, 3, 5], 3, committed=[0, 1, 2, 3, 5]) == [2, 1, 0]
    assert fallback_versions([4, 5, 6], 6, committed=range(7)) == [5, 4]  # older ones retired
    assert fallback_versions([0], 0, committed=[0]) == []
    assert fallback_versions([0, 1, 2], 3, committed=[0, 1]) == [1, 0]  # v2 never committed


async def test_a_worker_started_on_a_corrupt_latest_serves_the_last_good_version_degraded(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    t = make_checkpoint(tmp_path / "base")  # the echo engine serves any weights: no model to build
    store = tmp_path / "store"
    publisher = PolicyPublisher(store, tmp_path / "base", keyframe_every=3)  # 1, 2: deltas; 3: full
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, t)
        await client.publish_policy(publisher, bump(t))
        v1 = digest_of(t)
        record = publisher.publish(bump(t))
        v2 = digest_of(t)
        damage(store / record.path)
        await client.commit_version(record)  # the latest commit is corrupt
        proc = start_replica(nats_url, namespace, store, tmp_path)
        try:
            entry = await started_entry(client, proc)
            assert entry.state == "degraded" and entry.active_version == 1
            assert "version 2" in (entry.degraded_reason or "")
            [at_start] = [a for a in await announced(client) if a.at_start]
            assert at_start.version == 1 and at_start.weights_digest == v1 != v2  # v1's bytes, loaded
            result = await (await client.submit(payload(), exact_version=1)).result(10)
            assert result.version_start == 1 and result.worker_id == "w1"

            await client.publish_policy(publisher, bump(t))  # v3, good (and full: reachable without v2)
            v3 = digest_of(t)
            await client.wait_for_version(3, timeout=30)
            await wait_until(lambda: client.fleet.replicas()[0].state == "ready", timeout=10)
            assert client.fleet.replicas()[0].degraded_reason is None
            [moved] = [a for a in await announced(client) if a.version == 3]
            assert moved.previous_version == 1 and moved.weights_digest == v3
        finally:
            terminate(proc, 10.0)


async def test_a_worker_never_falls_back_to_a_version_that_was_never_committed(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """Campaign seed 8 (``--cluster``) replayed: a publisher killed between creating ``v.<N>`` and
    moving ``latest`` left v2 whole in the store, with its record, but never committed; the
    trainer went on to commit v3, whose directory could not be read when a replica started. The
    replica fell back to the newest directory below v3, v2, and labelled its samples v2: a version
    the fleet never committed. It falls back to v1, the newest committed one."""
    from rollfleet.schemas import Names, encode

    t = make_checkpoint(tmp_path / "base")
    store = tmp_path / "store"
    publisher = PolicyPublisher(store, tmp_path / "base", keyframe_every=10)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, t)  # v0
        await client.publish_policy(publisher, bump(t))  # v1
        v1 = digest_of(t)
        orphan = publisher.publish(bump(t))  # v2, written; its publisher "dies" after v.2's create
        kv = await client.js.key_value(Names(namespace).policy_bucket)
        await kv.create(Names(namespace).version_key(2), encode(orphan))
        record = publisher.publish(bump(t))  # v3, committed by the publisher that went on
        damage(store / record.path)
        await client.commit_version(record)
        proc = start_replica(nats_url, namespace, store, tmp_path)
        try:
            entry = await started_entry(client, proc)
            assert entry.state == "degraded" and entry.active_version == 1, entry
            [at_start] = [a for a in await announced(client) if a.at_start]
            assert at_start.version == 1 and at_start.weights_digest == v1
        finally:
            terminate(proc, 10.0)


async def test_a_worker_that_can_serve_no_version_exits_with_a_typed_error(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    t = make_checkpoint(tmp_path / "base")
    store = tmp_path / "store"
    publisher = PolicyPublisher(store, tmp_path / "base")
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        record = await client.publish_policy(publisher, t)
        damage(store / record.path)  # the only version, corrupt
        log = tmp_path / "w1.log"
        proc = start_worker_process(
            nats_url, namespace, "w1", "--engine", "echo", "--store", str(store),
            "--local-dir", str(tmp_path / "local"), log_path=log,
        )  # fmt: skip
        try:
            code = await asyncio.to_thread(proc.wait, 30)
        finally:
            terminate(proc, 5.0)
        assert code == 2
        assert "no committed version at or below 0 can be served" in log.read_text()
