"""Version commits, adoption, staleness, waiting for the fleet, and failed prepares."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from harness import running_worker, start_worker_process, terminate, wait_until
from rollfleet.models import build_model_dir
from rollfleet.policy_store import list_versions
from rollfleet.schemas.errors import HostileName, ServiceUnavailable, VersionConflict
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests.helpers import payload


def bump(tensors: dict[str, torch.Tensor], k: int = 3) -> dict[str, torch.Tensor]:
    for t in tensors.values():
        t.view(-1)[:k] += torch.tensor(0.5, dtype=t.dtype)
    return tensors


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return build_model_dir(tmp_path / "base", preset="tiny")


def tensors_of(base: Path) -> dict[str, torch.Tensor]:
    return load_file(str(base / "model.safetensors"))


async def test_two_publishers_cannot_both_commit_a_version(
    nats_url: str, namespace: str, tmp_path: Path, base: Path
) -> None:
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        a = PolicyPublisher(tmp_path / "store-a", base)
        b = PolicyPublisher(tmp_path / "store-b", base)
        t = tensors_of(base)
        await client.publish_policy(a, t)
        with pytest.raises(VersionConflict):
            await client.publish_policy(b, t)  # version 0 again
        committed = await client.publish_policy(a, bump(t))
        assert client.latest_version == 1
        record_b = b.publish(t)  # b's own version 1 (written, not committed)
        with pytest.raises(VersionConflict):
            await client.commit_version(record_b)
        assert await client.fleet.version_record(1) == committed  # a's version 1 stands


async def test_adopting_a_version_written_elsewhere(nats_url: str, namespace: str, tmp_path: Path, base: Path) -> None:
    store = tmp_path / "store"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        ours = PolicyPublisher(store, base)
        t = tensors_of(base)
        await client.publish_policy(ours, t)
        # Another publisher (think: miles' disk-delta writer) produced version 1 in its own place.
        foreign = PolicyPublisher(tmp_path / "elsewhere", base)
        foreign.publish(t)
        foreign.publish(bump(t))
        src = tmp_path / "elsewhere" / "weight_v000001"
        with pytest.raises(HostileName):
            await client.adopt_version(store, src)  # must be handed over into the store first
        shutil.copytree(src, store / "weight_v000001")
        async with running_worker(nats_url, namespace, store_dir=store, local_dir=tmp_path / "local") as worker:
            record = await client.adopt_version(store, store / "weight_v000001")
            assert record.version == 1 and record.base_version == 0
            await client.wait_for_version(1, timeout=20)
            # Announced first, served a moment later: the worker takes v1 jobs only once it said so.
            await wait_until(lambda: worker.version == 1, 5)
            assert worker.sync is not None
            assert worker.sync.activations[-1].changed_tensors == len(t)


async def test_max_staleness_and_reported_staleness(nats_url: str, namespace: str, tmp_path: Path, base: Path) -> None:
    store = tmp_path / "store"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        publisher = PolicyPublisher(store, base)
        t = tensors_of(base)
        await client.publish_policy(publisher, t)
        for _ in range(3):
            await client.publish_policy(publisher, bump(t))
        async with running_worker(nats_url, namespace, store_dir=store, local_dir=tmp_path / "l") as worker:
            assert worker.version == 3  # caught up before serving
            handle = await client.submit(payload(), max_staleness=1)
            assert handle.job.constraint.kind == "min" and handle.job.constraint.version == 2
            result = await handle.result(10)
            assert result.version_start == 3 and result.staleness == 0
            await client.publish_policy(publisher, bump(t))
            await client.wait_for_version(4, timeout=20)
            stale = await client.submit(payload(), min_version=0)
            assert (await stale.result(10)).staleness == 0
            with pytest.raises(ServiceUnavailable, match="did not reach version 9"):
                await client.wait_for_version(9, fraction=0.5, timeout=1.5)


async def test_failed_prepare_degrades_then_the_next_good_version_activates(
    nats_url: str, namespace: str, tmp_path: Path, base: Path
) -> None:
    store = tmp_path / "store"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        publisher = PolicyPublisher(store, base, keyframe_every=2)
        t = tensors_of(base)
        await client.publish_policy(publisher, t)
        async with running_worker(nats_url, namespace, store_dir=store, local_dir=tmp_path / "l") as worker:
            record = publisher.publish(bump(t))
            shard = next((store / record.path).glob("*.safetensors"))
            data = bytearray(shard.read_bytes())
            data[-5] ^= 0xFF  # a flipped byte inside the last frame
            shard.write_bytes(bytes(data))
            await client.commit_version(record)

            def degraded() -> bool:
                return any(r.state == "degraded" for r in client.fleet.replicas())

            await wait_until(degraded, timeout=20)
            [entry] = client.fleet.replicas()
            assert entry.active_version == 0 and "version 1" in (entry.degraded_reason or "")
            # Still serving version 0 meanwhile.
            assert (await (await client.submit(payload(), exact_version=0)).result(10)).version_start == 0
            good = await client.publish_policy(publisher, bump(t))  # a keyframe: reachable without v1
            assert good.kind == "full"
            await client.wait_for_version(2, timeout=20)
            await wait_until(lambda: worker.version == 2, 5)
            assert client.fleet.replicas()[0].state == "ready"
    assert list_versions(store)[-1] == 2


async def test_a_version_that_failed_is_tried_again_without_a_new_commit(
    nats_url: str, namespace: str, tmp_path: Path, base: Path
) -> None:
    """A failure can be transient (a shard caught mid-rewrite): the replica tries the failed
    version again after a backoff, and activates it once its bytes are whole, although the
    trainer commits nothing newer (it may have stopped publishing)."""
    store = tmp_path / "store"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        publisher = PolicyPublisher(store, base)
        t = tensors_of(base)
        await client.publish_policy(publisher, t)
        async with running_worker(nats_url, namespace, store_dir=store, local_dir=tmp_path / "l") as worker:
            record = publisher.publish(bump(t))
            shard = next((store / record.path).glob("*.safetensors"))
            whole = shard.read_bytes()
            data = bytearray(whole)
            data[-5] ^= 0xFF
            shard.write_bytes(bytes(data))
            await client.commit_version(record)
            await wait_until(lambda: any(r.state == "degraded" for r in client.fleet.replicas()), timeout=20)
            assert worker.version == 0
            shard.write_bytes(whole)  # the shard is whole again; no newer version is committed
            await wait_until(lambda: worker.version == 1, 30, what="the failed version retried and activated")
            await wait_until(lambda: client.fleet.replicas()[0].state == "ready", 10)
            assert (await (await client.submit(payload(), exact_version=1)).result(10)).version_start == 1
    assert list_versions(store)[-1] == 1


async def test_a_replica_whose_newest_version_fails_serves_the_newest_one_below_it_meanwhile(
    nats_url: str, namespace: str, tmp_path: Path, base: Path
) -> None:
    """The newest commit failed here (its bytes corrupt, and it stays so): the replica does not
    wait at its old version for the newest's retry, it moves meanwhile to the newest committed
    version below it that does materialize (seed 366222: three replicas stayed at v13 for 19.5 s
    while v19 and v20 were whole and v21 to v23 were hidden, broken or corrupt)."""
    store = tmp_path / "store"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        publisher = PolicyPublisher(store, base)
        t = tensors_of(base)
        await client.publish_policy(publisher, t)
        async with running_worker(nats_url, namespace, store_dir=store, local_dir=tmp_path / "l") as worker:

            def corrupt(record: Any) -> tuple[Path, bytes]:
                shard = next((store / record.path).glob("*.safetensors"))
                whole = shard.read_bytes()
                shard.write_bytes(whole[:-5] + bytes(b ^ 0xFF for b in whole[-5:]))
                return shard, whole

            v1 = publisher.publish(bump(t))
            shard1, whole1 = corrupt(v1)
            await client.commit_version(v1)
            await wait_until(lambda: any(r.state == "degraded" for r in client.fleet.replicas()), timeout=20)
            shard1.write_bytes(whole1)  # version 1 is whole again...
            v2 = publisher.publish(bump(t))
            corrupt(v2)  # ...and version 2, the newest, is corrupt for good
            await client.commit_version(v2)
            await wait_until(lambda: worker.version == 1, 30, what="the newest version below the failed one")
            assert (await (await client.submit(payload(), exact_version=1)).result(10)).version_start == 1
            [entry] = client.fleet.replicas()
            assert entry.active_version == 1


async def test_record_base_commits_version_zero_without_tensors(
    nats_url: str, namespace: str, tmp_path: Path, base: Path
) -> None:
    publisher = PolicyPublisher(tmp_path / "store", base)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        record = publisher.record_base()
        await client.commit_version(record)
        assert record.version == 0 and record.kind == "base" and client.latest_version == 0
        with pytest.raises(VersionConflict):
            publisher.record_base()
        # Publishing continues from the recorded base.
        assert (await client.publish_policy(publisher, bump(tensors_of(base)))).version == 1


async def test_a_prepare_stuck_in_a_read_degrades_and_sigterm_still_stops_the_worker(
    nats_url: str, namespace: str, tmp_path: Path, base: Path
) -> None:
    """A read that never returns (here a pre-read hook that hangs, as on a wedged mount) is bounded:
    the replica turns degraded, keeps serving its version, and SIGTERM still ends the process."""
    store = tmp_path / "store"
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        publisher = PolicyPublisher(store, base)
        t = tensors_of(base)
        await client.publish_policy(publisher, t)
        proc = start_worker_process(
            nats_url,
            namespace,
            "stuck-0",
            "--store",
            str(store),
            "--local-dir",
            str(tmp_path / "local"),
            "--pre-read-hook",
            "policy_helpers:stuck_read_hook",
            "--prepare-timeout",
            "8",  # version 0's own catch-up has taken about 2 s on a busy machine
            log_path=tmp_path / "worker.log",
            env=env,
        )
        try:
            await wait_until(lambda: any(r.state == "ready" for r in client.fleet.replicas()), timeout=30)
            await client.publish_policy(publisher, bump(t))

            def degraded() -> bool:
                return any(r.state == "degraded" for r in client.fleet.replicas())

            await wait_until(degraded, timeout=30)
            [entry] = client.fleet.replicas()
            assert entry.active_version == 0 and "prepare_timeout" in (entry.degraded_reason or "")
            assert (await (await client.submit(payload(), exact_version=0)).result(10)).version_start == 0
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 30) == 0
        finally:
            terminate(proc)


async def test_a_worker_started_while_its_reads_hang_waits_then_serves_what_it_can_read(
    nats_url: str, namespace: str, tmp_path: Path, base: Path
) -> None:
    """A replica started while the store's reads hang (a wedged or very slow mount) waits,
    ``starting`` and saying why, instead of exiting: once an older committed version can be read
    it serves that one, ``degraded``, while the latest's read still hangs, and it moves to the
    latest once that read returns. Before the fix, the first prepare past its bound refused every
    other version ("an earlier prepare is still stuck") and the worker exited 2."""
    store, gates = tmp_path / "store", tmp_path / "gates"
    gates.mkdir()
    tests_dir = str(Path(__file__).parent)
    env = {
        "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
        "RF_TEST_READ_GATES": str(gates),
    }
    log = tmp_path / "worker.log"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        publisher = PolicyPublisher(store, base)
        t = tensors_of(base)
        await client.publish_policy(publisher, t)
        await client.publish_policy(publisher, bump(t))  # v1: the latest when the worker starts
        proc = start_worker_process(
            nats_url,
            namespace,
            "gated-0",
            "--store",
            str(store),
            "--local-dir",
            str(tmp_path / "local"),
            "--pre-read-hook",
            "read_gates:gated_read",
            "--prepare-timeout",
            "1",  # (past it, a prepare is waited for, not fatal: a busy machine cannot fail this)
            log_path=log,
            env=env,
        )

        def entry() -> Any:
            assert proc.poll() is None, f"the worker exited with {proc.returncode}: {log.read_text()[-1500:]}"
            live = [r for r in client.fleet.replicas() if r.pid == proc.pid]
            return live[0] if live else None

        try:
            # Both versions' reads hang: it waits for them, saying so, and serves nothing yet.
            await wait_until(lambda: "version 0" in (((e := entry()) and e.degraded_reason) or ""), timeout=40)
            waiting = entry()
            assert waiting.state == "starting" and "version 1" in (waiting.degraded_reason or ""), waiting
            (gates / "0").touch()  # v0 can be read again; v1's read still hangs
            await wait_until(lambda: (e := entry()) is not None and e.state not in ("starting",), timeout=30)
            serving = entry()
            assert serving.state == "degraded" and serving.active_version == 0, serving
            assert "version 1" in (serving.degraded_reason or ""), serving
            result = await (await client.submit(payload(), exact_version=0)).result(10)
            assert result.version_start == 0 and result.worker_id == "gated-0"
            (gates / "1").touch()  # the latest's read returns: it follows to the latest
            await wait_until(lambda: (e := entry()) is not None and e.state == "ready" and e.active_version == 1, 40)
            result = await (await client.submit(payload(), exact_version=1)).result(10)
            assert result.version_start == 1 and result.worker_id == "gated-0"
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 30) == 0
        finally:
            for n in ("0", "1"):
                (gates / n).touch()  # (no reader thread left waiting)
            terminate(proc)
