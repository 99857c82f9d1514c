"""The autoscaler's pure core as data: the demand signal sorted into classes, and the plan.

Exhaustive where the space is small (one class, every size, load, bound and timer state),
properties where it is large (random fleets, signals and signal sequences run in a closed loop:
the plan's launches join the fleet, its retirements leave it, replicas die at random)."""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollfleet.autoscale.forecast import LoadHistory
from rollfleet.autoscale.planner import ClassState, Plan, PlannerState, Policy, plan
from rollfleet.autoscale.signal import (
    LATEST,
    LAUNCHING,
    ClassDemand,
    ReplicaFacts,
    Signal,
    SubjectLoad,
    class_of_version,
    demand_signal,
    with_own_pending,
)
from rollfleet.schemas.errors import InvalidRequest

NOW = 1000.0


def ready(worker_id: str, version: int = 5, held: int | None = None, **kw: object) -> ReplicaFacts:
    return ReplicaFacts(worker_id=worker_id, held=held, active_version=version, **kw)  # type: ignore[arg-type]


# -- the signal ------------------------------------------------------------------------------


def test_min_jobs_are_latest_demand_and_old_exact_jobs_are_their_versions():
    fleet = [ready("a", 5, capacity=4, in_flight=1), ready("h3", 3, held=3, capacity=2)]
    subjects = {
        ("min", 4): SubjectLoad(pending=3, in_flight=1, oldest_at=NOW - 7),
        ("min", 5): SubjectLoad(pending=2, oldest_at=NOW - 2),
        ("exact", 5): SubjectLoad(pending=1, oldest_at=NOW - 1),
        ("exact", 3): SubjectLoad(pending=4, in_flight=2, oldest_at=NOW - 30),
        ("exact", 1): SubjectLoad(pending=1, oldest_at=NOW - 3),
    }
    s = demand_signal(5, subjects, fleet, NOW, pinned={3: 2, 5: 1, 0: 1}, refusals={("exact", 2): 3})
    assert s.demand(LATEST) == ClassDemand(backlog=6, in_flight=1, oldest_wait_s=7, sessions=1, slots=4, busy=1)
    assert s.demand(3) == ClassDemand(backlog=4, in_flight=2, oldest_wait_s=30, sessions=2, slots=2)
    assert s.demand(1) == ClassDemand(backlog=1, oldest_wait_s=3)
    assert s.demand(0) == ClassDemand(sessions=1)
    assert s.demand(2) == ClassDemand(refusals=3)


def test_jobs_waiting_out_an_activation_are_no_backlog():
    """Every follower still at 4 preparing 5: min-5 and exact-5 jobs wait for the activation, not
    for more replicas (KEDA's lag counts them); min-4 jobs are taken now."""
    fleet = [ready("a", 4, preparing_version=5, state="preparing"), ready("b", 4, preparing_version=5)]
    subjects = {
        ("min", 5): SubjectLoad(pending=7, oldest_at=NOW - 50),
        ("exact", 5): SubjectLoad(pending=2, oldest_at=NOW - 50),
        ("min", 4): SubjectLoad(pending=1, oldest_at=NOW - 1),
    }
    s = demand_signal(5, subjects, fleet, NOW)
    assert s.demand(LATEST) == ClassDemand(backlog=1, oldest_wait_s=1, awaiting_activation=9, slots=8)
    once_active = [replace(r, active_version=5, preparing_version=None) for r in fleet]
    assert demand_signal(5, subjects, once_active, NOW).demand(LATEST).backlog == 10


def test_a_sessions_own_subject_counts_for_its_replicas_class():
    fleet = [ready("a", 5), ready("h", 3, held=3)]
    subjects = {
        ("replica", "h"): SubjectLoad(pending=2, oldest_at=NOW - 4),
        ("replica", "a"): SubjectLoad(in_flight=1),
        ("replica", "gone"): SubjectLoad(pending=9, oldest_at=NOW - 99),
    }
    s = demand_signal(5, subjects, fleet, NOW)
    assert s.demand(3).backlog == 2 and s.demand(3).oldest_wait_s == 4
    assert s.demand(LATEST).in_flight == 1 and s.demand(LATEST).backlog == 0
    assert [r.own_pending for r in with_own_pending(fleet, subjects)] == [1, 2]


