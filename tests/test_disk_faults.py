"""A worker whose disk fails under it: real OS faults on a real ``rollfleet worker`` process.

RLIMIT_FSIZE set on the running process (``prlimit --pid``; CPython ignores SIGXFSZ) makes every
write that grows a file fail with EFBIG, as a full disk fails it with ENOSPC: the marker of a
version being materialized, the staging copy of a reseed, and every line of the worker's log
file. A read-only bind mount of its --local-dir makes every write there fail with EROFS (root
ignores ``chmod -w``; needs mount privilege, skipped without). The promise: the replica keeps
serving the version it has, says ``degraded`` with a typed reason, trusts no half-written
version, and reaches the latest version once the disk is back (the backoff of
``workers/following.py``).
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from policy_helpers import make_checkpoint

from harness import start_worker_process, terminate, wait_until
from reliability.adversary.disks import can_mount, disk_verdict, mount_readonly, unmount
from rollfleet.policy_store.local_disk import as_local_disk_error, is_local_disk_failure
from rollfleet.policy_store.materialize import STAGING, materialize, read_marker
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests.helpers import payload

needs_prlimit = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")


def fsize(pid: int, limit: str) -> None:
    """Lower (or lift) the soft RLIMIT_FSIZE of a running process; the hard limit stays unlimited,
    so lifting it again needs no privilege."""
    subprocess.run(["prlimit", "--pid", str(pid), f"--fsize={limit}:unlimited"], check=True)


def bump(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for t in tensors.values():
        t.view(-1)[:3] += torch.tensor(1, dtype=t.dtype)
    return tensors


class Disk:
    """One real fault on a worker's disk: ``full`` (RLIMIT_FSIZE 0 on its process: its log file
    cannot grow either) or ``readonly`` (its --local-dir bind-mounted read-only: EROFS)."""

    def __init__(self, kind: str, local: Path) -> None:
        self.kind, self.local, self.pid = kind, local, 0

    def fail(self, pid: int) -> None:
        self.pid = pid
        if self.kind == "full":
            fsize(pid, "0")
        else:
            mount_readonly(self.local)

    def heal(self) -> None:
        if self.kind == "full":
            fsize(self.pid, "unlimited")
        else:
            unmount(self.local)


KINDS = [
    pytest.param("full", marks=needs_prlimit),
    pytest.param("readonly", marks=pytest.mark.skipif(not can_mount(), reason="needs mount privilege")),
]


def start_worker(nats_url: str, namespace: str, store: Path, local: Path, log: Path) -> subprocess.Popen[bytes]:
    return start_worker_process(
        nats_url, namespace, "w1", "--engine", "echo", "--store", str(store), "--local-dir", str(local), log_path=log
    )


@pytest.mark.parametrize("kind", KINDS)
async def test_a_worker_whose_disk_fails_during_a_publish_keeps_serving_then_catches_up(
    nats_url: str, namespace: str, tmp_path: Path, kind: str
) -> None:
    t = make_checkpoint(tmp_path / "base")
    store, local, log = tmp_path / "store", tmp_path / "local", tmp_path / "w1.log"
    publisher = PolicyPublisher(store, tmp_path / "base", keyframe_every=6)  # v1: a delta, applied in place
    disk = Disk(kind, local)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, t)
        proc = start_worker(nats_url, namespace, store, local, log)
        healed = False
        try:

            def state() -> str | None:
                assert proc.poll() is None, f"the worker exited with {proc.returncode}: {log.read_text()[-2000:]}"
                entries = client.fleet.replicas()
                return entries[0].state if entries else None

            await wait_until(lambda: state() == "ready", timeout=30)
            disk.fail(proc.pid)  # full: no file of the worker's may grow from now on, its log file neither
            size_before = log.stat().st_size
            await client.publish_policy(publisher, bump(t))  # v1, committed while the disk fails
            await wait_until(lambda: state() == "degraded", timeout=15)
            [entry] = client.fleet.replicas()
            assert entry.active_version == 0
            # Typed: the registry names the error's code, not the OS's words.
            assert "local_disk_error" in (entry.degraded_reason or ""), entry.degraded_reason
            assert read_marker(local) in (None, 0)  # never a marker naming v1 over bytes it does not hold
            result = await (await client.submit(payload(), max_staleness=5)).result(10)
            assert result.version_start == 0 and result.worker_id == "w1"  # still serving what it has
            if kind == "full":
                assert log.stat().st_size == size_before  # (its log could not grow either: the fault was real)

            disk.heal()  # the disk is back: the retry after the backoff succeeds
            healed = True
            await wait_until(lambda: state() == "ready" and client.fleet.replicas()[0].active_version == 1, 20)
            assert read_marker(local) == 1
            result = await (await client.submit(payload(), exact_version=1)).result(10)
            assert result.version_start == 1 and result.worker_id == "w1"
            if kind == "full":
                assert "log lines dropped" in log.read_text()  # it says what it could not write, once it can
        finally:
            if not healed and disk.pid:
                disk.heal()
            terminate(proc, 10.0)


@pytest.mark.skipif(not can_mount(), reason="needs mount privilege")
async def test_a_worker_started_on_a_read_only_disk_serves_the_version_on_it(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A replica restarted while its disk is read-only (remounted so after I/O errors) serves the
    version its local checkpoint holds, degraded, instead of exiting: before the fix it could not
    even take the checkpoint's lock (opened for writing), and exited ``NoServableVersion``."""
    t = make_checkpoint(tmp_path / "base")
    store, local, log = tmp_path / "store", tmp_path / "local", tmp_path / "w1.log"
    publisher = PolicyPublisher(store, tmp_path / "base", keyframe_every=6)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, t)
        proc = start_worker(nats_url, namespace, store, local, log)
        await wait_until(lambda: any(r.state == "ready" for r in client.fleet.replicas()), timeout=30)
        terminate(proc, 10.0)  # v0 on its disk
        await client.publish_policy(publisher, bump(t))  # v1, committed while it is down
        mount_readonly(local)
        mounted = True
        proc = start_worker(nats_url, namespace, store, local, log)
        try:

            def entry() -> Any:
                assert proc.poll() is None, f"the worker exited with {proc.returncode}: {log.read_text()[-1500:]}"
                live = [r for r in client.fleet.replicas() if r.pid == proc.pid]
                return live[0] if live else None

            await wait_until(lambda: (e := entry()) is not None and e.state in ("ready", "degraded"), timeout=30)
            e = entry()
            assert e.state == "degraded" and e.active_version == 0, e
            result = await (await client.submit(payload(), exact_version=0)).result(10)
            assert result.version_start == 0 and result.worker_id == "w1"
            unmount(local)
            mounted = False
            await wait_until(lambda: (e := entry()) is not None and e.state == "ready" and e.active_version == 1, 20)
        finally:
            if mounted:
                unmount(local)
            terminate(proc, 10.0)


