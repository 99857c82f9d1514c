"""A server process started while the broker is not ready tries again instead of exiting.

A cluster electing a leader answers JetStream requests with 503, and a node cut off from its peers
answers none (campaign seed 8, `--cluster`: both gateways, started during a node cut, exited with
"JetStream system temporarily unavailable", and the HTTP path stayed dead for 45 s). Here the
broker answers no JetStream request at first (a nats-server without JetStream), then is replaced on
the same port by one with it: the worker and the gateway started meanwhile wait, then serve.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import httpx
import nats.errors
import nats.js.errors
import pytest

from harness import ProcessGroup, start_worker_process, wait_until
from harness.processes import rollfleet_command
from rollfleet.broker import EmbeddedBroker, check_server_binary, free_port
from rollfleet.broker.server import wait_for_port
from rollfleet.broker.startup import not_ready, try_again, until_ready
from rollfleet.runtime.backoff import Backoff
from rollfleet.runtime.processes import terminate
from rollfleet.schemas.errors import InvalidRequest, ServiceUnavailable
from rollfleet.trainer_client import RolloutClient
from tests.helpers import payload


def test_a_start_is_tried_again_only_for_a_retryable_error_within_the_bound() -> None:
    assert try_again(True, 0.0, 60.0) and try_again(True, 59.9, 60.0)
    assert not try_again(True, 60.0, 60.0)
    assert not try_again(False, 0.0, 60.0)  # (wrong credentials, a bad argument: at once)


async def test_a_start_step_meeting_a_stalled_broker_is_tried_again_not_raised_raw() -> None:
    # CI: a gateway started while its new broker was slow exited on nats' own time-out from a
    # read after the namespace's (the fleet view's policy read), which no start tried again, and
    # never listened. Each raw "not ready" error of a start's step is a retryable one.
    raised = [
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.js.errors.ServiceUnavailableError(),
        nats.errors.ConnectionClosedError(),
    ]
    tries: list[int] = []

    async def flaky() -> str:
        tries.append(1)
        if raised:
            raise raised.pop(0)
        return "started"

    assert await until_ready(flaky, what="test", retry=Backoff.fixed(0.0)) == "started"
    assert len(tries) == 5

    async def broken() -> str:
        tries.append(1)
        raise ValueError("a defect, not a broker")

    tries.clear()
    with pytest.raises(ValueError):  # (not the broker's: at once)
        await until_ready(broken, what="test", retry=Backoff.fixed(0.0))
    assert len(tries) == 1

    async def stalled() -> str:
        raise nats.errors.TimeoutError()

    with pytest.raises(ServiceUnavailable) as caught:  # past the bound: typed, with its cause
        await until_ready(stalled, what="the fleet view", bound_s=0.05, retry=Backoff.fixed(0.01))
    assert caught.value.retryable and isinstance(caught.value.__cause__, nats.errors.TimeoutError)
    assert not_ready(InvalidRequest("bad"), "x") is None and not_ready(KeyError("k"), "x") is None

    async def answered() -> str:  # a step whose own typed error is its answer (no version to serve)
        tries.append(1)
        raise ServiceUnavailable("no version can be served here")

    tries.clear()
    with pytest.raises(ServiceUnavailable):
        await until_ready(answered, what="policy", retry=Backoff.fixed(0.0), typed=False)
    assert len(tries) == 1


async def test_a_worker_and_a_gateway_started_before_jetstream_is_ready_wait_then_serve(tmp_path: Path) -> None:
    port, ns = free_port(), "tstart"
    url = f"nats://127.0.0.1:{port}"
    bare = subprocess.Popen(
        [str(check_server_binary()), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    broker: EmbeddedBroker | None = None
    worker = start_worker_process(url, ns, "w1", "--engine", "echo", "--version", "0", log_path=tmp_path / "w1.log")
    procs = ProcessGroup(tmp_path)
    try:
        wait_for_port("127.0.0.1", port, 10.0, bare)
        gateway = procs.spawn("gateway", rollfleet_command("gateway", "--nats", url, "-n", ns, "--port", "0"))
        await asyncio.sleep(3.0)  # every JetStream request refused meanwhile: no responders
        assert worker.poll() is None, (tmp_path / "w1.log").read_text(errors="replace")[-1500:]
        assert gateway.poll() is None, procs.tail("gateway", 1500)
        terminate(bare, 5.0)
        broker = EmbeddedBroker(store_dir=tmp_path / "store", port=port, log_file=tmp_path / "nats.log").start()

        def listening() -> str | None:
            m = re.search(r"rollfleet gateway on (http://\S+)", procs.tail("gateway", 100_000))
            return m.group(1) if m else None

        address = await wait_until(listening, 60.0, what="the gateway listening", interval=0.2)
        async with await RolloutClient.connect(url, namespace=ns, client_id="trainer") as client:
            # (the worker registers once its start got through: the gateway may be up first)
            await wait_until(lambda: len(client.fleet.replicas()) == 1, 60.0, what="the worker registered")
            result = await wait_until(
                lambda: asyncio.wait_for(client.submit(payload(), min_version=0), 5.0),
                30.0,
                what="a job submitted",
                retry_errors=True,
            )
            assert (await result.result(20)).version_start == 0  # the worker serves
        async with httpx.AsyncClient(base_url=address, timeout=20.0) as http:
            r = await http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200, r.text  # the gateway serves
    finally:
        terminate(worker, 10.0)
        procs.close()
        terminate(bare, 5.0)
        if broker is not None:
            broker.stop()
