"""What cancelling a job did, decided from facts: the pure rules behind ``RolloutHandle.cancel``.

A job nobody took is withdrawn from the queue and never runs. A job a replica may have taken
is deleted from the queue too (nothing redelivers it), and the fleet is asked to stop it: the
replica running it aborts its engine requests and answers it with the tokens made so far (each
unfinished sample's finish reason "abort"), or ``Cancelled`` if it had not started generating.
What ``cancel()`` returns says which of these happened, from the answer itself.

A handle is cancelled once. The first ``cancel()`` of a handle makes the decision; any other,
at the same time or later, joins it and returns the same outcome. Deciding again from the
broker's state after the first cancel changed it mislabels the race: a second cancel of a
queued job found it already removed, took it for one a replica might hold, and asked the fleet
to stop it ("withdrawn" and "stopped" for one job), and a cancel of a withdrawn handle found it
settled and said "answered".
"""

from __future__ import annotations

from typing import Literal

from rollfleet.schemas import RolloutResult
from rollfleet.schemas.errors import Cancelled, RollfleetError

CancelOutcome = Literal["withdrawn", "stopped", "answered", "unknown"]
Leaving = Literal["cancel", "run_on"]
CancelStep = Literal["cancel", "answered", "join"]
EarlierCancel = Literal["none", "deciding", "decided", "failed"]


def on_leaving(client_key: str | None) -> Leaving:
    """What becomes of a job whose caller left before its answer (a task cancelled while it
    submitted or waited, an HTTP client that disconnected): without a key of the caller's nobody
    can ask for it again, so it would run for nobody and is cancelled; with one it runs on, so
    that a retry under the key gets its one answer. The one rule for every door."""
    return "run_on" if client_key is not None else "cancel"


def next_cancel(earlier: EarlierCancel, settled: bool) -> CancelStep:
    """What a ``cancel()`` of a handle does. ``earlier``: the handle's earlier cancel, if any
    ("failed": it raised, the broker unreachable, and decided nothing); ``settled``: the handle
    holds its answer. "join": return that cancel's outcome; "answered": it was answered before
    any cancel decided, nothing to do; "cancel": this one decides (withdraw it, or stop it)."""
    if earlier in ("deciding", "decided"):
        return "join"
    return "answered" if settled else "cancel"


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
