"""The one retry rule (``runtime.backoff``) and each retry loop's parameters: pure, in milliseconds."""

from __future__ import annotations

import random

import pytest

from rollfleet.broker.startup import STARTUP_RETRY
from rollfleet.broker.topology import TOPOLOGY_RETRY
from rollfleet.integrations.miles import SUBMIT_RETRY
from rollfleet.runtime.backoff import TRANSIENT_RETRY, Backoff
from rollfleet.workers.version_following import VERSION_RETRY


def schedule(policy: Backoff, n: int) -> list[float]:
    return [policy.delay_s(attempt) for attempt in range(n)]


def test_a_pause_doubles_from_the_first_up_to_the_most() -> None:
    assert schedule(Backoff(first_s=1.0, max_s=10.0), 6) == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert schedule(Backoff(first_s=1.0, max_s=100.0, factor=3.0), 5) == [1.0, 3.0, 9.0, 27.0, 81.0]
    assert schedule(Backoff.fixed(0.5), 4) == [0.5] * 4
    assert schedule(Backoff.fixed(0.0), 2) == [0.0, 0.0]


def test_each_retry_loop_keeps_its_schedule() -> None:
    # (the pauses each loop waited before the rule was written once; a change here is a behaviour change)
    assert schedule(TRANSIENT_RETRY, 7) == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]  # broker calls, bucket reads
    assert schedule(SUBMIT_RETRY, 7) == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]  # miles' rollouts
    assert schedule(VERSION_RETRY, 7) == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]  # a version that failed here
    assert schedule(STARTUP_RETRY, 3) == [0.5, 0.5, 0.5]  # a process's start
    assert schedule(TOPOLOGY_RETRY, 3) == [1.0, 1.0, 1.0]  # a look at the namespace


def test_a_loop_that_failed_for_ever_waits_the_most_and_never_raises() -> None:
    # (2.0 ** 1024 does not fit a float: the doubling raised OverflowError on the 1,024th retry)
    policy = Backoff(first_s=0.1, max_s=1.0)
    assert policy.delay_s(1023) == policy.delay_s(1024) == policy.delay_s(10**6) == 1.0
    assert Backoff(first_s=0.0, max_s=0.0).delay_s(5000) == 0.0


def test_retry_at_is_the_pause_after_the_caller_s_now() -> None:
    policy = Backoff(first_s=2.0, max_s=60.0)
    assert policy.retry_at(0, now=100.0) == 102.0
    assert policy.retry_at(3, now=-5.0) == 11.0  # (any clock: monotonic seconds may be negative)


def test_jitter_spreads_pauses_within_its_bounds_from_the_caller_s_random_source() -> None:
    policy = Backoff(first_s=1.0, max_s=8.0, jitter=0.25)
    pauses = [policy.delay_s(3, random.Random(seed)) for seed in range(200)]
    assert all(6.0 <= p < 10.0 for p in pauses) and len(set(pauses)) == 200
    # the same source, the same pauses: a schedule can be replayed
    assert [policy.delay_s(a, random.Random(7)) for a in range(5)] == [
        policy.delay_s(a, random.Random(7)) for a in range(5)
    ]
    with pytest.raises(ValueError, match="random source"):
        policy.delay_s(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"first_s": -1.0, "max_s": 1.0},
        {"first_s": 2.0, "max_s": 1.0},
        {"first_s": float("nan"), "max_s": 1.0},
        {"first_s": 0.1, "max_s": 1.0, "factor": 0.5},
        {"first_s": 0.1, "max_s": 1.0, "jitter": 1.5},
    ],
)
def test_a_schedule_that_makes_no_sense_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_attempts_count_from_zero() -> None:
    with pytest.raises(ValueError):
        TRANSIENT_RETRY.delay_s(-1)
