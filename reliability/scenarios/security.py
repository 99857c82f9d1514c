"""Scenario 9: hostile versions never write outside the replica's checkpoint directory; token and
mutual-TLS authentication end to end. (Worker permissions: tests/test_deploy_auth.py.)"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from harness import ProcessGroup, wait_until
from harness.weights import tensors_at, write_base_checkpoint
from reliability.scenarios.common import BROKER_CONFIG, REPO, Figures, job_payload, start_broker
from rollfleet.broker import EmbeddedBroker
from rollfleet.policy_store.store import read_record
from rollfleet.schemas.errors import RollfleetError
from rollfleet.schemas.index import INDEX_FILE
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

HOSTILE = ("shard-path-escape", "tensor-name-escape", "absolute-shard", "symlinked-shard")


def _tree(root: Path, skip: tuple[Path, ...]) -> dict[str, str]:
    """Path -> content hash of every file under ``root`` outside ``skip`` (symlinks by target)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = [n for n in dirnames if not any((d / n).resolve() == s.resolve() for s in skip)]
        for n in filenames:
            p = d / n
            if p.suffix == ".log":
                continue
            if p.is_symlink():
                out[str(p)] = "->" + os.readlink(p)
            else:
                out[str(p)] = hashlib.blake2b(p.read_bytes(), digest_size=8).hexdigest()
    return out


