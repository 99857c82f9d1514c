"""What the planner looks ahead with, as data: the load's trend (a ramp is one; a step, a burst
or a load wavering about its level is none) and the start-up time learnt from the planner's own
launches (ask to first serving tick), with the policy's default until one was measured."""

from __future__ import annotations

import itertools

import pytest

from rollfleet.autoscale.forecast import KEPT_SAMPLES, LoadHistory, StartupClock, projected_load
from rollfleet.autoscale.signal import LATEST, LAUNCHING, ReplicaFacts

WINDOW = 20.0


def history(loads: list[int], dt: float = 2.0, t0: float = 0.0) -> LoadHistory:
    h = LoadHistory()
    for i, n in enumerate(loads):
        h = h.observe(t0 + i * dt, n, WINDOW)
    return h


# -- the load's trend ------------------------------------------------------------------------


def test_a_ramp_is_a_trend_at_its_slope_and_old_samples_leave_the_window() -> None:
    ramp = history([round(2 + 0.3 * t) for t in range(0, 60, 2)])  # 0.3 jobs/s, rounded to jobs
    assert [t for t, _ in ramp.samples] == [float(t) for t in range(38, 60, 2)]  # (the last 20 s)
    assert ramp.trend(WINDOW) == pytest.approx(0.3, abs=0.06)
    growing_backlog = history([4 + 2 * i for i in range(11)])  # (too few slots: 1 job/s more waits)
    assert growing_backlog.trend(WINDOW) == pytest.approx(1.0)


@pytest.mark.parametrize("at", range(11))
def test_a_step_is_no_trend_wherever_it_falls_in_the_window(at: int) -> None:
    """A burst, or a trickle starting from nothing: the load jumps once and stays. One half of the
    window rises, the other does not: no trend, wherever the jump falls."""
    for low, high in ((0, 2), (10, 50)):
        loads = [low] * at + [high] * (11 - at)
        assert history(loads).trend(WINDOW) == 0.0, loads


def test_a_load_wavering_about_its_level_is_no_trend() -> None:
    """A constant rate's load, as a planner ticking every 2 s sees it: periodic wavers of a job or
    two about its level, in every phase."""
    for period, phase in itertools.product((2, 3, 4, 5, 7), range(7)):
        loads = [10 + ((i + phase) % period) % 3 - 1 for i in range(11)]
        assert history(loads).trend(WINDOW) == 0.0, loads
    assert history([2, 1, 2, 1, 2, 2, 1, 2, 2, 2, 2]).trend(WINDOW) == 0.0  # (a small load's noise)


def test_no_trend_before_each_half_of_the_window_holds_two_samples() -> None:
    assert LoadHistory().trend(WINDOW) == 0.0
    assert history([0, 5, 10]).trend(WINDOW) == 0.0  # (4 s of samples: no older half yet)
    assert history([0, 1, 2, 3, 4, 5, 6]).trend(WINDOW) == 0.0  # (12 s: one more than 10 s old)
    assert history([0, 1, 2, 3, 4, 5, 6, 7]).trend(WINDOW) == pytest.approx(0.5)  # (14 s: two)


def test_the_projection_follows_a_rising_trend_and_never_falls_below_the_load() -> None:
    assert projected_load(10, 0.5, 20.0) == 20.0
    assert projected_load(10, -0.5, 20.0) == 10.0
    assert projected_load(10, 0.5, -1.0) == 10.0


# -- the start-up time ---------------------------------------------------------------------------


def launching(worker_id: str, held: int | None = None, host: str = "") -> ReplicaFacts:
    return ReplicaFacts(worker_id, held=held, state=LAUNCHING, capacity=0, host=host)


def serving(worker_id: str, held: int | None = None, host: str = "") -> ReplicaFacts:
    return ReplicaFacts(worker_id, held=held, state="ready", capacity=4, host=host)


