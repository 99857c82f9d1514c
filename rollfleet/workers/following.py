"""Which committed version a replica moves to next: the pure rules behind ``VersionSync``.

Plain data in, a decision out, time as an argument (monotonic seconds); no I/O.

A version that failed on this replica (its prepare, staging or activation, or at start-up) is
tried again after a backoff, not only when a newer version is committed: many failures are
transient (a shard that was being rewritten, a store that answered an error, a read that timed
out), and a trainer that has stopped publishing would otherwise leave the replica one version
behind for good. The backoff doubles from ``FIRST_RETRY_S`` to ``MAX_RETRY_S`` per failure of
the same version, so a version that is broken for good costs one attempt a minute, and a newer
commit is followed at once, whatever failed before it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

FIRST_RETRY_S = 2.0
MAX_RETRY_S = 60.0


@dataclass(frozen=True, slots=True)
class FailedVersion:
    """A version that failed on this replica: how often in a row, and when it may be tried again."""

    version: int
    failures: int
    retry_at: float  # monotonic seconds


@dataclass(frozen=True, slots=True)
class FollowDecision:
    """``target``: the version to move to now (None: none). ``wake_at``: when to look again
    although nothing was announced (a failed version's retry), None: only on the next notice."""

    target: int | None
    wake_at: float | None = None


def after_failure(
    previous: FailedVersion | None,
    version: int,
    now: float,
    *,
    first_s: float = FIRST_RETRY_S,
    max_s: float = MAX_RETRY_S,
) -> FailedVersion:
    """The record of ``version`` failing at ``now``: one more failure in a row if it is the version
    that failed last, else the first."""
    failures = previous.failures + 1 if previous is not None and previous.version == version else 1
    return FailedVersion(version, failures, now + min(max_s, first_s * 2 ** (failures - 1)))


def follow(latest: int | None, served: int, failed: FailedVersion | None, now: float, *, held: bool) -> FollowDecision:
    """Where to go given the newest commit known (``latest``, None: unknown), the version served,
    the last failure here and the time; ``held``: the replica serves one version and no other."""
    if held or latest is None or latest <= served:
        return FollowDecision(None)
    if failed is not None and latest <= failed.version and now < failed.retry_at:
        return FollowDecision(None, wake_at=failed.retry_at)  # that version failed here lately
    return FollowDecision(latest)


def fallback_versions(present: Iterable[int], latest: int, committed: Iterable[int]) -> list[int]:
    """The versions a replica that cannot serve ``latest`` at start-up tries instead, newest first:
    every one in the store below it (a retired one is not there to try) whose record says it was
    committed. A directory alone is not a version: a publisher killed before its commit leaves a
    complete one (and its record, without the mark) that the fleet must never serve."""
    return sorted({v for v in present if v < latest} & set(committed), reverse=True)