def make_hostile(src: Path, dst: Path, kind: str, outside: Path, version: int) -> None:
    """A copy of a good delta directory, renumbered, whose index or files try to reach outside."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_FILE).read_text())
    index["metadata"].update(version=f"{version:06d}", base_version=f"{version - 1:06d}")
    wmap = index["weight_map"]
    name, shard = next(iter(sorted(wmap.items())))
    if kind == "shard-path-escape":
        wmap[name] = "../../outside/victim.safetensors"
    elif kind == "tensor-name-escape":
        wmap["../../../outside/evil"] = shard
    elif kind == "absolute-shard":
        wmap[name] = str(outside / "victim.safetensors")
    elif kind == "symlinked-shard":
        (dst / shard).unlink()
        (dst / shard).symlink_to(outside / "victim.safetensors")
    (dst / INDEX_FILE).write_text(json.dumps(index))


async def hostile_versions(workdir: Path, kinds: tuple[str, ...] = HOSTILE) -> Figures:
    fig = Figures("9a", "Hostile version paths never write outside the checkpoint dir", {"kinds": len(kinds)})
    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    base = write_base_checkpoint(workdir / "base")
    store, local, outside = workdir / "store", workdir / "local", workdir / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copyfile(base / "model.safetensors", outside / "victim.safetensors")  # a file worth overwriting
    (outside / "notes.txt").write_text("must not change")
    broker = start_broker(workdir)
    procs = ProcessGroup(workdir, cwd=REPO)
    ns = "rel9"
    publisher = PolicyPublisher(store, base, keyframe_every=0, keep_last=None)
    try:
        async with await RolloutClient.connect(broker.url, namespace=ns, client_id="trainer") as client:

            async def publish(version: int, full: bool = False) -> None:
                publisher.keyframe_every = version if full else 0
                record = await asyncio.to_thread(publisher.publish, tensors_at(version))
                await client.commit_version(record)
                fig.versions_published += 1

            await publish(0)
            await publish(1)
            procs.worker(broker.url, ns, "replica", "--store", str(store), "--local-dir", str(local))
            await client.wait_for_version(1, replicas=1, timeout=30)
            version = 1
            for kind in kinds:
                before = _tree(workdir, skip=(local, workdir / "nats", store))
                hostile = version + 1
                make_hostile(store / "weight_v000001", store / f"weight_v{hostile:06d}", kind, outside, hostile)
                # A compromised store: the trainer side commits whatever is there.
                try:
                    record = read_record(store, hostile)
                    record.version, record.path = hostile, f"weight_v{hostile:06d}"
                except RollfleetError:  # the index no longer parses: commit a bare record
                    from rollfleet.schemas import VersionRecord

                    record = VersionRecord(version=hostile, kind="delta", base_version=version)
                await client.commit_version(record)
                fig.faults += 1
                fig.versions_published += 1

                def state() -> tuple[str, int, str]:
                    r = next((r for r in client.fleet.replicas() if r.worker_id == "replica"), None)
                    return (r.state, r.active_version, r.degraded_reason or "") if r else ("gone", -1, "")

                degraded = await wait_until(lambda: state()[0] == "degraded", 20, retry_errors=True, default=False)
                st, active, reason = state()
                fig.notes[f"{kind}: reason"] = reason
                fig.expect(degraded and active == version, f"{kind}: not refused ({st}, v{active}, {reason!r})")
                after = _tree(workdir, skip=(local, workdir / "nats", store))
                changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
                fig.expect(not changed, f"{kind}: files outside the checkpoint dir changed: {changed}")
                links = [p.name for p in local.rglob("*") if p.is_symlink()]
                fig.expect(not links, f"{kind}: symlinks in the local checkpoint: {links}")
                # The next good version (a keyframe) is activated past the hostile one.
                publisher.latest_version = hostile  # the hostile directory took this number
                await publish(hostile + 1, full=True)
                ok = await wait_until(lambda v=hostile + 1: state()[1] >= v, 20, retry_errors=True, default=False)
                fig.expect(ok, f"{kind}: the next good version was not activated")
                fig.versions_activated += int(ok)
                version = hostile + 1
            fig.expect((outside / "notes.txt").read_text() == "must not change", "outside file changed")
    finally:
        procs.close()
        broker.stop()
    fig.seconds = time.monotonic() - t0
    return fig


def _exit_code(proc: Any, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except Exception:  # still running
        return None


async def token_end_to_end(workdir: Path, token: str = "rf-reliability-token-0123456789") -> Figures:
    """nats-server ``--auth TOKEN``: a worker process with ``--token`` serves a client with ``token=``;
    a worker with a wrong token, and a client without one, are refused."""
    fig = Figures("9b", "Token authentication end to end", {})
    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    broker = EmbeddedBroker(
        store_dir=workdir / "nats", log_file=workdir / "nats.log", extra_args=["--auth", token]
    ).start()
    procs = ProcessGroup(workdir, cwd=REPO)
    ns = "rel9b"
    try:
        good = procs.worker(broker.url, ns, "good", "--token", token)
        bad = procs.worker(broker.url, ns, "bad", "--token", "not-the-token")
        async with await RolloutClient.connect(broker.url, namespace=ns, client_id="trainer", token=token) as client:
            ok = await wait_until(lambda: len(client.fleet.replicas()) >= 1, 30, retry_errors=True, default=False)
            fig.expect(ok, f"the worker with the token did not register: {procs.tail('good')}")
            result = await (await client.submit(job_payload(1), min_version=0)).result(20)
            fig.submitted, fig.completed = 1, 1
            fig.expect(result.worker_id == "good", "served by the wrong worker")
            fig.expect({r.worker_id for r in client.fleet.replicas()} == {"good"}, "the bad worker registered")
        # Refused at once: the first connection fails with AuthorizationError, the worker exits 2.
        code = await asyncio.to_thread(_exit_code, bad, 20.0)
        fig.expect(code == 2, f"the worker with a wrong token did not exit with code 2 ({code}): {procs.tail('bad')}")
        fig.notes["worker with a wrong token"] = f"exited with code {code}"
        try:
            anon = await asyncio.wait_for(RolloutClient.connect(broker.url, namespace=ns, client_id="anon"), 3.0)
            await anon.close()
            fig.problems.append("a client without the token connected")
        except RollfleetError as exc:
            fig.notes["client without token"] = exc.code
        except TimeoutError:
            fig.notes["client without token"] = "refused (connect keeps retrying; timed out)"
        fig.expect(good.poll() is None, "the good worker died")
    finally:
        procs.close()
        broker.stop()
    fig.seconds = time.monotonic() - t0
    return fig


async def tls_end_to_end(workdir: Path) -> Figures:
    """broker_config/tls (mutual TLS): a worker process and a client with certificates make a round trip;
    a client without a certificate is refused."""
    from harness import make_dev_certs
    from rollfleet.broker import free_port

    fig = Figures("9c", "Mutual TLS end to end", {})
    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    env = make_dev_certs(BROKER_CONFIG / "tls" / "make-dev-certs.sh", workdir / "tls")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    broker = EmbeddedBroker(
        store_dir=workdir / "nats",
        log_file=workdir / "nats.log",
        config=BROKER_CONFIG / "tls" / "nats-server-tls.conf",
        extra_args=["-m", str(free_port())],
    )
    procs = ProcessGroup(workdir, cwd=REPO)
    try:
        broker.start()
        tls_dir = Path(env["ROLLFLEET_TLS_CA"]).parent
        opts = {
            "tls_ca": env["ROLLFLEET_TLS_CA"],
            "tls_cert": str(tls_dir / "client-cert.pem"),
            "tls_key": str(tls_dir / "client-key.pem"),
        }
        url = broker.url.replace("nats://", "tls://")
        flags = ["--tls-ca", opts["tls_ca"], "--tls-cert", opts["tls_cert"], "--tls-key", opts["tls_key"]]
        procs.worker(url, "rel9c", "tls-worker", *flags)
        async with await RolloutClient.connect(url, namespace="rel9c", client_id="trainer", **opts) as client:
            ok = await wait_until(lambda: len(client.fleet.replicas()) >= 1, 30, retry_errors=True, default=False)
            fig.expect(ok, f"the worker process did not register over TLS: {procs.tail('tls-worker')}")
            result = await (await client.submit(job_payload(1), min_version=0)).result(20)
            fig.submitted, fig.completed = 1, 1
            fig.expect(result.worker_id == "tls-worker", "not served over TLS")
        try:
            c = await asyncio.wait_for(
                RolloutClient.connect(url, namespace="rel9c", client_id="nocert", tls_ca=opts["tls_ca"]), 5.0
            )
            await c.close()
            fig.problems.append("a client without a certificate connected")
        except RollfleetError as exc:
            fig.notes["client without certificate"] = exc.code
        except TimeoutError:
            fig.notes["client without certificate"] = "refused (connect keeps retrying; timed out)"
    finally:
        procs.close()
        broker.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    fig.seconds = time.monotonic() - t0
    return fig