@pytest.mark.parametrize("latest", [None, 0, 1, 2, 3])
def test_every_subject_lands_in_exactly_one_class(latest):
    """Exhaustive over versions 0..3: each job counted once, in the class the rule names."""
    for kind in ("min", "exact"):
        for version in range(4):
            s = demand_signal(latest, {(kind, version): SubjectLoad(pending=1, oldest_at=NOW)}, [], NOW)
            where = [k for k, d in s.classes.items() if d.backlog]
            expected = LATEST if kind == "min" else class_of_version(version, latest)
            assert where == [expected], (kind, version, latest)


# -- policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [{"min_replicas": 3, "max_replicas": 2}, {"max_replicas": 0, "min_replicas": 0}, {"hysteresis": 1.0},
     {"target_utilization": 0}, {"cooldown_s": -1}, {"slots_per_replica": 0}],
)  # fmt: skip
def test_a_policy_out_of_range_is_refused(fields):
    with pytest.raises(InvalidRequest):
        Policy(**fields)


# -- one class, exhaustively -----------------------------------------------------------------


def _followers(n: int, capacity: int = 2, busy: int = 0) -> list[ReplicaFacts]:
    return [ready(f"f{i}", 5, capacity=capacity, in_flight=min(busy, capacity), started_at=i) for i in range(n)]


def _size_after(p: Plan, fleet: list[ReplicaFacts]) -> int:
    return sum(r.counted for r in fleet) - len(p.retire) + sum(x.count for x in p.launch)


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 3), (1, 1), (1, 3), (2, 3)])
def test_followers_exhaustively(lo, hi):
    """Every size 0..4 and load 0..8 on 2-slot replicas, with a fresh state (nothing may shrink
    before the grace) and with the grace spent: the target is the rule's, within the bounds."""
    policy = Policy(min_replicas=lo, max_replicas=hi, slots_per_replica=2, hysteresis=0.5, scale_in_grace_s=60)
    for actual in range(5):
        for load in range(9):
            fleet = _followers(actual)
            signal = Signal(5, {LATEST: ClassDemand(backlog=load)} if load else {})
            floor = max(lo, 1 if load else 0)
            up = math.ceil(load / 2)
            fits = math.ceil(load / 1)  # (the hysteresis: a shrink keeps load at half the slots)
            fresh = plan(signal, fleet, policy, PlannerState(), NOW)
            grown = min(max(up, floor), hi) if up > actual else min(max(actual, lo), hi)
            assert fresh.desired[LATEST] == grown, (actual, load)
            waited = PlannerState({LATEST: ClassState(desired=actual, lower_since=NOW - 60, lower_peak=0)})
            later = plan(signal, fleet, policy, waited, NOW)
            shrunk = min(max(max(fits, floor), lo), hi) if max(fits, floor) < actual else grown
            assert later.desired[LATEST] == (grown if up > actual else shrunk), (actual, load)
            for p in (fresh, later):
                assert lo <= p.desired[LATEST] <= hi
                assert _size_after(p, fleet) <= max(hi, actual)
                assert len(p.retire) == max(0, actual - p.desired[LATEST])


def test_a_job_waiting_too_long_adds_one_replica_unless_one_is_starting():
    policy = Policy(max_replicas=5, slots_per_replica=4, target_wait_s=10)
    slow = Signal(5, {LATEST: ClassDemand(backlog=1, in_flight=3, oldest_wait_s=11)})
    fleet = _followers(1, capacity=4, busy=3)
    assert plan(slow, fleet, policy, PlannerState(), NOW).desired[LATEST] == 2
    starting = [*fleet, ReplicaFacts("new", state=LAUNCHING)]
    assert plan(slow, starting, policy, PlannerState({LATEST: ClassState(desired=2)}), NOW).desired[LATEST] == 2


