"""A worker still waiting for a first policy commit stops at once on SIGTERM.

`docker compose up` starts workers before any trainer has committed a version; `down` or a
scale-down then sends SIGTERM, which must not wait out the catch-up time (or the container's
grace period, after which it is killed and leaves a stale registry entry).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import nats
import nats.js.errors

from rollfleet.broker.kv import read_replicas
from rollfleet.schemas import Names
from tests.helpers import eventually, worker_process


async def test_sigterm_during_catch_up_wait_stops_the_worker(nats_url: str, namespace: str, tmp_path: Path) -> None:
    store = tmp_path / "store"  # empty: no version committed, so the worker waits
    store.mkdir()
    log = tmp_path / "worker.log"
    args = ["--store", str(store), "--local-dir", str(tmp_path / "local"), "--catch-up-wait", "600"]
    proc = worker_process(nats_url, namespace, "waiter", *args, log_path=log)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()

        async def registered_and_waiting() -> bool:
            try:  # the worker declares the namespace first
                replicas = await read_replicas(await js.key_value(Names(namespace).fleet_bucket))
            except nats.js.errors.BucketNotFoundError:
                return False
            return "waiter" in replicas and replicas["waiter"].state == "starting"

        await eventually(registered_and_waiting, timeout=30)
        kv = await js.key_value(Names(namespace).fleet_bucket)
        time.sleep(1.0)  # well inside the catch-up wait
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError("SIGTERM did not stop a worker waiting for its first version") from None
        assert code == 0, log.read_text()[-2000:]
        assert time.monotonic() - t0 < 10
        assert "waiter" not in await read_replicas(kv), "the stopped worker left its registry entry"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await nc.close()
