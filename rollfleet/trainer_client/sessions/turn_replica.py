"""Which replica a session's turn is sent to.

The previous turn's replica (its context is cached there) while it is live and can take the
turn; otherwise, or for a session's first turn, the able replica holding the fewest of this
client's sessions, so sessions spread evenly and stay spread (a first turn left to the pulls
lands wherever slots were free at that instant). When no replica can take it now, none: the
turn goes to the shared subjects. When a turn sent to a replica moves off it: ``sticky``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

from rollfleet.schemas import VersionConstraint
from rollfleet.trainer_client.fleet import FleetView


def turn_replica(
    fleet: FleetView, previous: str | None, constraint: VersionConstraint, held: Callable[[], Counter[str | None]]
) -> str | None:
    """The replica to send the turn to: ``previous`` (the previous turn's), while live and able;
    else the able replica holding the fewest sessions (``held``: the client's other sessions by
    where they are placed, counted only then); None for the shared subjects."""
    if previous is not None:
        status = fleet.replica(previous)
        if status is not None and status.takes_now(constraint):
            return previous
    able = [r.worker_id for r in fleet.compatible(constraint) if r.takes_now(constraint)]
    if not able:
        return None  # the shared subjects: whichever replica activates a compatible version
    return fewest_held(able, held())


def fewest_held(able: list[str], held: Counter[str | None], rng: random.Random | None = None) -> str:
    """The able replica holding the fewest sessions (placed or heading there), ties broken at
    random so that concurrent clients do not all pick the same one."""
    draw = (rng or random).random
    return min(able, key=lambda w: (held[w], draw()))