def test_the_start_up_time_is_from_the_plans_ask_to_the_first_serving_tick() -> None:
    clock = StartupClock().see([serving("old")], 0.0, 30.0)
    assert clock.estimate(30.0) == 30.0  # (the configured default until one was measured)
    clock = clock.ask([(LATEST, 2), (3, 1)], 10.0)
    clock = clock.see([serving("old"), launching("a"), launching("h", held=3)], 12.0, 30.0)
    clock = clock.see([serving("old"), launching("a"), ReplicaFacts("h", held=3, state="starting")], 20.0, 30.0)
    assert set(clock.starting) == {"a", "h"} and clock.samples == ()
    assert clock.serving_in([launching("a")], 0, clock.estimate(25.0), 20.0) == 15.0  # (10 + 25 - 20)
    clock = clock.see([serving("old"), serving("a"), serving("h", held=3)], 32.0, 30.0)
    assert clock.samples == (22.0, 22.0) and clock.estimate(30.0) == 22.0 and not clock.starting
    # The second launch of the ask was never seen: forgotten once the ask outlived its time.
    assert [k for k, _ in clock.asked] == [LATEST]
    assert clock.see([serving("old")], 41.0, 30.0).asked == ()


def test_a_replica_nobody_here_asked_for_or_one_that_died_starting_is_not_measured() -> None:
    clock = StartupClock().see([launching("foreign")], 0.0, 30.0)  # (seen, never asked for)
    clock = clock.see([serving("foreign")], 20.0, 30.0)
    assert clock.samples == ()
    clock = clock.ask([(LATEST, 1)], 20.0).see([serving("foreign"), launching("b")], 22.0, 30.0)
    clock = clock.see([serving("foreign")], 30.0, 30.0)  # (it died starting)
    assert clock.samples == () and not clock.starting
    # A replica of another class does not take the ask of this one.
    clock = clock.ask([(3, 1)], 40.0).see([serving("foreign"), launching("c")], 42.0, 30.0)
    assert not clock.starting and len(clock.asked) == 1


def test_a_containers_replica_registered_under_its_own_id_is_found_by_its_host() -> None:
    """The compose and kubernetes drivers know a container by its host name; its worker registers
    as ``<hostname>-<pid>`` (``controller.fleet_of`` matches them by host)."""
    clock = StartupClock().ask([(LATEST, 1)], 0.0).see([launching("rollfleet-worker-3", host="c3")], 2.0, 30.0)
    clock = clock.see([ReplicaFacts("c3-1", state="starting", host="c3")], 10.0, 30.0)
    clock = clock.see([serving("c3-1", host="c3")], 18.0, 30.0)
    assert clock.samples == (18.0,)


def test_the_estimate_is_the_median_of_the_last_measurements() -> None:
    clock, t = StartupClock(), 0.0
    for i, took in enumerate([50.0, 10.0, 20.0, 22.0, 21.0, 19.0, 90.0]):
        clock = clock.ask([(LATEST, 1)], t).see([launching(f"r{i}")], t + 1, 300.0)
        clock = clock.see([serving(f"r{i}")], t + took, 300.0)
        t += 100.0
    assert len(clock.samples) == KEPT_SAMPLES and clock.estimate(30.0) == 21.0


def test_serving_in_is_none_once_a_replica_of_the_class_serves() -> None:
    clock = StartupClock()
    assert clock.serving_in([], 0, 20.0, 0.0) is None
    assert clock.serving_in([], 1, 20.0, 0.0) == 20.0  # (launched by this plan)
    assert clock.serving_in([launching("x")], 0, 20.0, 0.0) == 20.0  # (its launch not seen: the whole time)
    assert clock.serving_in([launching("x"), serving("y")], 1, 20.0, 0.0) is None
    late = StartupClock(starting={"x": (0.0, "")})
    assert late.serving_in([launching("x")], 0, 20.0, 35.0) == 0.0  # (past its time: any moment)
