"""Cancels heard for jobs that did not run here yet, kept a while.

A trainer's cancel is a core-NATS message to every replica, and a job's delivery comes on its
pull consumer's inbox: two subscriptions, each handled by a task of its own, so a cancel sent
just after the delivery can be handled before the delivery has registered its run (campaign seed
2024: a replica frozen as its delivery and the caller's cancel arrived handled the cancel first
on waking, found nothing running, and ran the job to its end for a caller long gone). A cancel
that matched no run is kept for ``ttl_s``; a run registered meanwhile is cancelled before it
starts. Pure: time is an argument, and the book is bounded (anyone may publish a digest)."""

from __future__ import annotations

from collections import OrderedDict

CANCEL_TTL_S = 60.0  # longer than a delivery takes to be handled, shorter than a redelivery's wait
MAX_KEPT = 4096


class RecentCancels:
    def __init__(self, ttl_s: float = CANCEL_TTL_S, max_kept: int = MAX_KEPT) -> None:
        self._ttl_s, self._max_kept = ttl_s, max_kept
        self._heard: OrderedDict[str, float] = OrderedDict()  # claim digest -> when heard, oldest first

    def note(self, claim_digest: str, now: float) -> None:
        """A cancel that matched no run here."""
        self._heard.pop(claim_digest, None)
        self._heard[claim_digest] = now
        self._prune(now)

    def taken(self, claim_digest: str, now: float) -> bool:
        """Whether a cancel for this job was heard within ``ttl_s`` (and forget it)."""
        self._prune(now)
        return self._heard.pop(claim_digest, None) is not None

    def _prune(self, now: float) -> None:
        while self._heard and (
            len(self._heard) > self._max_kept or next(iter(self._heard.values())) < now - self._ttl_s
        ):
            self._heard.popitem(last=False)