def test_a_log_line_the_disk_refuses_is_dropped_counted_and_said_later(tmp_path: Path) -> None:
    """A process whose log file cannot grow (RLIMIT_FSIZE, a real EFBIG) logs on without raising;
    once it can write again, its first line says how many were dropped."""
    code = """
import resource
from rollfleet.runtime.logs import configure, get_logger
configure("info", json=True)
log = get_logger("t")
log.info("before")
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
for i in range(3):
    log.info("while full", i=i)  # raised OSError into the caller before the fix
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
log.info("after")
"""
    out = tmp_path / "p.log"
    with open(out, "ab") as f:
        done = subprocess.run([sys.executable, "-c", code], stderr=f, stdout=f, timeout=30)
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert done.returncode == 0, events
    assert [e["event"] for e in events] == ["before", "log lines dropped", "after"]
    assert events[1]["count"] == 3


def test_which_errors_are_the_local_disk_refusing_a_write() -> None:
    root = "/data/local"
    assert is_local_disk_failure(errno.ENOSPC, None, root)  # (a failed write() names no file)
    assert is_local_disk_failure(errno.EFBIG, None, root)
    assert is_local_disk_failure(errno.EROFS, "/data/local/.rollfleet.lock", root)
    assert is_local_disk_failure(errno.EACCES, "/data/local/model.safetensors", root)
    assert is_local_disk_failure(errno.EPERM, "/data/local", root)
    assert not is_local_disk_failure(errno.EACCES, "/store/weight_v000001/model.safetensors", root)  # the store's
    assert not is_local_disk_failure(errno.EACCES, "/data/local-other/x", root)
    assert not is_local_disk_failure(errno.EACCES, None, root)
    assert not is_local_disk_failure(errno.ENOENT, "/data/local/x", root)
    assert not is_local_disk_failure(errno.EIO, None, root)  # (a read of the store may fail so too)
    typed = as_local_disk_error(OSError(errno.EROFS, "Read-only file system", "/x/.lock"), "/x")
    assert typed is not None and typed.retryable and typed.code == "local_disk_error"
    assert typed.errno_name == "EROFS" and typed.path == "/x/.lock"
    assert as_local_disk_error(OSError(errno.ENOENT, "No such file", "/x/y"), "/x") is None