def test_retiring_takes_idle_first_then_busy_then_sessions_never_foreign_ones():
    fleet = [
        ready("sess", 5, sessions=2, started_at=1),
        ready("busy2", 5, in_flight=2, started_at=2),
        ready("busy1", 5, in_flight=1, started_at=3),
        ready("idle-old", 5, started_at=4),
        ready("idle-new", 5, started_at=5),
        ready("foreign", 5, managed=False, started_at=6),
        ReplicaFacts("launching", state=LAUNCHING, started_at=0),
    ]
    policy = Policy(min_replicas=0, max_replicas=10, scale_in_grace_s=0, hysteresis=0)
    signal = Signal(5, {LATEST: ClassDemand(in_flight=3)})  # needs 1 replica of 4 slots
    p = plan(signal, fleet, policy, PlannerState(), NOW)
    assert p.retire == ("launching", "idle-new", "idle-old", "busy1", "busy2", "sess")
    reasons = {d.worker_id: d.reason for d in p.decisions if d.action == "retire"}
    assert reasons["busy2"] == "busy: drains 2 jobs" and reasons["sess"] == "holds live sessions"


# -- held versions ---------------------------------------------------------------------------


def test_an_old_version_in_demand_gets_a_held_replica_after_hold_after_s_at_once_after_a_refusal():
    policy = Policy(min_replicas=1, max_replicas=4, hold_after_s=5)
    fleet = _followers(1)
    exact = Signal(9, {3: ClassDemand(backlog=2, oldest_wait_s=1)})
    first = plan(exact, fleet, policy, PlannerState(), NOW)
    assert first.launch == ()
    later = plan(exact, fleet, policy, first.state, NOW + 5)
    assert [(x.held, x.count) for x in later.launch] == [(3, 1)]
    refused = Signal(9, {3: ClassDemand(refusals=1)})
    assert [(x.held, x.count) for x in plan(refused, fleet, policy, PlannerState(), NOW).launch] == [(3, 1)]


def test_a_version_the_store_lost_is_said_once_and_never_launched():
    policy = Policy(hold_after_s=0)
    gone = Signal(9, {3: ClassDemand(refusals=2, sessions=1)}, unavailable=frozenset({3}))
    p = plan(gone, _followers(1), policy, PlannerState(), NOW)
    assert p.launch == ()
    said = [d for d in p.decisions if d.action == "unavailable"]
    assert len(said) == 1 and "retention" in said[0].reason
    again = plan(gone, _followers(1), policy, p.state, NOW + 1)
    assert not [d for d in again.decisions if d.action == "unavailable"]


def test_a_version_the_store_cannot_read_keeps_the_replicas_that_hold_it():
    """A version's directory unreadable for a moment (a flaky mount) reads as a version the store
    lost: no replica is started there, but one already holding it serves from memory and is kept
    while its version has demand (the only serving copy of it)."""
    policy = Policy(hold_after_s=0)
    lost = Signal(9, {3: ClassDemand(backlog=2)}, unavailable=frozenset({3}))
    fleet = [*_followers(1), ready("h3", 3, held=3)]
    p = plan(lost, fleet, policy, PlannerState(), NOW)
    assert (p.retire, p.launch) == ((), ())
    later = plan(lost, fleet, policy, p.state, NOW + 120)
    assert (later.retire, later.launch) == ((), ())


def test_a_version_never_committed_is_never_held_and_a_replica_held_there_goes():
    """A publisher killed between a version's record and the compare-and-set of ``latest`` leaves a
    whole directory and a record without the commit mark. A request refused for that version (a
    gateway's caller asking for the next one, before it was given up) must not get a replica held
    there: it would serve weights the trainer never committed (the adversary, seed 10 with
    ``--autoscale 3:5``: v2's publisher SIGKILLed at ``commit:before-cas``, a replica held at v2
    answered min jobs labelled v2)."""
    policy = Policy(hold_after_s=0)
    never = Signal(9, {2: ClassDemand(refusals=1, in_flight=1)}, never_committed=frozenset({2}))
    p = plan(never, _followers(1), policy, PlannerState(), NOW)
    assert p.launch == ()
    [said] = [d for d in p.decisions if d.action == "unavailable"]
    assert "never committed" in said.reason
    held = [*_followers(1), ready("h2", 2, held=2, in_flight=1)]  # (held there by an earlier controller)
    assert plan(never, held, policy, PlannerState(), NOW).retire == ("h2",)


