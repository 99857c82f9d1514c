"""A replica's liveness, as a client judges it, does not depend on the replica's clock agreeing
with the client's: a heartbeat heard as it is written counts from the client's own clock.

Registry entries are written into the real fleet bucket of a real nats-server as a replica
whose clock is off would write them; one test runs a real worker process under libfaketime
(skipped, saying so, where no libfaketime is found: neither Debian's ``faketime`` package nor the
``libfaketime`` package of the ``test`` extra, whose library is built for x86-64 Linux)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import start_worker_process, terminate, wait_until
from harness.clocks import _working_setting, faketime_library, skewed_environment
from rollfleet.schemas import Names, ReplicaStatus, encode
from rollfleet.trainer_client import RolloutClient
from tests.helpers import payload

HEARTBEAT_S = 0.5  # stale after 1.5 s
FAKETIME_LIB = faketime_library()


STARTED_AT = 1_700_000_000.0  # one process per worker id in these tests


def entry(worker_id: str, skew_s: float, jobs_done: int = 0) -> bytes:
    now = time.time() + skew_s  # what a replica whose clock is skew_s off writes
    return encode(
        ReplicaStatus(
            worker_id=worker_id, state="ready", active_version=0, engine="echo", capacity=4, in_flight=0,
            heartbeat_at=now, heartbeat_interval_s=HEARTBEAT_S, started_at=STARTED_AT, jobs_done=jobs_done,
        )
    )


async def beat(client: RolloutClient, worker_id: str, skew_s: float, for_s: float) -> None:
    kv = await client.js.key_value(client.names.fleet_bucket)
    until = time.monotonic() + for_s
    while time.monotonic() < until:
        await kv.put(Names.REPLICA_PREFIX + worker_id, entry(worker_id, skew_s))
        await asyncio.sleep(HEARTBEAT_S)


def live(client: RolloutClient) -> set[str]:
    return {r.worker_id for r in client.fleet.replicas()}


@pytest.mark.parametrize("skew_s", [-3.0, 30.0])
async def test_a_replica_with_a_skewed_clock_is_live_while_it_beats_and_gone_once_silent(
    nats_url: str, namespace: str, skew_s: float
) -> None:
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        beating = asyncio.ensure_future(beat(client, "skewed", skew_s, 3.0))
        await wait_until(lambda: "skewed" in live(client), 5, what="the replica seen")
        seen = []
        while not beating.done():  # 3 s behind: by its own stamps always past its 1.5 s bound
            seen.append("skewed" in live(client))
            await asyncio.sleep(0.1)
        await beating
        assert all(seen[5:]), seen  # (after its first beats were heard)
        silent = time.monotonic()
        # 30 s ahead: by its own stamps it would look alive for 30 s after its last beat.
        await wait_until(lambda: "skewed" not in live(client), 5, what="the silent replica gone")
        assert time.monotonic() - silent < 3 * HEARTBEAT_S + 1.0


async def test_a_heartbeat_held_up_on_the_way_counts_from_when_it_was_made(nats_url: str, namespace: str) -> None:
    """A partition that heals delivers a replica's held writes late: they say it was alive when
    it wrote them, not now (its stamps, on its clock's offset as measured before)."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await beat(client, "held", 5.0, 2.0)  # a clock 5 s ahead, heard as it writes
        assert "held" in live(client)
        await wait_until(lambda: "held" not in live(client), 5, what="the silent replica gone")
        kv = await client.js.key_value(client.names.fleet_bucket)
        await kv.put(Names.REPLICA_PREFIX + "held", entry("held", 5.0 - 4.0, jobs_done=99))  # made 4 s ago
        await wait_until(lambda: client.fleet.replica("held").jobs_done == 99, 5, what="the held write heard")  # type: ignore[union-attr]
        assert "held" not in live(client)  # it said it was alive 4 s ago, not now


@pytest.mark.skipif(FAKETIME_LIB is None, reason="no libfaketime for this machine (Debian's or the test extra's)")
async def test_a_worker_whose_clock_is_behind_serves_and_is_seen_live(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    env = skewed_environment(str(FAKETIME_LIB), -3.0)
    proc = start_worker_process(nats_url, namespace, "behind", log_path=tmp_path / "w.log", env=env,
                                heartbeat=HEARTBEAT_S)
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
            await wait_until(lambda: "behind" in live(client), 30, what="the worker seen live")
            result = await (await client.submit(payload(), min_version=0, timeout=20)).result(20)
            assert result.worker_id == "behind"
            # Its own stamps lag this clock by 3 s, twice its staleness bound; it stays live.
            assert result.finished_at < time.time() - 2.0
            for _ in range(20):
                assert "behind" in live(client)
                await asyncio.sleep(0.1)
    finally:
        terminate(proc, 20)


@pytest.mark.skipif(FAKETIME_LIB is None, reason="no libfaketime for this machine (Debian's or the test extra's)")
@pytest.mark.parametrize("skew_s", [-1.5, 1.5])
def test_a_skewed_process_reads_a_skewed_wall_clock_and_still_sleeps(skew_s: float) -> None:
    """A skewed child's ``time.time()`` is off by the skew, and its timed sleeps and waits return
    (with its monotonic clock faked too, the vendored library hung every one of them)."""
    code = "import threading, time; t = time.time(); time.sleep(0.2); threading.Event().wait(0.2); print(t)"
    env = {**os.environ, **skewed_environment(str(FAKETIME_LIB), skew_s)}
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr[-2000:]
    assert abs(float(out.stdout) - before - skew_s) < 1.0, (out.stdout, before)


def test_a_preloaded_library_that_does_not_skew_the_clock_is_never_used(tmp_path: Path) -> None:
    """A library the dynamic linker cannot load (or one that leaves the clock alone) is not taken
    for libfaketime: its skewed workers would run on the harness's own clock."""
    not_a_library = tmp_path / "libfaketime.so.1"
    not_a_library.write_bytes(b"\x7fELF not really")
    assert _working_setting(str(not_a_library)) is None
    if FAKETIME_LIB is not None:
        assert _working_setting(FAKETIME_LIB) is not None
