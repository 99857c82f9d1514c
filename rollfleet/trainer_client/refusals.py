"""Saying that a request was refused ``NoCompatibleReplica``: the fleet's control loop cannot see
a request that never reached the broker, and a version nobody serves is exactly what it would
start a held replica for.

One core-NATS message on ``Names.demand_refused_subject`` naming the constraint, at most once a
second per constraint (a client refused in a loop costs the broker one message a second per
version asked for); nothing is stored and nobody replies. With no controller listening the
broker drops it.
"""

from __future__ import annotations

import time
from contextlib import suppress

from rollfleet.broker.types import NATS
from rollfleet.schemas import Names, VersionConstraint
from rollfleet.schemas.bell_wire import bell_payload

NOTE_GAP_S = 1.0


class RefusalNotes:
    def __init__(self, nc: NATS, names: Names) -> None:
        self._nc = nc
        self._subject = names.demand_refused_subject()
        self._last: dict[VersionConstraint, float] = {}

    async def note(self, constraint: VersionConstraint) -> None:
        now = time.monotonic()
        if now - self._last.get(constraint, -NOTE_GAP_S) < NOTE_GAP_S:
            return
        self._last[constraint] = now
        if len(self._last) > 1024:  # (a bound: the oldest notes are forgotten)
            for key, _ in sorted(self._last.items(), key=lambda kv: kv[1])[:512]:
                del self._last[key]
        with suppress(Exception):  # (a note lost with a broker away: the next refusal says it again)
            await self._nc.publish(self._subject, bell_payload(constraint.kind, constraint.version))
