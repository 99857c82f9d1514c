"""Test-only pieces; the shared harness (brokers, workers, waiting, stopping) is ``harness``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollfleet.broker.topology import TopologyConfig
from rollfleet.schemas import DEFAULT_LIMITS, RolloutJob, RolloutPayload, SamplingParams, VersionConstraint
from rollfleet.trainer_client.requests import build_job
from rollfleet.workers.engines.echo import EchoEngine

REPO = Path(__file__).resolve().parents[1]
FAST_TOPOLOGY = TopologyConfig(ack_wait_s=2.0, duplicate_window_s=120.0)


def payload(tokens: list[int] | None = None, max_tokens: int = 4, **sampling: Any) -> RolloutPayload:
    return RolloutPayload(
        prompt_token_ids=tokens or [1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens, **sampling)
    )


class CountingEcho(EchoEngine):
    """The echo engine, counting what it ran and the peak concurrency (for assertions)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls: list[str] = []
        self.running = 0
        self.peak = 0

    async def generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None = None, sink: Any = None
    ) -> Any:
        self.calls.append(request_id)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await super().generate(request_id, payload, session_id, sink)
        finally:
            self.running -= 1


def built_job(
    payload: RolloutPayload, constraint: VersionConstraint, written: str, key: str = "k", **fields: Any
) -> tuple[RolloutJob, bytes]:
    """A job as ``RolloutClient.submit`` builds it (client ``c``, 30 s), and its wire bytes."""
    options: dict[str, Any] = {
        "client_id": "c",
        "deadline": None,
        "timeout": 30,
        "default_timeout_s": 30,
        "retry_policy": "replayable",
        "session_id": None,
        "trainer_version": None,
        "limits": DEFAULT_LIMITS,
    }
    options.update(fields)
    return build_job(payload, constraint=constraint, written=written, idempotency_key=key, **options)


async def progress_records(js: Any, names: Any, client_id: str, job_id: str) -> list[Any]:
    """Every progress record stored for a job, decoded, in stream order (``schemas.progress``)."""
    import nats.js.errors

    from rollfleet.schemas import decode
    from rollfleet.schemas.progress import ProgressRecord

    subject, out, seq = names.progress_subject(client_id, job_id), [], 1
    while True:
        try:
            msg = await js.get_msg(names.progress_stream, seq=seq, subject=subject, next=True, direct=True)
        except nats.js.errors.NotFoundError:
            return out
        out.append(decode(msg.data, ProgressRecord))
        seq = int(msg.seq) + 1


async def stored_results(url: str, namespace: str, client_id: str, key: str) -> list[Any]:
    """Every authentic answer the fleet stored for ``client_id``'s ``key``, read from the results
    stream by a client of its own: what the worker stored, not what a door made of it."""
    import uuid

    from rollfleet.trainer_client import RolloutClient, answers

    async with await RolloutClient.connect(url, namespace=namespace, client_id=f"reader-{uuid.uuid4().hex[:8]}") as r:
        return [o async for _, o in answers.stored(r.js, r.names, client_id, key)]