def test_a_held_replica_is_released_after_the_grace_once_demand_ends():
    policy = Policy(hold_after_s=0, scale_in_grace_s=60, cooldown_s=10)
    fleet = [*_followers(1), ready("h3", 3, held=3)]
    p = plan(Signal(9, {}), fleet, policy, PlannerState(), NOW)
    assert p.retire == ()
    p = plan(Signal(9, {}), fleet, policy, p.state, NOW + 60)
    assert p.retire == ("h3",)


def test_the_only_serving_copy_of_a_version_in_demand_is_never_retired():
    """Version 3 has demand; the held replica is the only one at 3 while the other is starting:
    over the per-version bound, the starting one goes, the serving one stays."""
    policy = Policy(max_per_version=1, hold_after_s=0, scale_in_grace_s=0, hysteresis=0)
    fleet = [*_followers(1), ready("h3", 3, held=3, started_at=1), ready("h3b", 3, held=3, state="starting")]
    p = plan(Signal(9, {3: ClassDemand(sessions=1)}), fleet, policy, PlannerState(), NOW)
    assert p.retire == ("h3b",)
    only = [*_followers(1), ready("h3", 3, held=3, in_flight=1)]
    state = PlannerState({3: ClassState(desired=0)})  # (a target already at 0: it must still stay)
    assert plan(Signal(9, {3: ClassDemand(in_flight=1)}), only, policy, state, NOW).retire == ()


def test_the_bound_holds_when_held_versions_and_followers_compete():
    """Followers at max and a pinned evaluation of version 3 arrives: the followers give one
    replica back (after their cooldown), and the held one starts only into room that exists."""
    policy = Policy(min_replicas=1, max_replicas=3, hold_after_s=0, cooldown_s=30, scale_in_grace_s=999)
    fleet = _followers(3, capacity=2, busy=2)
    busy = ClassDemand(backlog=10, in_flight=6)
    up = PlannerState({LATEST: ClassState(desired=3, direction=1, changed_at=NOW - 5)})
    signal = Signal(9, {LATEST: busy, 3: ClassDemand(sessions=1)})
    p = plan(signal, fleet, policy, up, NOW)
    assert p.retire == () and p.launch == () and _size_after(p, fleet) == 3
    assert any(d.action == "waits" and d.klass == 3 for d in p.decisions)
    p = plan(signal, fleet, policy, up, NOW + 25)
    assert p.desired[LATEST] == 2 and len(p.retire) == 1
    assert [(x.held, x.count) for x in p.launch] == [(3, 1)] and _size_after(p, fleet) == 3


# -- properties ------------------------------------------------------------------------------

_demands = st.builds(
    ClassDemand,
    backlog=st.integers(0, 40),
    in_flight=st.integers(0, 20),
    oldest_wait_s=st.floats(0, 60),
    awaiting_activation=st.integers(0, 3),
    sessions=st.integers(0, 3),
    refusals=st.integers(0, 2),
)


@st.composite
def _signals(draw: st.DrawFn) -> Signal:
    classes: dict[object, ClassDemand] = {}
    if draw(st.booleans()):
        classes[LATEST] = draw(_demands)
    for v in draw(st.sets(st.integers(0, 8), max_size=3)):
        classes[v] = draw(_demands)
    unavailable = draw(st.sets(st.integers(0, 8), max_size=2))
    return Signal(9, classes, unavailable=frozenset(unavailable))  # type: ignore[arg-type]


@st.composite
def _policies(draw: st.DrawFn) -> Policy:
    lo = draw(st.integers(0, 3))
    return Policy(
        min_replicas=lo,
        max_replicas=draw(st.integers(max(lo, 1), 8)),
        slots_per_replica=draw(st.integers(1, 4)),
        hysteresis=draw(st.sampled_from([0.0, 0.25, 0.5])),
        cooldown_s=draw(st.sampled_from([0.0, 10.0, 30.0])),
        scale_in_grace_s=draw(st.sampled_from([0.0, 10.0, 60.0])),
        hold_after_s=draw(st.sampled_from([0.0, 5.0])),
        max_per_version=draw(st.integers(0, 2)),
        target_wait_s=draw(st.sampled_from([1.0, 10.0])),
    )


