"""What a client does with a job it tried to withdraw, decided without I/O: store it again
elsewhere, leave it where it is, or first ask whether it was answered. ``placement.JobPlacement``
carries the decision out against the broker.
"""

from __future__ import annotations

from typing import Literal

Withdrawal = Literal["removed", "gone", "unknown"]  # what withdrawing a stored job did
AfterWithdrawal = Literal["store_again", "leave", "ask_if_answered"]


def after_withdrawal(outcome: Withdrawal, settled: bool, can_ask: bool) -> AfterWithdrawal:
    """``removed``: this call took the job out, so it may be stored again elsewhere. ``gone``: a
    worker answered it (it stores the answer before it acknowledges) or the broker's store lost
    it; the stored answer tells which, so ask (none stored: lost, store it again). ``unknown`` (the
    broker did not answer), a handle settled meanwhile, or no way to ask: leave it, the next look
    decides."""
    if outcome == "removed":
        return "store_again"
    if outcome == "unknown" or settled or not can_ask:
        return "leave"
    return "ask_if_answered"
