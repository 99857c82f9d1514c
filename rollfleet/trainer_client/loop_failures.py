"""Rule 9, what becomes of a group that did not complete (a job failed, a score failed, past its
deadline, or closed with the loop): ``on_failure`` decides whether its prompt goes back, is
reported or is forgotten, ``failure_reason`` says why in one line, and ``FailureLog`` keeps the
groups reported, over the loop's life and since the last batch. ``stop_jobs`` stops a group.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from rollfleet.schemas.errors import Cancelled
from rollfleet.trainer_client.loop_groups import GroupInFlight
from rollfleet.trainer_client.loop_types import Cancel, FailedGroup, FailurePolicy, Note, StopCause


def on_failure(
    policy: FailurePolicy, cause: StopCause, attempts: int, max_attempts: int
) -> Literal["requeue", "report", "forget"]:
    """What becomes of a group that did not complete (rule 9): one closed with the loop is
    forgotten; otherwise its prompt goes back until it was tried ``max_attempts`` times."""
    if cause == "closed":
        return "forget"
    return "requeue" if policy == "requeue" and attempts < max_attempts else "report"


def stop_jobs(g: GroupInFlight, cause: StopCause) -> list[Cancel]:
    """Stop the whole group for ``cause``: a cancel for each job of it not yet cancelled for it (it
    is settled once every job has answered)."""
    g.stop = cause
    cancels: list[Cancel] = []
    for piece in g.pieces.values():
        if piece.stopping != "group":
            piece.stopping = "group"
            cancels.append(Cancel(piece.key, cause))
    return cancels


def failure_reason(cause: StopCause, error: BaseException | None) -> str:
    """One line for why a group stopped: the loop's own cancel, or the error that failed it."""
    if isinstance(error, Cancelled) or error is None:
        return f"cancelled ({cause})"
    return f"{type(error).__name__}: {error}"


def failure_note(g: GroupInFlight, cause: StopCause, reason: str, verdict: str) -> Note:
    return Note("loop_group_failed", {"admitted": g.no, "cause": cause, "reason": reason,
        "attempts": g.prompt.attempts, "tokens": g.generated, "then": verdict})  # fmt: skip


class FailureLog:
    """The groups reported failed: over the loop's life (``failed``, counted in ``totals``) and
    since the last batch."""

    def __init__(self, totals: Counter[str]) -> None:
        self.failed: list[FailedGroup] = []  # reported over the loop's life
        self.since: list[FailedGroup] = []  # reported since the last batch
        self._totals = totals

    def report(self, failure: FailedGroup) -> None:
        self.since.append(failure)
        self.failed.append(failure)
        self._totals["failed"] += 1

    def handed_out(self) -> list[FailedGroup]:
        """The failures a batch carries: those since the batch before (counted afresh from now)."""
        since, self.since = self.since, []
        return since
