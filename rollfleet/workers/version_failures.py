"""The versions that failed on this replica, and when each may be tried again.

A version fails here when its prepare, staging or activation fails, or when a start could not
serve it. Each is retried after a backoff (``following.after_failure``); what failed at or below
the version served is moot. Plain data and decisions, time as an argument; the follow loop reads
the clock and sets its timer from ``next_retry_above``.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollfleet.workers.version_following import FailedVersion, after_failure, after_late_prepare


def reason_of(exc: BaseException) -> str:
    """An error as a registry reason: its code (typed errors) and its message."""
    return f"{getattr(exc, 'code', type(exc).__name__)}: {exc}"


class VersionFailures:
    """Each version that failed here, and when it may be tried again (``following``); the newest
    of those above the served one is what ``follow`` waits on."""

    def __init__(self) -> None:
        self._by_version: dict[int, FailedVersion] = {}

    @property
    def by_version(self) -> Mapping[int, FailedVersion]:
        return self._by_version

    def failed(self, version: int, now: float) -> FailedVersion:
        """``version`` failed at ``now``: its record, retried after a backoff."""
        record = self._by_version[version] = after_failure(self._by_version.get(version), version, now)
        return record

    def newest_above(self, served: int) -> FailedVersion | None:
        """The newest version above the served one that failed here (what ``follow`` waits on)."""
        above = [f for v, f in self._by_version.items() if v > served]
        return max(above, key=lambda f: f.version, default=None)

    def next_retry_above(self, served: int) -> float | None:
        """The first retry due of a version above the served one (None: none failed)."""
        return min((f.retry_at for f in self._by_version.values() if f.version > served), default=None)

    def cooling(self, version: int, now: float) -> bool:
        """Whether ``version`` failed here lately (its retry is not due at ``now``)."""
        failed = self._by_version.get(version)
        return failed is not None and now < failed.retry_at

    def served(self, version: int) -> None:
        """What failed at or below the version now served is moot; a newer one's retry stands."""
        self._by_version = {v: f for v, f in self._by_version.items() if v > version}

    def materialized_late(self, version: int) -> None:
        """A prepare past its bound returned with ``version`` in the checkpoint after all: a failure
        of that version or an older one is moot (the next prepare continues from it)."""
        self._by_version = {v: f for v, f in self._by_version.items() if after_late_prepare(f, version)}