def test_the_converged_rule_for_a_disk_fault() -> None:
    fault = {"kind": "disk_full", "worker": "w1", "start": 0.0, "from": 100.0, "to": 105.0}
    quiet: dict[str, list[tuple[float, float]]] = {"disturbed": [], "damaged": []}
    seen = [(104.0, 3), (110.0, 3), (112.0, 4)]
    assert disk_verdict(fault, (0.0, None), seen, 4, horizon=200.0, **quiet)[0] == "ok"
    stuck = [(104.0, 3), (110.0, 3), (124.5, 3)]  # heard at v3 near the bound: behind
    verdict, why = disk_verdict(fault, (0.0, None), stuck, 4, horizon=200.0, **quiet)
    assert verdict == "violation" and "still at v3" in why and "v4" in why
    assert disk_verdict(fault, (0.0, None), stuck[:2], 4, horizon=200.0, **quiet)[0] == "unverified"  # unheard
    assert disk_verdict(fault, (0.0, 115.0), stuck, 4, horizon=200.0, **quiet)[0] == "unverified"  # it ended
    assert disk_verdict(fault, (0.0, 115.0), seen, 4, horizon=113.0, **quiet)[0] == "ok"  # caught up, then ended
    assert disk_verdict(fault, (0.0, None), stuck, 4, horizon=120.0, **quiet)[0] == "unverified"  # the run did
    for windows in ({"disturbed": [(108.0, 111.0)], "damaged": []}, {"disturbed": [], "damaged": [(60.0, 62.0)]}):
        assert disk_verdict(fault, (0.0, None), stuck, 4, horizon=200.0, **windows)[0] == "unverified"
    old = {"disturbed": [], "damaged": [(10.0, 20.0)]}  # a store fault long before: its backoff is over
    assert disk_verdict(fault, (0.0, None), stuck, 4, horizon=200.0, **old)[0] == "violation"


@pytest.mark.skipif(not can_mount(), reason="needs mount privilege")
def test_a_seed_onto_a_read_only_disk_with_a_leftover_staging_copy_says_the_disk_refused(tmp_path: Path) -> None:
    """A staging copy an interrupted seed left behind cannot be removed from a read-only disk: the
    seed fails with that refusal (typed as the local disk's), not with "File exists" from making
    the staging directory again (untyped: the replica could not say its disk was at fault)."""
    t = make_checkpoint(tmp_path / "base")
    store, local = tmp_path / "store", tmp_path / "local"
    PolicyPublisher(store, tmp_path / "base").publish(t)
    (local / STAGING).mkdir(parents=True)
    (local / STAGING / "model.safetensors").write_bytes(b"half a copy")
    mount_readonly(local / STAGING)  # (the rest of the disk, its lock file among it, stays writable)
    try:
        with pytest.raises(OSError) as caught:
            materialize(local, store, 0)
    finally:
        unmount(local / STAGING)
    typed = as_local_disk_error(caught.value, str(local))
    assert typed is not None and typed.errno_name == "EROFS", caught.value
    assert materialize(local, store, 0).version == 0  # the disk back: the leftover is replaced
    assert not (local / STAGING).exists() and read_marker(local) == 0
