"""The embedded broker: binary checks, start-up, idempotent declaration."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from rollfleet.broker import EmbeddedBroker, check_server_binary, ensure_topology, free_port
from rollfleet.broker.server import wait_for_port
from rollfleet.schemas import Names
from rollfleet.schemas.errors import BrokerBinaryError
from tests.helpers import REPO


def test_wheel_binary_is_found_and_new_enough() -> None:
    binary = check_server_binary()
    assert binary.name.startswith("nats-server")


def test_missing_binary_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BrokerBinaryError, match="not found"):
        check_server_binary(tmp_path / "no-such-nats-server")


def test_too_old_binary_gives_a_clear_error(tmp_path: Path) -> None:
    old = tmp_path / "nats-server"
    old.write_text("#!/bin/sh\necho 'nats-server: v2.9.25'\n")
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(BrokerBinaryError, match=r"2\.9\.25.*>= 2\.11"):
        check_server_binary(old)


async def test_declaring_twice_changes_nothing_and_loses_nothing(broker: EmbeddedBroker) -> None:
    names = Names("twice")
    nc = await nats.connect(broker.url)
    try:
        js = nc.jetstream()
        created = await ensure_topology(js, names)
        assert set(created) == {
            names.jobs_stream,
            names.results_stream,
            names.events_stream,
            names.progress_stream,
            names.policy_bucket,
            names.fleet_bucket,
            names.claims_bucket,
            names.sessions_bucket,
        }
        await js.publish(names.job_subject("min", 0), b"job", headers={"Nats-Msg-Id": "k"})
        kv = await js.key_value(names.policy_bucket)
        await kv.put("latest", b"3")
        before = await js.stream_info(names.jobs_stream)
        assert await ensure_topology(js, names) == []
        after = await js.stream_info(names.jobs_stream)
        assert after.state.messages == 1 and after.config.duplicate_window == before.config.duplicate_window
        assert (await kv.get("latest")).value == b"3"
    finally:
        await nc.close()


def test_broker_command_declares_and_survives_a_restart(tmp_path: Path) -> None:
    port = free_port()
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "rollfleet", "broker", "--store", str(store), "--port", str(port), "-n", "cli"]
    env = {**os.environ, "ROLLFLEET_LOG_JSON": "1"}
    for run in range(2):
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_for_port("127.0.0.1", port, 20)
            line = b""
            while b"broker: nats://" not in line:
                line = proc.stdout.readline()  # type: ignore[union-attr]
                assert line, "broker exited before announcing itself"
            out = subprocess.run(
                [sys.executable, "-m", "rollfleet", "declare", "--nats", f"nats://127.0.0.1:{port}", "-n", "cli"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            assert "already declared" in out.stdout  # the broker command declared it already
            if run == 0:
                subprocess.run(
                    [sys.executable, "-c", _PUBLISH.format(url=f"nats://127.0.0.1:{port}")], check=True, timeout=30
                )
            else:
                kept = subprocess.run(
                    [sys.executable, "-c", _COUNT.format(url=f"nats://127.0.0.1:{port}")],
                    check=True,
                    timeout=30,
                    capture_output=True,
                    text=True,
                )
                assert kept.stdout.strip() == "1"  # the job stored before the restart is still there
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0


_PUBLISH = """
import asyncio, nats
async def main():
    nc = await nats.connect("{url}")
    await nc.jetstream().publish("rf.cli.jobs.min.0", b"x", headers={{"Nats-Msg-Id": "k1"}})
    await nc.close()
asyncio.run(main())
"""
_COUNT = """
import asyncio, nats
async def main():
    nc = await nats.connect("{url}")
    print((await nc.jetstream().stream_info("RF_CLI_JOBS")).state.messages)
    await nc.close()
asyncio.run(main())
"""


async def test_wrong_credentials_fail_fast_with_a_typed_error(tmp_path: Path) -> None:
    import time

    from rollfleet.schemas.errors import AuthorizationError
    from rollfleet.trainer_client import RolloutClient

    broker = EmbeddedBroker(store_dir=tmp_path / "s", extra_args=["--auth", "s3cret"]).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(AuthorizationError) as info:
            await RolloutClient.connect(broker.url, namespace="auth", client_id="c", token="wrong")
        assert not info.value.retryable and time.monotonic() - t0 < 10
        async with await RolloutClient.connect(broker.url, namespace="auth", client_id="c", token="s3cret") as ok:
            assert ok.nc.is_connected
    finally:
        broker.stop()
