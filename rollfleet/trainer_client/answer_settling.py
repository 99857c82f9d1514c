"""Handing an answer to the caller: the one place that decides whether an answer may settle a
request, and settles it.

Every way an answer reaches a caller goes through here: the results stream (``ResultsInbox``),
an answer that came before its handle, a stored answer looked up (a resubmission, a withdrawn
job, a stalled one), and ``RolloutClient.result(key)``. An answer settles a request when it
answers that request (``answers.judge``: the request's fingerprint, a job id this client id
issued for the key) and was served within the constraint it was asked under (defence in depth:
workers never store one outside it); it then carries its staleness against the newest version.
"""

from __future__ import annotations

from collections.abc import Callable

from rollfleet.broker.types import JetStreamContext
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    Names,
    Outcome,
    RolloutFailure,
    RolloutJob,
    RolloutResult,
    VersionConstraint,
    error_from_code,
    served_within,
)
from rollfleet.schemas.errors import ContractViolation, IdempotencyConflict
from rollfleet.trainer_client import answers
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.own_job_ids import JobIds

log = get_logger("rollfleet.client")


def conflict(key: str) -> IdempotencyConflict:
    return IdempotencyConflict(
        f"idempotency key {key!r} is already used for a different request; give this request its own key"
    )


def check_same_request(job: RolloutJob, fingerprint: str) -> None:
    """A key asked again while its handle waits: the same request, or ``IdempotencyConflict``."""
    if job.fingerprint != fingerprint:
        raise IdempotencyConflict(
            f"idempotency key {job.idempotency_key!r} is already used for a different request "
            f"(constraint {job.constraint}); give this request its own key"
        )


def _any_job(job_id: str | None) -> bool:
    return True


class Settler:
    """Settles the handles of one client (``handles``: those waiting, by key)."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        client_id: str,
        handles: dict[str, RolloutHandle],
        metrics: ClientMetrics,
        latest_version: Callable[[], int | None],
    ) -> None:
        self._js, self._names, self._client_id = js, names, client_id
        self._handles = handles
        self._metrics = metrics
        self._latest_version = latest_version
        self.ids: JobIds | None = None  # this client id's job ids (loaded when the client starts)

    def issued(self, key: str) -> answers.JobFilter:
        """The job ids whose answers answer a request under ``key``: any this client id issued for
        it (``JobIds``): its own job, or the one stored under the key before (by this process or
        one before a restart), whose answer may arrive before a resubmission has found that job."""
        ids = self.ids
        assert ids is not None, "the client has not started"
        return lambda job_id: ids.issued(job_id, key)

    def accepts(self, handle: RolloutHandle) -> answers.JobFilter:
        return self.issued(handle.idempotency_key)

    def settle(self, handle: RolloutHandle, outcome: Outcome, *, issued: bool = False) -> bool:
        """Hand ``outcome`` to the caller if it answers this request (``answers.judge``) and keeps
        its constraint; False (the handle left waiting) if it answers nothing of ours. ``issued``:
        its job id is known to be one this client issued for the key (checked by the caller)."""
        verdict = answers.judge(outcome, handle.job.fingerprint, _any_job if issued else self.accepts(handle))
        if verdict == "foreign":
            log.warning(
                "answer that does not answer this request ignored",
                idempotency_key=handle.idempotency_key,
                job_id=outcome.job_id,
                worker_id=outcome.worker_id,
            )
            return False
        if verdict == "conflict":
            handle.set_error(conflict(handle.idempotency_key))
            return True
        if isinstance(outcome, RolloutFailure):
            handle.set_error(error_from_code(outcome.code, outcome.message, outcome.retryable))
            return True
        # Judged against the constraint it was asked under: the job it answers may be a copy of
        # the request stored before, under the key's one job id (a resubmission of
        # ``max_staleness=1``, or of a pinned session's turn, resolves to another version later;
        # the fingerprint has already matched the request as written).
        asked = outcome.constraint or handle.job.constraint
        if not self._within_constraint(outcome, asked):
            handle.set_error(
                ContractViolation(
                    f"result for {handle.idempotency_key!r} was served at versions {outcome.version_start}.."
                    f"{outcome.version_end}, outside {asked}; it was not used"
                )
            )
            return True
        self._attach_staleness(outcome)
        handle.set_result(outcome)
        return True

    async def settle_stored(self, handle: RolloutHandle) -> bool:
        """Settle the handle with the answer stored for its request, if there is one (the oldest:
        the one every re-ask returns)."""
        key = handle.idempotency_key
        found = await answers.first_answer(
            self._js, self._names, self._client_id, key, handle.job.fingerprint, self.accepts(handle)
        )
        if found is None:
            return False
        self._handles.pop(key, None)
        return self.settle(handle, found[1])

    def deliver(self, key: str, outcome: Outcome) -> RolloutResult:
        """An answer asked for by key alone (``RolloutClient.result``): its result, or its error
        raised; checked against the constraint it carries."""
        if isinstance(outcome, RolloutFailure):
            raise error_from_code(outcome.code, outcome.message, outcome.retryable)
        if not self._within_constraint(outcome, None):
            raise ContractViolation(f"result for {key!r} was served outside {outcome.constraint}")
        self._attach_staleness(outcome)
        return outcome

    def _within_constraint(self, result: RolloutResult, constraint: VersionConstraint | None) -> bool:
        """Defence in depth: every result is checked against the constraint it was asked for."""
        constraint = constraint or result.constraint
        if constraint is None or served_within(constraint, result):
            return True
        self._metrics.contract_violations.inc()
        log.error(
            "contract violation: result outside its constraint, not handed to the caller",
            idempotency_key=result.idempotency_key,
            constraint=str(constraint),
            version_start=result.version_start,
            version_end=result.version_end,
            worker_id=result.worker_id,
        )
        return False

    def _attach_staleness(self, result: RolloutResult) -> None:
        latest = self._latest_version()
        if latest is not None:
            # Measured from the oldest policy that produced any of its tokens.
            result.staleness = max(0, latest - result.version_start)