@st.composite
def _fleets(draw: st.DrawFn, policy: Policy) -> list[ReplicaFacts]:
    n = draw(st.integers(0, policy.max_replicas))
    out = []
    for i in range(n):
        held = draw(st.one_of(st.none(), st.integers(0, 8)))
        out.append(
            ReplicaFacts(
                worker_id=f"r{i}",
                held=held,
                active_version=draw(st.integers(0, 9)) if held is None else held,
                state=draw(st.sampled_from(["ready", "ready", "starting", LAUNCHING, "down", "draining"])),
                capacity=draw(st.integers(1, 4)),
                in_flight=draw(st.integers(0, 4)),
                sessions=draw(st.integers(0, 1)),
                managed=draw(st.booleans()),
                started_at=float(i),
            )
        )
    return out


def _demanded(signal: Signal) -> set[int]:
    versions = {int(k) for k, d in signal.classes.items() if k != LATEST and d.wanted}
    if signal.demand(LATEST).wanted:
        versions.add(9)
    return versions


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_plan_keeps_the_bounds_and_every_demanded_versions_last_copy(data):
    policy = data.draw(_policies())
    fleet = data.draw(_fleets(policy))
    signal = data.draw(_signals())
    p = plan(signal, fleet, policy, PlannerState(), NOW)
    before = sum(r.counted for r in fleet)
    assert _size_after(p, fleet) <= max(policy.max_replicas, before)
    assert policy.min_replicas <= p.desired[LATEST]
    assert _size_after(p, fleet) >= policy.min_replicas
    assert len(set(p.retire)) == len(p.retire)
    gone = set(p.retire)
    for w in p.retire:
        r = next(r for r in fleet if r.worker_id == w)
        assert r.managed and r.counted
        if r.serving and not r.coming and r.active_version in _demanded(signal):
            assert any(
                o.worker_id not in gone and o.counted and o.serving and not o.coming
                and o.active_version == r.active_version
                for o in fleet
            ), (w, p.retire)  # fmt: skip
    for x in p.launch:
        assert x.count > 0 and (x.held is None or x.held not in signal.unavailable)


def _carry_out(
    fleet: list[ReplicaFacts], p: Plan, n: int, capacity: int, latest: int = 9
) -> tuple[list[ReplicaFacts], int]:
    """The fleet one tick later: retired replicas gone, launched ones registered and ready, with
    the capacity the policy assumes (a replica registering another is news to the plan, which
    may correct a size it chose on the assumption: no flapping, and not what is tested here)."""
    out = [r for r in fleet if r.worker_id not in p.retire]
    for x in p.launch:
        for _ in range(x.count):
            n += 1
            v = latest if x.held is None else x.held
            out.append(ReplicaFacts(f"n{n}", held=x.held, active_version=v, capacity=capacity, started_at=1e6 + n))
    return out, n


