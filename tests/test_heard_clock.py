"""A replica's heartbeat judged on the reader's clock: the pure rule (``heartbeat_on_readers_clock``)."""

from __future__ import annotations

import math

from rollfleet.schemas import HeardClock, heartbeat_on_readers_clock

STARTED = 1000.0


def test_a_clock_behind_is_learnt_from_the_first_heartbeat_heard_live() -> None:
    # The replica's clock is 50 s behind; transit 0.25 s.
    when, known = heartbeat_on_readers_clock(HeardClock(), STARTED, 100.0, 150.25, live=True)
    assert when == 150.25 and known == HeardClock(STARTED, 50.25)
    # A later beat, held up 3 s on the way (a partition that healed), counts from when it was made.
    when, known = heartbeat_on_readers_clock(known, STARTED, 110.0, 163.25, live=True)
    assert math.isclose(when, 160.25) and known.offset == 50.25


def test_the_smallest_gap_wins_and_a_snapshot_uses_it() -> None:
    known = HeardClock(STARTED, 5.0)
    _, known = heartbeat_on_readers_clock(known, STARTED, 100.0, 102.0, live=True)
    assert known.offset == 2.0
    when, after = heartbeat_on_readers_clock(known, STARTED, 120.0, 500.0, live=False)
    assert when == 122.0 and after == known  # a snapshot teaches nothing


def test_a_snapshot_of_an_unknown_clock_counts_from_no_later_than_now() -> None:
    assert heartbeat_on_readers_clock(HeardClock(), STARTED, 900.0, 100.0, live=False)[0] == 100.0  # ahead
    assert heartbeat_on_readers_clock(HeardClock(), STARTED, 90.0, 100.0, live=False)[0] == 90.0  # behind


def test_another_process_under_the_id_has_its_own_clock() -> None:
    known = HeardClock(STARTED, 50.0)
    when, after = heartbeat_on_readers_clock(known, STARTED + 1, 100.0, 500.0, live=False)
    assert when == 100.0 and after == known  # the old offset is not applied
    when, after = heartbeat_on_readers_clock(known, STARTED + 1, 100.0, 100.5, live=True)
    assert when == 100.5 and after == HeardClock(STARTED + 1, 0.5)
