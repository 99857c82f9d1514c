"""A replica whose engine dies or hangs stops taking jobs, hands back what it holds, and says so.

The engine here is the echo engine with a switch that makes it fail the way a dead inference
server does (every request fails, ``health()`` says why); the vLLM server killed for real under
a job is in tests/test_engine_vllm.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness import running_worker, wait_until
from rollfleet.cli.status import collect_status, render_table
from rollfleet.schemas import Outcome, RolloutPayload, SamplingParams, VersionConstraint
from rollfleet.schemas.errors import EngineFailure, Interrupted
from rollfleet.trainer_client import RolloutClient
from rollfleet.workers.engines.base import EngineHealth
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import CountingEcho


class DyingEcho(EchoEngine):
    """Echo, until ``die()``: then every request in flight or to come fails and health says so."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.dead: str | None = None
        self._died = asyncio.Event()

    def die(self, why: str = "server exited with code -9") -> None:
        self.dead = why
        self._died.set()

    def revive(self) -> None:
        self.dead = None
        self._died = asyncio.Event()

    async def generate(self, request_id: str, payload: RolloutPayload, session_id: str | None = None) -> Any:
        if self.dead:
            raise EngineFailure(f"echo: {self.dead}")
        run = asyncio.ensure_future(super().generate(request_id, payload, session_id))
        died = asyncio.ensure_future(self._died.wait())
        await asyncio.wait({run, died}, return_when=asyncio.FIRST_COMPLETED)
        died.cancel()
        if not run.done():
            run.cancel()
            raise EngineFailure(f"echo: {self.dead}")
        return run.result()

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=self.dead is None, detail=self.dead or "echo")


def long_job(tokens: int = 100) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=tokens))


@pytest.mark.parametrize("retry_policy", ["replayable", "at_most_once"])
async def test_a_replica_whose_engine_dies_hands_back_its_job_and_takes_no_more(
    nats_url: str, namespace: str, retry_policy: str
) -> None:
    dying, other = DyingEcho(per_token_s=0.05), CountingEcho()
    answers: dict[str, int] = {}

    def observe(outcome: Outcome, _seq: int | None) -> None:
        answers[outcome.idempotency_key] = answers.get(outcome.idempotency_key, 0) + 1

    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=dying, health_s=0.2) as a,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        client.observe = observe
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        handle = await client.submit(long_job(), min_version=0, idempotency_key="k", retry_policy=retry_policy)  # type: ignore[arg-type]
        assert a.jobs is not None
        await wait_until(lambda: len(a.jobs.running) == 1, timeout=5)
        async with running_worker(nats_url, namespace, worker_id="b", engine=other):
            await wait_until(lambda: len(client.fleet.replicas()) == 2)
            dying.die()
            if retry_policy == "replayable":
                result = await handle.result(20)
                assert result.worker_id == "b" and result.delivery_attempt == 2
            else:  # it had started: never run a second time
                with pytest.raises(Interrupted):
                    await handle.result(20)
                assert other.calls == []
            status = await wait_until(
                lambda: (r := client.fleet.replica("a")) is not None and r.state == "down" and r, timeout=5
            )
            assert "server exited" in (status.degraded_reason or "")
            assert not client.fleet.replica("a").can_serve(VersionConstraint("min", 0))  # type: ignore[union-attr]
            async def shown() -> bool:  # (rollfleet status, as an operator runs it)
                return "a is down: engine echo down: server exited" in render_table(
                    await collect_status(nats_url, namespace)
                )

            await wait_until(shown, timeout=10, what="the reason in rollfleet status")
            # New jobs go to b only while a's engine is down.
            for i in range(6):
                assert (await (await client.submit(long_job(2), min_version=0)).result(10)).worker_id == "b", i
            dying.revive()
            await wait_until(lambda: (r := client.fleet.replica("a")) is not None and r.state == "ready", timeout=5)
        served = await (await client.submit(long_job(2), min_version=0)).result(10)  # b is gone: a again
        assert served.worker_id == "a"
        await asyncio.sleep(0.3)
        assert answers["k"] == 1


async def _dropping_server(drops: int) -> tuple[asyncio.Server, list[int]]:
    """A TCP server that closes its first ``drops`` connections after reading their request
    (as a server closing an idle keep-alive connection does), then answers 200."""
    seen = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        seen[0] += 1
        if seen[0] > drops:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), seen


@pytest.mark.parametrize(("drops", "down"), [(1, False), (5, True)])
async def test_a_dropped_health_connection_is_asked_again_before_the_server_counts_as_down(
    drops: int, down: bool
) -> None:
    from rollfleet.workers.engines.vllm import VLLMEngine

    server, seen = await _dropping_server(drops)
    port = server.sockets[0].getsockname()[1]
    engine = VLLMEngine(url=f"http://127.0.0.1:{port}")
    try:
        problem = await engine._probe()
    finally:
        server.close()
        await engine.close()
    assert (problem is not None) == down, problem
    assert seen[0] == 2  # asked once more on a fresh connection, never more
    if down:
        assert problem is not None and "RemoteProtocolError" in problem
