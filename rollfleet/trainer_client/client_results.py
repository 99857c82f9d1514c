"""A client's results beyond ``await handle``: a job's tokens as they are made, a key's result
whoever asked it, answers nobody here asked for, and replays. One of ``RolloutClient``'s parts,
by what it offers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from rollfleet.broker.types import JetStreamContext
from rollfleet.schemas import Names, Outcome, RolloutPayload, RolloutResult
from rollfleet.schemas.progress import TokenChunk
from rollfleet.schemas.replay_rules import ReplayOutcome
from rollfleet.trainer_client import replaying
from rollfleet.trainer_client.earlier_answers import EarlierAnswers
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.inbox import ResultsInbox
from rollfleet.trainer_client.streaming import stream_tokens


class ClientResults:
    js: JetStreamContext
    names: Names
    inbox: ResultsInbox
    earlier: EarlierAnswers

    def stream(self, handle: RolloutHandle) -> AsyncIterator[TokenChunk]:
        """A job's tokens as its worker checkpoints them (``resume`` jobs; other jobs: at the end),
        then the rest from its answer: ``async for chunk in client.stream(handle)``. The chunks put
        together are the result's tokens, in order, each once, across resumes; the job's error,
        if it fails, is raised. ``await handle`` still returns the same result."""
        return stream_tokens(self.js, self.names, handle)

    async def replay(self, target: Any, payload: RolloutPayload, **options: Any) -> ReplayOutcome:
        """Generate sample ``index`` of ``target`` (a result, or a coordinate and the ``original``
        sample) again, deterministic and at its version, and say whether every token and log-prob
        matched, or where it diverged and which part of the coordinate differs
        (``replaying.replay``, whose keyword options it takes)."""
        return await replaying.replay(self, target, payload, **options)  # type: ignore[arg-type]

    async def result(self, idempotency_key: str, timeout: float | None = None) -> RolloutResult:
        """The result for a key, whether submitted by this process or before a restart; waits up
        to ``timeout`` (by default the client's ``default_timeout_s``), then ``TimeoutError``."""
        return await self.earlier.result(idempotency_key, timeout)

    def unclaimed(self) -> dict[str, Outcome]:
        """Results that arrived for keys this process did not submit (e.g. before a restart)."""
        return dict(self.inbox.unclaimed)

    def take_unclaimed(self, idempotency_key: str) -> Outcome | None:
        """The unclaimed answer under ``idempotency_key``, removed (a caller that will never ask
        for the key counts it instead: ``RolloutLoop``'s answers of a predecessor); None if none."""
        return self.inbox.take(idempotency_key)

    # Called with every answer message received, before deduplication (for audits and tests).
    @property
    def observe(self) -> Callable[[Outcome, int | None], None] | None:
        return self.inbox.observe

    @observe.setter
    def observe(self, fn: Callable[[Outcome, int | None], None] | None) -> None:
        self.inbox.observe = fn