def _direction_changes(trace: list[tuple[float, int]]) -> list[float]:
    """The times a target turned (up after down, or down after up)."""
    turns, last = [], 0
    for (_, a), (t, b) in itertools.pairwise(trace):
        d = (b > a) - (b < a)
        if d and last and d != last:
            turns.append(t)
        if d:
            last = d
    return turns


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=_policies(), signal=_signals(), steps=st.integers(5, 40), dt=st.sampled_from([1.0, 2.0, 7.0]))
def test_a_constant_signal_moves_each_class_one_way_and_settles(policy, signal, steps, dt):
    fleet: list[ReplicaFacts] = []
    state, n = PlannerState(), 0
    traces: dict[object, list[tuple[float, int]]] = {}
    horizon = steps * dt + policy.scale_in_grace_s + policy.cooldown_s + policy.hold_after_s + 5 * dt
    t = NOW
    while t <= NOW + horizon:
        p = plan(signal, fleet, policy, state, t)
        state = p.state
        for k, v in p.desired.items():
            traces.setdefault(k, []).append((t, v))
        fleet, n = _carry_out(fleet, p, n, policy.slots_per_replica)
        assert sum(r.counted for r in fleet) <= policy.max_replicas
        t += dt
    for k, trace in traces.items():
        assert _direction_changes(trace) == [], (k, trace)
    # Settled: the last plans change nothing.
    p = plan(signal, fleet, policy, state, t)
    assert p.launch == () and p.retire == (), p.decisions


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=_policies(),
    signals=st.lists(_signals(), min_size=2, max_size=30),
    dts=st.lists(st.sampled_from([0.5, 1.0, 3.0, 11.0]), min_size=30, max_size=30),
    deaths=st.lists(st.integers(0, 7), max_size=30),
)
def test_a_class_turns_at_most_once_per_cooldown_whatever_the_signal(policy, signals, dts, deaths):
    """Any sequence of signals, with replicas dying on the way: each class's target changes
    direction at most once per ``cooldown_s``, and the fleet never passes ``max_replicas``."""
    fleet: list[ReplicaFacts] = []
    state, n, t = PlannerState(), 0, NOW
    traces: dict[object, list[tuple[float, int]]] = {}
    for i, signal in enumerate(signals):
        p = plan(signal, fleet, policy, state, t)
        state = p.state
        for k, v in p.desired.items():
            traces.setdefault(k, []).append((t, v))
        fleet, n = _carry_out(fleet, p, n, policy.slots_per_replica)
        assert sum(r.counted for r in fleet) <= policy.max_replicas
        if i < len(deaths) and fleet:
            fleet.pop(deaths[i] % len(fleet))  # (a replica died: its replacement is no turn)
        t += dts[i]
    for k, trace in traces.items():
        turns = _direction_changes(trace)
        changes = [t for (_, a), (t, b) in itertools.pairwise(trace) if a != b]
        for turn in turns:
            before = [c for c in changes if c < turn]
            assert not before or turn - before[-1] >= policy.cooldown_s, (k, trace)


def test_a_restarted_controller_only_waits_longer_to_shrink():
    """The state is only timers: an empty one (a restart) never shrinks sooner than a kept one."""
    policy = Policy(min_replicas=1, max_replicas=6, scale_in_grace_s=60, slots_per_replica=2)
    fleet = _followers(4)
    quiet = Signal(5, {LATEST: ClassDemand(in_flight=1)})
    kept = plan(quiet, fleet, policy, PlannerState(), NOW)
    kept = plan(quiet, fleet, policy, kept.state, NOW + 60)
    restarted = plan(quiet, fleet, policy, PlannerState(), NOW + 60)
    assert len(kept.retire) == 3 and restarted.retire == ()


# -- looking ahead: the load's trend over the start-up time ----------------------------------------


def test_a_rising_load_is_sized_for_a_start_up_time_ahead_and_says_so() -> None:
    """The load rose by 1 job/s for 20 s: with 20 s of start-up measured ahead it will be 20 jobs
    more when a replica asked for now serves. The reactive rule sizes for the load now."""
    policy = Policy(min_replicas=1, max_replicas=12, slots_per_replica=4, target_utilization=1.0, startup_s=20)
    fleet = _followers(3, capacity=4, busy=4)

    def past(load: Any) -> PlannerState:
        samples = tuple((NOW - 20 + t, load(t)) for t in range(0, 20, 2))
        return PlannerState({LATEST: ClassState(history=LoadHistory(samples))})

    signal = Signal(5, {LATEST: ClassDemand(backlog=10, in_flight=12)})  # 22 jobs: 6 replicas now
    ahead = plan(signal, fleet, policy, past(lambda t: 2 + t), NOW)
    assert ahead.desired[LATEST] == math.ceil((22 + 1.0 * 20) / 4) == 11
    [up] = [d for d in ahead.decisions if d.action == "up"]
    assert "rising 1.00 jobs/s" in up.reason and "in 20 s" in up.reason
    reactive = plan(signal, fleet, replace(policy, trend_window_s=0), past(lambda t: 2 + t), NOW)
    assert reactive.desired[LATEST] == 6
    assert plan(signal, fleet, policy, past(lambda t: 22), NOW).desired[LATEST] == 6
    assert ahead.startup_s == 20 and not ahead.startup_measured


