"""A session's turns answered once: asked again, a turn returns the answer it had.

This process keeps the answers of the turns it ran (results and errors); the record keeps the
newest failures (``session_record.note_failure``), so a turn that failed before a restart raises
the same error again; any other turn is read back from the results stream under the key its job
was stored under (``session_record.key_of``).
"""

from __future__ import annotations

from rollfleet.schemas import RolloutResult, SessionRecord, error_from_code
from rollfleet.schemas.errors import Expired, RollfleetError
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.sessions import session_record
from rollfleet.trainer_client.sessions.host import SessionHost


class TurnAnswers:
    """The answers of one session handle's turns."""

    def __init__(self) -> None:
        self._answers: dict[int, RolloutResult] = {}  # this process's answered turns
        self._errors: dict[int, RollfleetError] = {}  # ... and turns answered with an error

    def answered(self, metrics: ClientMetrics, turn: int, result: RolloutResult, previous: str | None) -> None:
        metrics.session_turns.inc()
        metrics.prefix_tokens_reused.inc(result.cached_tokens)
        if previous is not None and result.worker_id == previous:
            metrics.affinity_hits.inc()
        self._answers[turn] = result

    def failed(self, record: SessionRecord, turn: int, exc: RollfleetError) -> None:
        """A stored turn answered with an error: asked again, it raises the same error (a worker's
        failure is also stored as the turn's answer; the client's own, Expired or a withdrawal,
        only here and in the record)."""
        self._errors[turn] = exc
        session_record.note_failure(record, turn, exc)

    async def of(self, host: SessionHost, record: SessionRecord, turn: int, timeout: float | None) -> RolloutResult:
        """Turn ``turn``'s answer: its result, or its error raised again."""
        answer = self._answers.get(turn)
        if answer is not None:
            return answer
        if turn in self._errors:
            raise self._errors[turn]
        failure = record.failures.get(turn)
        if failure is not None:
            raise error_from_code(failure.code, failure.message, failure.retryable)
        wait = host.default_timeout_s if timeout is None else timeout
        try:
            return await host.result(session_record.key_of(record, turn), timeout=wait)
        except TimeoutError:
            raise Expired(
                f"no answer to turn {turn} of session {record.session_id!r} arrived within {wait:g} s"
            ) from None
