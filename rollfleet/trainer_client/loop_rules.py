"""The rollout loop's decisions, as pure functions over plain data (no I/O, no clock reads).

``RolloutLoop`` (``trainer_client.loop``) carries them out; each is tested here exhaustively in
milliseconds. The rules:

- **Admission** (AReaL's bound): groups accepted for training plus groups in flight never exceed
  ``(steps + max_staleness + 1) * batch_groups`` (+ ``oversample``), where ``steps`` counts the
  versions committed since the loop started. A group admitted when ``steps`` versions were
  committed is therefore needed by a batch trained at most ``max_staleness`` versions later: in
  steady state nothing is generated only to be dropped as too stale.
- **Staleness at consume time**, from the result's facts: a group's staleness is the trainer's
  version when the batch is handed out minus the oldest version that generated any of its
  tokens (the ``version_start`` of its samples). Past ``max_staleness`` the loop's policy decides:
  ``drop`` it, ``requeue`` its prompt, or ``keep`` it (the spans stay on every sample for
  importance weighting).
- **Partial rollouts** (``partial_rollout``): a group still generating when a commit puts it at
  risk of going stale is stopped, and each stopped sample goes on at the new version from its tokens
  so far (its spans show both versions); it is judged by the version it was continued at.
- **Consume order**: of the ready groups, the one judged from the oldest version goes first
  (earliest deadline first), so a group is dropped only when it could not have been trained on
  in time.
- **Long tails**: a group still in flight that a whole batch of later-admitted groups overtook is
  a tail; with ``oversample`` the loop cancels up to that many of them when a batch fills (their
  replicas are freed at once) and re-queues their prompts.
- **Dynamic sampling**: a group whose rewards are all equal carries no GRPO signal; dropped, and
  the room it held is refilled from the source.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

StalePolicy = Literal["drop", "requeue", "keep"]
FailurePolicy = Literal["requeue", "report"]
WasteCause = Literal["stale", "tail", "filtered", "failed", "deadline", "closed"]
WASTE_CAUSES: tuple[WasteCause, ...] = ("stale", "tail", "filtered", "failed", "deadline", "closed")


def admission_room(
    *,
    steps: int,
    max_staleness: int,
    batch_groups: int,
    accepted: int,
    in_flight: int,
    oversample: int = 0,
    max_in_flight: int | None = None,
) -> int:
    """How many more groups may be admitted now (never negative).

    ``steps``: versions committed since the loop started; ``accepted``: groups that completed
    and were kept for training (handed out or waiting in the buffer), over the loop's life;
    ``in_flight``: groups admitted and not yet complete. Dropped, filtered, failed and cancelled
    groups are in neither count: their room is given back, so the source refills it.
    """
    bound = (steps + max_staleness + 1) * batch_groups + oversample
    room = bound - (accepted + in_flight)
    if max_in_flight is not None:
        room = min(room, max_in_flight - in_flight)
    return max(0, room)


def submit_floor(
    *, latest: int, first: int, max_staleness: int, fresh_served: bool, waited_s: float, grace_s: float
) -> int | None:
    """The minimum version new groups ask for: the trainer's latest, once a replica is at or
    preparing it (``fresh_served``); None (wait) until then, for at most ``grace_s``; after that,
    ``max_staleness`` below it, as a plain ``submit(max_staleness=...)`` would."""
    if fresh_served:
        return latest
    if waited_s < grace_s:
        return None
    return max(first, latest - max_staleness)


def staleness(consumed_at: int, version_starts: Sequence[int]) -> int:
    """A group's staleness when consumed at trainer version ``consumed_at``: measured from the
    oldest policy that generated any of its tokens (never negative: a replica may be ahead of
    the trainer's view of the latest version)."""
    return max(0, consumed_at - min(version_starts)) if version_starts else 0


def too_stale(consumed_at: int, version_starts: Sequence[int], max_staleness: int) -> bool:
    return staleness(consumed_at, version_starts) > max_staleness


def judged_starts(version_starts: Sequence[int], continued_at: int | None) -> list[int]:
    """The versions a group's staleness is judged from: its samples' starts, or, for a partial
    rollout, the version it was continued at (its older tokens are in the spans, for the
    trainer to mask or weight)."""
    return [continued_at] if continued_at is not None else list(version_starts)


def next_to_consume(judged_from: Sequence[int]) -> int:
    """Which ready group goes into the batch next: the one judged from the oldest version (the
    first to go stale if left waiting), the earliest completed among equals. Taking them in
    completion order instead drops a long group that completed just as a version was committed,
    while fresher groups that could wait a step are trained on."""
    return min(range(len(judged_from)), key=lambda i: (judged_from[i], i))


def must_continue(floor: int, latest: int, max_staleness: int) -> bool:
    """Partial rollouts: whether a group whose jobs may be served at ``floor`` and are still
    generating when ``latest`` is committed is stopped and continued at ``latest``.

    It is at risk once it could no longer be trained on at the batch after the next commit: the
    batch at ``latest`` may already have been handed out, so it would be consumed at
    ``latest + 1``, too stale once ``latest + 1 - floor > max_staleness``. (With
    ``max_staleness=0`` that is every commit; waiting for ``latest - floor > max_staleness``
    instead lost every long group that finished just after a batch was handed out.)
    """
    return latest - floor > max(max_staleness - 1, 0)


def on_stale(policy: StalePolicy) -> Literal["train", "drop", "requeue"]:
    """What becomes of a group found too stale at consume time."""
    return "train" if policy == "keep" else policy


def uninformative(rewards: Sequence[float], tol: float = 1e-12) -> bool:
    """Dynamic sampling's filter: every sample of the group scored the same (no advantage)."""
    return len(rewards) > 0 and max(rewards) - min(rewards) <= tol


def tails(in_flight_admitted: Sequence[int], batch_admitted: Sequence[int], oversample: int) -> list[int]:
    """The tails to cancel when a batch fills: admission numbers of groups still in flight that
    were admitted before every group of the batch (a whole batch overtook them), oldest first,
    at most ``oversample`` of them."""
    if oversample <= 0 or not batch_admitted:
        return []
    first = min(batch_admitted)
    return sorted(a for a in in_flight_admitted if a < first)[:oversample]


def past_deadline(admitted_at: float, now: float, deadline_s: float | None) -> bool:
    return deadline_s is not None and now - admitted_at > deadline_s


def on_failure(
    policy: FailurePolicy, cause: WasteCause, attempts: int, max_attempts: int
) -> tuple[Literal["requeue", "report", "forget"], int]:
    """What becomes of a group that did not complete, and the tries its prompt has used.

    A cancelled tail is not the prompt's fault: it goes back, and the try does not count. A
    group closed with the loop is forgotten. Otherwise (a sample could not be produced, or the
    group's deadline passed) the prompt goes back until it was tried ``max_attempts`` times,
    then the group is reported failed.
    """
    if cause == "closed":
        return "forget", attempts
    if cause == "tail":
        return "requeue", attempts - 1
    return ("requeue" if policy == "requeue" and attempts < max_attempts else "report"), attempts


def utilization(busy: Sequence[int], capacity: Sequence[int]) -> float | None:
    """Busy fraction of the fleet's slots (None when the fleet has none)."""
    total = sum(capacity)
    return min(1.0, sum(busy) / total) if total > 0 else None
