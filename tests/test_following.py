"""Which version a replica moves to next (``workers.following``): pure rules, in milliseconds."""

from __future__ import annotations

import pytest

from rollfleet.workers.following import (
    FIRST_RETRY_S,
    MAX_RETRY_S,
    FailedVersion,
    FollowDecision,
    after_failure,
    fallback_versions,
    follow,
)


def test_failures_of_one_version_back_off_doubling_up_to_the_cap() -> None:
    failed, waits = None, []
    for _ in range(10):
        failed = after_failure(failed, 5, 100.0)
        waits.append(failed.retry_at - 100.0)
    assert waits[:4] == [FIRST_RETRY_S, 2 * FIRST_RETRY_S, 4 * FIRST_RETRY_S, 8 * FIRST_RETRY_S]
    assert max(waits) == MAX_RETRY_S and waits[-1] == MAX_RETRY_S
    assert failed is not None and failed.failures == 10


def test_another_version_failing_starts_the_backoff_again() -> None:
    failed = after_failure(after_failure(None, 5, 0.0), 5, 1.0)
    assert failed.failures == 2
    assert after_failure(failed, 6, 10.0) == FailedVersion(6, 1, 10.0 + FIRST_RETRY_S)


@pytest.mark.parametrize(
    ("latest", "served", "failed", "now", "held", "expected"),
    [
        (None, 3, None, 0.0, False, FollowDecision(None)),  # latest not known
        (3, 3, None, 0.0, False, FollowDecision(None)),  # served already
        (2, 3, None, 0.0, False, FollowDecision(None)),  # never backwards
        (4, 3, None, 0.0, False, FollowDecision(4)),
        (4, 3, None, 0.0, True, FollowDecision(None)),  # held at its version
        (4, 3, FailedVersion(4, 1, 10.0), 5.0, False, FollowDecision(None, wake_at=10.0)),  # backing off
        (4, 3, FailedVersion(4, 1, 10.0), 10.0, False, FollowDecision(4)),  # its retry is due
        (5, 3, FailedVersion(4, 3, 60.0), 5.0, False, FollowDecision(5)),  # a newer commit: at once
        (4, 3, FailedVersion(5, 1, 60.0), 5.0, False, FollowDecision(None, wake_at=60.0)),  # (newer failed)
    ],
)
def test_follow(
    latest: int | None, served: int, failed: FailedVersion | None, now: float, held: bool, expected: FollowDecision
) -> None:
    assert follow(latest, served, failed, now, held=held) == expected


def test_fallback_versions_are_older_committed_ones_newest_first() -> None:
    assert fallback_versions([0, 3, 1, 5, 3], 4, committed=[0, 1, 3, 5]) == [3, 1, 0]
    assert fallback_versions([4], 4, committed=[4]) == []
    # v3's directory is complete, but its publisher was killed before the commit: never served
    assert fallback_versions([0, 1, 2, 3], 4, committed=[0, 1, 2]) == [2, 1, 0]