def test_the_start_up_time_is_learnt_from_the_plans_own_launches() -> None:
    """The plan's launches are asked for at its tick; the replica's first serving tick ends the
    measurement; the next plans look ahead by it, and say when a class's first replica serves."""
    policy = Policy(min_replicas=2, max_replicas=4, startup_s=30)
    fleet = _followers(1, capacity=4)
    p = plan(Signal(5, {}), fleet, policy, PlannerState(), NOW)
    assert [(x.held, x.count) for x in p.launch] == [(None, 1)] and p.serving_in == {}
    fleet = [*fleet, ReplicaFacts("new", state=LAUNCHING, capacity=0)]
    p = plan(Signal(5, {}), fleet, policy, p.state, NOW + 2)
    assert p.startup_s == 30 and not p.startup_measured
    fleet = [*fleet[:1], ready("new", 5, capacity=4)]
    p = plan(Signal(5, {}), fleet, policy, p.state, NOW + 24)
    assert p.startup_s == 24 and p.startup_measured
    held = plan(Signal(5, {3: ClassDemand(refusals=1)}), fleet, replace(policy, max_replicas=5), p.state, NOW + 26)
    assert [(x.held, x.count) for x in held.launch] == [(3, 1)] and held.serving_in == {3: 24.0}


@st.composite
def _rising_states(draw: st.DrawFn) -> PlannerState:
    """A followers' history of loads over the last 20 s (steep ramps among them)."""
    loads = draw(st.lists(st.integers(0, 60), min_size=0, max_size=11))
    if draw(st.booleans()):
        loads = sorted(loads)
    samples = tuple((NOW - 2.0 * (len(loads) - i), n) for i, n in enumerate(loads))
    return PlannerState({LATEST: ClassState(history=LoadHistory(samples))})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_looking_ahead_never_sizes_below_the_load_now_nor_above_max(data):
    """Followers under any load and history: the target is at least the reactive rule's (the
    load now, its backlog included), at least what the load needs within the bounds when nothing
    holds a turn back, and never above ``max_replicas``; whatever the signal, the fleet never
    passes it."""
    policy = replace(data.draw(_policies()), trend_window_s=data.draw(st.sampled_from([10.0, 20.0])),
                     startup_s=data.draw(st.sampled_from([5.0, 30.0, 120.0])))  # fmt: skip
    state = data.draw(_rising_states())
    fleet = [r for r in data.draw(_fleets(policy)) if r.held is None]
    d = data.draw(_demands)
    signal = Signal(9, {LATEST: d})
    ahead = plan(signal, fleet, policy, state, NOW)
    reactive = plan(signal, fleet, replace(policy, trend_window_s=0), state, NOW)
    assert ahead.desired[LATEST] >= reactive.desired[LATEST]
    slots = sorted(r.capacity for r in fleet if r.counted and r.capacity > 0)
    per = slots[len(slots) // 2] if slots else policy.slots_per_replica
    needs = math.ceil(d.load / (per * policy.target_utilization) - 1e-9) if d.load else 0
    assert ahead.desired[LATEST] >= min(policy.max_replicas, needs)
    assert policy.min_replicas <= ahead.desired[LATEST] <= policy.max_replicas
    assert _size_after(ahead, fleet) <= max(policy.max_replicas, sum(r.counted for r in fleet))
    anything = plan(data.draw(_signals()), data.draw(_fleets(policy)), policy, state, NOW)
    assert all(n <= policy.max_replicas for n in anything.desired.values())


def _constant_rate(policy: Policy, rate: float, service_s: float, startup_s: float, slots: int, dt: float,
                   horizon: float) -> list[tuple[float, int]]:  # fmt: skip
    """A fleet of followers fed jobs at a constant rate, planned every ``dt``: a job waits in order
    for a slot of a serving replica and holds it ``service_s``; a launched replica serves
    ``startup_s`` later; a retired one takes no job and leaves once idle. The followers' target
    at each tick."""
    replicas: dict[str, dict[str, Any]] = {}  # id -> serving, draining, busy slots
    queue: collections.deque[float] = collections.deque()
    events: list[tuple[float, str, str]] = [(1 / rate, "arrival", "")]  # (when, what, replica)
    state, n, t, trace = PlannerState(), 0, 0.0, []

    def dispatch(now: float) -> None:
        while queue:
            free = [r for r in replicas.values() if r["serving"] and not r["draining"] and r["busy"] < slots]
            if not free:
                return
            queue.popleft()
            r = min(free, key=lambda r: r["busy"])
            r["busy"] += 1
            heapq.heappush(events, (now + service_s, "free", r["id"]))

    while t <= horizon:
        while events[0][0] <= t:
            when, what, w = heapq.heappop(events)
            if what == "arrival":
                queue.append(when)
                heapq.heappush(events, (when + 1 / rate, "arrival", ""))
            elif what == "ready" and w in replicas:
                replicas[w]["serving"] = True
            elif what == "free":
                replicas[w]["busy"] -= 1
                if replicas[w]["draining"] and not replicas[w]["busy"]:
                    del replicas[w]
            dispatch(when)
        fleet = [
            ReplicaFacts(w, active_version=9, capacity=slots if r["serving"] else 0, in_flight=r["busy"],
                         state="draining" if r["draining"] else "ready" if r["serving"] else LAUNCHING,
                         started_at=float(w[1:]))
            for w, r in replicas.items()
        ]  # fmt: skip
        running = sum(r["busy"] for r in replicas.values())
        d = ClassDemand(backlog=len(queue), in_flight=running, oldest_wait_s=t - queue[0] if queue else 0.0)
        p = plan(Signal(9, {LATEST: d}), fleet, policy, state, NOW + t)
        state = p.state
        trace.append((t, p.desired[LATEST]))
        for w in p.retire:
            replicas[w]["draining"] = True
            if not replicas[w]["busy"]:
                del replicas[w]
        for x in p.launch:
            for _ in range(x.count):
                n += 1
                replicas[f"r{n}"] = {"id": f"r{n}", "serving": False, "draining": False, "busy": 0}
                heapq.heappush(events, (t + startup_s, "ready", f"r{n}"))
        assert sum(not r["draining"] for r in replicas.values()) <= policy.max_replicas
        t += dt
    return trace


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=_policies().filter(lambda p: p.min_replicas >= 1 and p.hysteresis > 0),
    grace=st.sampled_from([10.0, 30.0, 60.0]),
    window=st.sampled_from([10.0, 20.0, 30.0]),
    rate=st.floats(0.2, 8.0),
    service_s=st.floats(0.5, 4.0),
    startup_s=st.floats(0.0, 40.0),
    slots=st.integers(1, 6),
    dt=st.sampled_from([1.0, 2.0]),
)
def test_a_constant_rate_turns_the_followers_at_most_once_and_settles(policy, grace, window, rate, service_s,
                                                                       startup_s, slots, dt):  # fmt: skip
    """Jobs at a constant rate from an idle fleet: the load rises while the first replicas start
    (the backlog grows: a trend), the followers may overshoot and come back once, and then hold:
    a load wavering about its level is no trend, so it never turns them again. (For a fleet that
    keeps a replica, with a hysteresis and a scale-in grace that outlasts a job: without them the
    load the ticks happen to see, a job in or out, turns even a fleet sized on the load now.)"""
    policy = replace(policy, trend_window_s=window, startup_s=30.0, slots_per_replica=slots, scale_in_grace_s=grace)
    settle = startup_s + service_s + policy.scale_in_grace_s + policy.cooldown_s + window
    horizon = 4 * settle + 120
    trace = _constant_rate(policy, rate, service_s, startup_s, slots, dt, horizon)
    assert len(_direction_changes(trace)) <= 1, trace
    late = [n for t, n in trace if t >= horizon - settle - 30]
    assert len(set(late)) == 1, trace
