"""What cancelling a job did, decided from facts: the pure rules behind ``RolloutHandle.cancel``.

A job nobody took is withdrawn from the queue and never runs. A job a replica may have taken
is deleted from the queue too (nothing redelivers it), and the fleet is asked to stop it: the
replica running it aborts its engine requests and answers it with the tokens made so far (each
unfinished sample's finish reason "abort"), or ``Cancelled`` if it had not started generating.
What ``cancel()`` returns says which of these happened, from the answer itself.
"""

from __future__ import annotations

from typing import Literal

from rollfleet.schemas import RolloutResult
from rollfleet.schemas.errors import Cancelled, RollfleetError

CancelOutcome = Literal["withdrawn", "stopped", "answered", "unknown"]


def must_stop(delivered: bool | None, removed: bool) -> bool:
    """Whether the fleet must be asked to stop the job: unless it was removed from the queue
    before any replica was delivered it (``delivered`` None: the broker did not say)."""
    return not (removed and delivered is False)


def outcome_of(answer: RolloutResult | RollfleetError | None) -> CancelOutcome:
    """``answer``: what the job was answered with after the stop was asked (None: nothing came).
    "stopped": it ended early for the cancel; "answered": it had finished (or failed) anyway."""
    if answer is None:
        return "unknown"
    if isinstance(answer, Cancelled):
        return "stopped"
    if isinstance(answer, RolloutResult) and any(o.finish_reason == "abort" for o in answer.outputs):
        return "stopped"
    return "answered"
