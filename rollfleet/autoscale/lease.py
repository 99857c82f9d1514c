"""One controller acting at a time: a lease on the broker (the fleet bucket's ``autoscaler.lease``).

The holder rewrites the key every ``ttl_s / 3`` with a compare-and-set on the revision it wrote
last; a write refused means another took the lease, and the holder stops acting at once. A
contender reads the key as often: a revision that has not changed for ``ttl_s`` *on the
contender's own clock* is a holder gone, and the contender takes the lease with a compare-and-set
on that revision (of two contenders, one wins). No clock is compared with another's: a skewed
holder is never taken for dead while it renews, and a holder that cannot renew (paused, cut off,
its broker away) stops acting after ``ttl_s / 2`` without a renewal on its own clock, before any
contender could take over (which needs ``ttl_s`` of silence after the last renewal it saw).

The rules are pure (``contend``, ``may_act``, ``renew_due``); ``BrokerLease`` reads and writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from rollfleet.broker.buckets import KVBucket
from rollfleet.broker.types import KeyValue
from rollfleet.schemas import Names
from rollfleet.schemas.errors import BrokerError, Fenced

LEASE_KEY = Names.AUTOSCALER_LEASE_KEY
DEFAULT_TTL_S = 10.0

Move = Literal["create", "take", "wait"]


@dataclass(frozen=True)
class Seen:
    """What a contender knows of the lease: the revision last read and since when (its clock)."""

    revision: int | None = None
    since: float = 0.0


def contend(seen: Seen, revision: int | None, now: float, ttl_s: float) -> tuple[Seen, Move]:
    """A contender's move after reading the key (``revision`` None: no lease)."""
    if revision is None:
        return Seen(None, now), "create"
    if revision != seen.revision:
        return Seen(revision, now), "wait"  # the holder renewed (or a new one took it)
    return seen, "take" if now - seen.since >= ttl_s else "wait"


def renew_due(renewed_at: float, now: float, ttl_s: float) -> bool:
    return now - renewed_at >= ttl_s / 3


def may_act(renewed_at: float, now: float, ttl_s: float) -> bool:
    """The holder acts only within half a lifetime of its last renewal (see the module's note)."""
    return now - renewed_at < ttl_s / 2


class BrokerLease:
    def __init__(self, kv: KeyValue, holder: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._kv, self.holder, self.ttl_s = KVBucket(kv), holder, ttl_s
        self._seen = Seen()
        self._revision: int | None = None  # the revision this holder wrote last (None: not holding)
        self._renewed_at = -1e18

    @property
    def holding(self) -> bool:
        return self._revision is not None and may_act(self._renewed_at, time.monotonic(), self.ttl_s)

    async def step(self) -> bool:
        """Renew, or contend, once; whether this process holds the lease now."""
        now = time.monotonic()
        value = f"{self.holder}".encode()
        try:
            if self._revision is not None:
                if not renew_due(self._renewed_at, now, self.ttl_s):
                    return self.holding
                try:
                    self._revision = await self._kv.update(LEASE_KEY, value, self._revision)
                    self._renewed_at = now
                except Fenced:
                    self._revision = None  # another took it: stop acting at once
                return self.holding
            entry = await self._kv.read(LEASE_KEY)
            revision = None if entry is None else entry.revision
            self._seen, move = contend(self._seen, revision, now, self.ttl_s)
            try:
                if move == "create":
                    self._revision = await self._kv.create(LEASE_KEY, value)
                elif move == "take":
                    assert revision is not None  # (``contend`` takes only a lease it saw)
                    self._revision = await self._kv.update(LEASE_KEY, value, revision)
                else:
                    return False
            except Fenced:
                return False  # another contender won
            self._renewed_at = now
            return True
        except (BrokerError, TimeoutError, OSError):
            return self.holding  # the broker did not answer: act only within the half lifetime

    async def holder_now(self) -> str | None:
        entry = await self._kv.read(LEASE_KEY)
        return None if entry is None else entry.value.decode(errors="replace") or None

    async def release(self) -> None:
        """Give the lease up (a clean stop): a waiting controller takes it at its next look."""
        if self._revision is not None:
            try:
                await self._kv.delete(LEASE_KEY, self._revision)
            except Exception:
                pass  # (taken meanwhile, or the broker away: it lapses)
            self._revision = None
