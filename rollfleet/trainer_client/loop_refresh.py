"""Rule 7 (refresh: partial rollouts and tails), decided without I/O: which running jobs are
stopped so their samples go on from their tokens at a fresher floor. A job is stopped only when
the floor it would go on at is fresher than its own, never twice for one version, never once a
finished sample pins its group's judged version, and only for prompts given as token ids.
``loop_machine.LoopMachine`` sends the cancels; ``loop_continuations`` continues what they stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rollfleet.trainer_client.loop_groups import GroupInFlight
from rollfleet.trainer_client.loop_samples import continuable
from rollfleet.trainer_client.loop_types import Cancel


def at_risk(piece_floor: int, latest: int, max_staleness: int) -> bool:
    """Whether a job whose tokens may be as old as ``piece_floor`` could miss every batch that may
    take it: two batches are left at most, at ``latest`` (which may be handed out already) and at
    the next commit; it must complete before the one after, where ``latest + 2 - piece_floor >
    max_staleness`` (a job that completes while its stop is on the way is still on time; waiting
    for its very last chance lost every group that completed just after a batch was handed out)."""
    return latest - piece_floor > max(max_staleness - 2, 0)


def must_refresh(
    piece_floor: int,
    fresh_floor: int | None,
    latest: int,
    max_staleness: int,
    *,
    at_risk_only: bool,
    finished_judged: int | None = None,
) -> bool:
    """Rule 7: whether a running job whose tokens may be as old as ``piece_floor`` is stopped and
    continued at ``fresh_floor``. Never unless that is fresher, and never once a finished sample of
    its group is judged from ``finished_judged`` <= ``piece_floor``: the group is judged by its
    oldest-judged sample, so going on at a fresher version would gain it nothing (and the churn of
    stopping would only delay the group while that sample ages). A partial rollout
    (``at_risk_only``) waits until it is ``at_risk``; a tail goes on at once."""
    if fresh_floor is None or fresh_floor <= piece_floor:
        return False
    if finished_judged is not None and finished_judged <= piece_floor:
        return False
    return not at_risk_only or at_risk(piece_floor, latest, max_staleness)


def tails(
    in_flight_admitted: Sequence[int], batch_admitted: Sequence[int], oversample: int, risky: Sequence[int] = ()
) -> list[int]:
    """The tails when a batch is handed out: admission numbers of groups still in flight that were
    admitted before every group of the batch (a whole batch overtook them) or are ``risky`` (a job
    of theirs ``at_risk``), oldest first, at most ``oversample`` of them."""
    if oversample <= 0 or not batch_admitted:
        return []
    first = min(batch_admitted)
    return sorted(a for a in in_flight_admitted if a < first or a in risky)[:oversample]


def refresh_stops(
    groups: Iterable[GroupInFlight],
    tail: set[int],
    fresh_floor: int,
    latest: int,
    max_staleness: int,
    partial_rollout: bool,
) -> tuple[list[Cancel], int]:
    """Rule 7, for every running group (``partial_rollout``: once at risk) and the ``tail`` given
    (at once): marks each job stopped to go on at ``fresh_floor`` and returns its cancel, with the
    number of groups that had a job stopped."""
    cancels: list[Cancel] = []
    continued = 0
    for g in groups:
        if not g.running or not continuable(g.prompt.payload):
            continue
        if g.no not in tail and not partial_rollout:
            continue
        stopped = 0
        pinned = g.pinned()
        for piece in g.pieces.values():
            if piece.stopping is None and must_refresh(
                piece.floor,
                fresh_floor,
                latest,
                max_staleness,
                at_risk_only=g.no not in tail,
                finished_judged=pinned,
            ):
                piece.stopping, piece.refresh_floor = "refresh", fresh_floor
                cancels.append(Cancel(piece.key, "tail" if g.no in tail else "refresh"))
                stopped += 1
        if stopped:
            continued += 1
    return cancels, continued


def batch_tails(
    groups: Iterable[GroupInFlight], batch_admitted: Sequence[int], latest: int, max_staleness: int, oversample: int
) -> set[int]:
    """The tails once a batch of groups admitted as ``batch_admitted`` is handed out: ``tails`` of
    the running groups, a group with a job ``at_risk`` counted risky."""
    running = [g for g in groups if g.running]
    risky = [g.no for g in running if any(at_risk(p.floor, latest, max_staleness) for p in g.pieces.values())]
    return set(tails([g.no for g in running], batch_admitted, oversample, risky))
