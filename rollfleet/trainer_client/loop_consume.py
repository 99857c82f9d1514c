"""What the trainer's ask takes, decided without I/O (rules 6 and 8 at consume time): each ready
group's staleness at the trainer's version, what the ``stale`` policy makes of a group past
``max_staleness``, the order groups go into a batch, and whether the batch waits for a group in
flight whose last chance it is. ``loop_machine.LoopMachine.take`` carries the decisions out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from rollfleet.trainer_client.loop_groups import GroupInFlight
from rollfleet.trainer_client.loop_types import Group, Note, StalePolicy


def staleness(consumed_at: int, versions: Sequence[int]) -> int:
    """Versions between the trainer's version at consume time and the oldest of ``versions``
    (never negative: a replica may be ahead of the trainer's view of latest)."""
    return max(0, consumed_at - min(versions)) if versions else 0


def too_stale(consumed_at: int, versions: Sequence[int], max_staleness: int) -> bool:
    return staleness(consumed_at, versions) > max_staleness


def on_stale(policy: StalePolicy) -> Literal["train", "drop", "requeue"]:
    """What becomes of a group found too stale at consume time."""
    return "train" if policy == "keep" else policy


def next_to_consume(judged_from: Sequence[int]) -> int:
    """Which ready group goes into the batch next (rule 8): the one judged from the oldest version
    (the first to go stale if left waiting), the earliest completed among equals."""
    return min(range(len(judged_from)), key=lambda i: (judged_from[i], i))


def wait_for_in_flight(
    ready: Sequence[int], in_flight: Sequence[int], version: int, max_staleness: int, batch_groups: int
) -> int | None:
    """Rule 8: whether the batch at ``version`` must wait for a group still in flight, and for
    which: None (it need not), or the latest last chance ``D`` such that the groups in flight whose
    last chance is at most ``D`` are waited for. ``ready``: the judged versions of the ready groups;
    ``in_flight``: for each group in flight, the oldest version it can be judged from (its finished
    samples' judged versions, its jobs' floors). A group judged from ``j`` may go into a batch at
    ``j + max_staleness`` at the latest; with one commit per batch, after this batch at most
    ``k * batch_groups`` groups with a last chance at or before ``version + k`` may be left. A batch
    of the ready groups by earliest last chance that would leave more, where a group in flight
    could have been taken instead, waits for it. A group already past its last chance is not
    waited for (no wait saves it), nor an excess that a batch full of earlier ones cannot take."""
    ready_d = sorted(j + max_staleness for j in ready if j + max_staleness >= version)
    flying_d = sorted(j + max_staleness for j in in_flight if j + max_staleness >= version)
    taken = ready_d[:batch_groups]
    urgent = None
    # (Only where a group in flight has its last chance: where none has, the batch either took
    # every ready group up to there, or is full of them, and no wait changes that.)
    for last in sorted(set(flying_d)):
        got = sum(1 for d in taken if d <= last)
        left = sum(1 for d in ready_d if d <= last) + sum(1 for d in flying_d if d <= last) - got
        if left > (last - version) * batch_groups and got < batch_groups:
            urgent = last
    return urgent


def judge_ready(
    ready: Sequence[Group], latest: int, max_staleness: int, stale: StalePolicy
) -> tuple[list[Group], list[Group]]:
    """Rule 6 at consume time, for every ready group at the trainer's version ``latest``: sets
    each group's staleness, and returns those kept and those too stale to train on (in order)."""
    keep: list[Group] = []
    dropped: list[Group] = []
    for group in ready:
        group.staleness = staleness(latest, [group.judged_version])
        group.token_staleness = staleness(latest, [s.version_start for s in group.samples])
        if group.staleness <= max_staleness or on_stale(stale) == "train":
            keep.append(group)
        else:
            dropped.append(group)
    return keep, dropped


def stale_note(group: Group, version: int, action: str) -> Note:
    return Note("loop_group_stale", {"admitted": group.admitted, "version": version,
        "judged_from": group.judged_version, "tokens": group.tokens, "action": action})  # fmt: skip


def pick_batch(ready: list[Group], batch_groups: int) -> list[Group]:
    """Takes up to ``batch_groups`` groups out of ``ready``, by ``next_to_consume``."""
    taken: list[Group] = []
    while ready and len(taken) < batch_groups:
        taken.append(ready.pop(next_to_consume([g.judged_version for g in ready])))
    return taken


def must_wait_for(
    ready: Sequence[Group], in_flight: Iterable[GroupInFlight], version: int, max_staleness: int, batch_groups: int
) -> set[int] | None:
    """Rule 8's wait at ``version``: None (the batch need not wait), or the admission numbers of
    the groups in flight it waits for (each can still be judged from a version whose last chance
    is at or before the one ``wait_for_in_flight`` names)."""
    flying = {g.no: v for g in in_flight if (v := g.oldest_judged()) is not None}
    urgent = wait_for_in_flight(
        [g.judged_version for g in ready], list(flying.values()), version, max_staleness, batch_groups
    )
    if urgent is None:
        return None
    last = urgent - max_staleness
    return {no for no, v in flying.items() if v <= last}
