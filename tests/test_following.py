"""Which version a replica moves to next (``workers.following``): pure rules, in milliseconds."""

from __future__ import annotations

import pytest

from rollfleet.workers.version_following import (
    FIRST_RETRY_S,
    MAX_RETRY_S,
    FailedVersion,
    FollowDecision,
    StartStep,
    after_failure,
    after_late_prepare,
    fallback_versions,
    follow,
    start_step,
)


def test_failures_of_one_version_back_off_doubling_up_to_the_cap() -> None:
    failed, waits = None, []
    for _ in range(10):
        failed = after_failure(failed, 5, 100.0)
        waits.append(failed.retry_at - 100.0)
    assert waits[:4] == [FIRST_RETRY_S, 2 * FIRST_RETRY_S, 4 * FIRST_RETRY_S, 8 * FIRST_RETRY_S]
    assert max(waits) == MAX_RETRY_S and waits[-1] == MAX_RETRY_S
    assert failed is not None and failed.failures == 10


def test_a_version_broken_for_good_is_tried_once_a_minute_forever() -> None:
    # A version that never materializes is tried once a minute: its 1,024th failure in a row
    # (about 17 hours) raised OverflowError in the doubling, and the follow loop with it.
    failed = None
    for i in range(1100):
        failed = after_failure(failed, 5, float(i))
    assert failed is not None and failed.failures == 1100
    assert failed.retry_at - 1099.0 == MAX_RETRY_S


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


def test_a_prepare_still_running_here_is_waited_for_not_retried_over() -> None:
    """While a prepare abandoned past its bound still holds the checkpoint, a newer commit or a
    due retry waits for it (its return wakes the loop) instead of failing, and backing off, once
    per look: its work is kept and the next prepare continues from it."""
    assert follow(5, 3, None, 0.0, held=False, busy=True) == FollowDecision(None)
    assert follow(5, 3, FailedVersion(4, 1, 1.0), 9.0, held=False, busy=True) == FollowDecision(None)
    assert follow(5, 3, None, 0.0, held=False, busy=False) == FollowDecision(5)


def test_a_late_prepare_that_succeeds_clears_the_failure_it_was_counted_as() -> None:
    failed = FailedVersion(7, 3, 100.0)
    assert after_late_prepare(failed, 7) is None  # materialized after all: followed at once
    assert after_late_prepare(failed, 8) is None  # (a newer one holds every older one's tensors)
    assert after_late_prepare(failed, 6) == failed  # an older one says nothing of version 7
    assert after_late_prepare(None, 6) is None


@pytest.mark.parametrize(
    ("latest", "older", "attempts", "free", "expected"),
    [
        (7, None, {}, 2, StartStep("try", 7)),  # the latest first, in its own directory
        (7, None, {7: "running"}, 1, StartStep("wait")),  # within its bound: given its time
        (7, None, {7: "done"}, 1, StartStep("serve", 7)),
        (7, None, {7: "failed"}, 2, StartStep("list")),  # what to fall back to, once
        (7, None, {7: "stuck"}, 1, StartStep("list")),
        (7, [6, 4], {7: "failed"}, 2, StartStep("try", 6)),
        # Stuck in a read: the next older one is tried in the other directory, not refused (the
        # adversary's seed 747109: every older version refused, and the worker exited 2).
        (7, [6, 4], {7: "stuck"}, 1, StartStep("try", 6)),
        (7, [6, 4], {7: "stuck", 6: "failed"}, 1, StartStep("try", 4)),
        (7, [6, 4], {7: "stuck", 6: "stuck"}, 0, StartStep("wait")),  # slow reads: wait for either
        (7, [6, 4], {7: "stuck", 6: "failed", 4: "failed"}, 1, StartStep("wait")),  # the latest may yet return
        (7, [6, 4], {7: "stuck", 6: "done"}, 0, StartStep("serve", 6)),  # serve now, follow later
        (7, [6, 4], {7: "done", 6: "done"}, 2, StartStep("serve", 7)),
        (7, [6, 4], {7: "failed", 6: "failed", 4: "failed"}, 2, StartStep("give_up")),  # nothing ever can be
        (7, [], {7: "stuck"}, 1, StartStep("wait")),  # held (no fallback): waits for its version
        (7, [], {7: "failed"}, 2, StartStep("give_up")),
    ],
)
def test_start_step(
    latest: int, older: list[int] | None, attempts: dict[int, str], free: int, expected: StartStep
) -> None:
    assert start_step(latest, older, attempts, free) == expected  # type: ignore[arg-type]


def test_a_start_that_serves_nothing_ends_only_when_every_version_failed() -> None:
    """Walked through every order of outcomes: a start gives up only when no attempt is left
    running, stuck or untried, and never tries a version twice or one outside its candidates."""
    import itertools

    latest, older = 3, [2, 1, 0]
    for outcomes in itertools.product(("done", "failed", "stuck"), repeat=4):
        attempts: dict[int, str] = {}
        tried: list[int] = []
        listed: list[int] | None = None
        for _ in range(20):
            busy = sum(1 for a in attempts.values() if a in ("running", "stuck"))
            step = start_step(latest, listed, attempts, max(0, 2 - busy))  # type: ignore[arg-type]
            if step.action == "list":
                listed = older
            elif step.action == "try":
                assert step.version is not None and step.version not in tried
                tried.append(step.version)
                attempts[step.version] = outcomes[[latest, *older].index(step.version)]
            else:
                break
        ok = [v for v, a in attempts.items() if a == "done"]
        if ok:
            assert step == StartStep("serve", max(ok))
        elif step.action == "give_up":
            assert set(attempts) == {latest, *older} and set(attempts.values()) == {"failed"}
        else:
            assert step.action == "wait" and "stuck" in attempts.values()


def test_fallback_versions_are_older_committed_ones_newest_first() -> None:
    assert fallback_versions([0, 3, 1, 5, 3], 4, committed=[0, 1, 3, 5]) == [3, 1, 0]
    assert fallback_versions([4], 4, committed=[4]) == []
    # v3's directory is complete, but its publisher was killed before the commit: never served
    assert fallback_versions([0, 1, 2, 3], 4, committed=[0, 1, 2]) == [2, 1, 0]


def test_a_failed_newest_version_is_waited_for_at_the_newest_version_below_it_that_has_not_failed() -> None:
    """``fall_back_to``: while the newest commit has failed here lately, the newest committed
    version between the served one and it that has not failed lately; none when every one has,
    or none lies between (seed 366222: replicas at v13 while v19 and v20 were whole)."""
    from rollfleet.workers.version_following import fall_back_to

    failures = {23: FailedVersion(23, 1, 50.0), 22: FailedVersion(22, 1, 48.0), 21: FailedVersion(21, 2, 60.0)}
    older = [22, 21, 20, 19, 13, 12]  # (``fallback_versions``: committed, in the store, newest first)
    assert fall_back_to(older, 13, failures, now=45.0) == 20  # 22 and 21 failed lately
    assert fall_back_to(older, 13, failures, now=48.0) == 22  # 22's retry is due: it may be tried
    assert fall_back_to(older, 20, failures, now=45.0) is None  # nothing newer than 20 left to try
    assert fall_back_to([], 13, failures, now=45.0) is None
    assert fall_back_to([12, 11], 13, {}, now=0.0) is None  # (never back below the served version)
