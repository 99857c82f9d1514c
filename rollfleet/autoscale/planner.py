"""The plan: how many replicas follow ``latest``, which versions to hold and on how many
replicas, which replicas to retire, as one pure function of (signal, fleet, policy, state, now).

Rules, all of them here (the controller only carries a plan out):

1. **Size from load, ahead of it.** A class wants ``ceil(load / (slots_per_replica *
   target_utilization))`` replicas, ``load`` being the jobs that wait or run
   (``ClassDemand.load``), and as many as the load it will have once a replica asked for now
   serves: the load projected a start-up time ahead along its trend (``forecast.py``: the
   slope of the last ``trend_window_s``, rising only; the start-up time measured from the
   plan's own launches to their first serving tick, ``startup_s`` until one was). One more while
   its oldest job has waited past ``target_wait_s`` and no replica of it is still starting. Jobs
   waiting out an activation are no load (the fleet is about to take them).
2. **Bounds.** The whole fleet stays within ``[min_replicas, max_replicas]``: the followers never
   fewer than ``min_replicas``, the held replicas at most ``max_replicas - min_replicas`` in all
   and ``max_per_version`` per version. A replica is started only into room that exists now
   (``max_replicas`` minus the replicas counted after this plan's retirements), so a start never
   waits on a drain to keep the bound.
3. **Held versions on demand.** A version older than ``latest`` that jobs, pinned sessions or
   refused requests ask for gets a held replica once that demand has lasted ``hold_after_s``
   (at once after a refusal: nobody serves it at all), unless the store no longer has it
   (``Signal.unavailable``) or it was never committed (``Signal.never_committed``: a replica held
   there goes too), said once, in a decision. It is released when the demand has been
   gone for ``scale_in_grace_s``.
4. **Hysteresis.** Scaling in goes to a size whose load fits ``1 - hysteresis`` of its slots,
   and only after the signal asked for fewer for ``scale_in_grace_s`` without a break (to the
   largest size asked for in that window). A constant signal therefore moves a class at most
   once, and never back.
5. **Cooldown.** A class's target changes direction (up after down, down after up) only
   ``cooldown_s`` after its last change. A replacement for a replica that died is no change of
   target: it starts at once.
6. **Retiring.** The driver's own replicas only; idle ones first (newest first, those not yet
   serving before them), busy ones next (they drain: SIGTERM lets a replica finish its jobs or
   hand resumable ones back), replicas holding live sessions last; never the only serving copy
   of a version that has demand.

Time is an argument and every timer and sample is in ``PlannerState`` (in and out): there is no
hidden clock, and a controller that restarts with an empty state only waits longer to scale in
(and looks ahead only once it has seen a window of load again).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from rollfleet.autoscale.forecast import LoadHistory, StartupClock, projected_load
from rollfleet.autoscale.signal import LATEST, ClassDemand, ClassKey, ReplicaFacts, Signal
from rollfleet.schemas.errors import InvalidRequest


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 1
    max_replicas: int = 8
    slots_per_replica: int = 4  # a replica's capacity, until one of the class registers its own
    target_utilization: float = 1.0  # (waiting + running jobs) per slot a class is sized for
    target_wait_s: float = 10.0  # a job waiting longer than this: one replica more
    hysteresis: float = 0.25  # scale in only to a size whose load fits (1 - this) of its slots
    cooldown_s: float = 30.0  # between two changes of direction of one class
    scale_in_grace_s: float = 60.0  # the signal asks for fewer this long before a class shrinks
    hold_after_s: float = 5.0  # demand for an old version lasts this long before a replica holds it
    max_per_version: int = 2  # held replicas per version
    startup_s: float = 30.0  # a replica's start-up time until one the planner asked for was measured
    trend_window_s: float = 20.0  # the load's trend is fitted over this window; 0: size on the load now

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise InvalidRequest(f"need 0 <= min <= max and max >= 1, got {self.min_replicas}:{self.max_replicas}")
        if self.slots_per_replica < 1 or self.max_per_version < 0:
            raise InvalidRequest("slots_per_replica must be >= 1 and max_per_version >= 0")
        if not 0 < self.target_utilization <= 64 or not 0 <= self.hysteresis < 1:
            raise InvalidRequest("target_utilization must be in (0, 64] and hysteresis in [0, 1)")
        for name in ("target_wait_s", "cooldown_s", "scale_in_grace_s", "hold_after_s", "startup_s", "trend_window_s"):
            if not getattr(self, name) >= 0:
                raise InvalidRequest(f"{name} must be >= 0")

    @property
    def max_held(self) -> int:
        return self.max_replicas - self.min_replicas


@dataclass(frozen=True)
class ClassState:
    """A class's timers and last target (all on the caller's clock)."""

    desired: int | None = None  # the last target (None: not known yet; the replicas counted)
    direction: int = 0  # +1: the last change was up, -1: down, 0: none yet
    changed_at: float = -math.inf
    lower_since: float | None = None  # since when the signal asks for fewer, without a break
    lower_peak: int = 0  # the largest size asked for since then
    wanted_since: float | None = None  # since when something asks for this class
    unavailable_said: bool = False  # a held version the store lost: said once per episode
    history: LoadHistory = field(default_factory=LoadHistory)  # the load at the last ticks, for its trend


@dataclass(frozen=True)
class PlannerState:
    classes: Mapping[ClassKey, ClassState] = field(default_factory=dict)
    startup: StartupClock = field(default_factory=StartupClock)  # launches asked for and their start-up times

    def of(self, klass: ClassKey) -> ClassState:
        return self.classes.get(klass, ClassState())


Action = Literal["up", "down", "launch", "retire", "unavailable", "waits"]


@dataclass(frozen=True)
class Decision:
    """One decision and the signal that caused it: one structured log line."""

    klass: ClassKey
    action: Action
    before: int
    after: int
    reason: str
    demand: ClassDemand
    worker_id: str | None = None  # a retired replica


@dataclass(frozen=True)
class Launch:
    held: int | None  # None: a replica following latest
    count: int


@dataclass(frozen=True)
class Plan:
    desired: Mapping[ClassKey, int]  # the target of every class with replicas or demand
    actual: Mapping[ClassKey, int]  # replicas counted per class (starting ones included)
    launch: tuple[Launch, ...]
    retire: tuple[str, ...]  # worker ids, in the order to retire them
    decisions: tuple[Decision, ...]
    state: PlannerState
    startup_s: float = 0.0  # the start-up time the plan looked ahead by (measured, or the policy's)
    startup_measured: bool = False  # whether ``startup_s`` was measured (else the policy's default)
    # Per class none of whose replicas serves while one starts (or is launched by this plan): the
    # seconds until the first is expected to serve (what a refused request's Retry-After can say).
    serving_in: Mapping[ClassKey, float] = field(default_factory=dict)


def _slots(replicas: list[ReplicaFacts], policy: Policy) -> int:
    caps = sorted(r.capacity for r in replicas if r.capacity > 0)
    return caps[len(caps) // 2] if caps else policy.slots_per_replica


def _sized(load: float, slots: int, utilization: float) -> int:
    # (a tiny epsilon: 8 jobs over 4 slots at 1.0 is 2 replicas, not 3 from a rounding error)
    return math.ceil(load / (slots * utilization) - 1e-9) if load > 0 else 0


def _needs(
    d: ClassDemand, replicas: list[ReplicaFacts], prev: int, policy: Policy, trend: float, lead_s: float
) -> tuple[int, int, str]:
    """(size to grow to, size a shrink may go to, why): rule 1 and 4's sizes, before bounds."""
    slots = _slots(replicas, policy)
    up = _sized(d.load, slots, policy.target_utilization)
    down = _sized(d.load, slots, policy.target_utilization * (1 - policy.hysteresis))
    why = f"{d.load} jobs (waiting {d.backlog}, running {d.in_flight}) at {slots} slots a replica"
    if d.sessions or d.refusals or d.awaiting_activation:
        why += f"; {d.sessions} pinned sessions, {d.refusals} refused, {d.awaiting_activation} await an activation"
    ahead = projected_load(d.load, trend, lead_s)
    early = _sized(ahead, slots, policy.target_utilization)
    if early > up:
        up = early
        why += f"; rising {trend:.2f} jobs/s: {ahead:.1f} jobs in {lead_s:.0f} s (the start-up time)"
    coming = any(r.coming for r in replicas)
    if d.backlog > 0 and d.oldest_wait_s > policy.target_wait_s and not coming and len(replicas) >= prev:
        if prev + 1 > up:
            up = prev + 1
            why += f"; the oldest waited {d.oldest_wait_s:.1f} s > {policy.target_wait_s:g} s"
    return up, max(up, down), why


def _decide(
    klass: ClassKey,
    d: ClassDemand,
    replicas: list[ReplicaFacts],
    floor: int,
    lo: int,
    hi: int,
    st: ClassState,
    policy: Policy,
    now: float,
    lead_s: float,
) -> tuple[int, ClassState, Decision | None]:
    """A class's next target (rules 1, 2, 4, 5) from its previous one."""
    prev = st.desired if st.desired is not None else len(replicas)
    trend = 0.0
    if policy.trend_window_s > 0:
        st = replace(st, history=st.history.observe(now, d.load, policy.trend_window_s))
        trend = st.history.trend(policy.trend_window_s)
    up, down, why = _needs(d, replicas, prev, policy, trend, lead_s)
    up, down = max(up, floor), max(down, floor)
    target = prev
    if up > prev:
        st = replace(st, lower_since=None, lower_peak=0)
        target = up
    elif down < prev:
        since = st.lower_since if st.lower_since is not None else now
        peak = max(st.lower_peak, down) if st.lower_since is not None else down
        st = replace(st, lower_since=since, lower_peak=peak)
        if now - since >= policy.scale_in_grace_s:
            target = peak
            why += f"; {peak} asked for at most, for {now - since:.0f} s"
    else:
        st = replace(st, lower_since=None, lower_peak=0)
    target = min(max(target, lo), hi)
    if target == prev:
        return prev, replace(st, desired=prev), None
    direction = 1 if target > prev else -1
    if prev > hi:
        why = f"above the room left ({hi})"
    elif prev < lo:
        why = f"below the minimum ({lo})"
    # Only the minimum is kept whatever the cooldown; above the room left, launches wait (rule 2).
    turning = st.direction not in (0, direction) and now - st.changed_at < policy.cooldown_s
    if turning and prev >= lo:
        return prev, replace(st, desired=prev), None
    st = replace(st, desired=target, direction=direction, changed_at=now, lower_since=None, lower_peak=0)
    return target, st, Decision(klass, "up" if direction > 0 else "down", prev, target, why, d)


def _retire_order(r: ReplicaFacts) -> tuple[int, int, int, float]:
    """Idle first (those not yet serving before the others, then the newest), busy next (fewest
    jobs first), replicas holding live sessions last."""
    return (int(r.has_live_sessions), r.in_flight, 0 if r.coming else 1, -r.started_at)


def _demanded_versions(signal: Signal) -> set[int]:
    """Versions asked for whose last serving copy is kept (one never committed is nobody's to serve)."""
    versions = {
        k
        for k, d in signal.classes.items()
        if k != LATEST and d.wanted and isinstance(k, int) and k not in signal.never_committed
    }
    if signal.latest is not None and signal.demand(LATEST).wanted:
        versions.add(signal.latest)
    return versions


def _is_copy(r: ReplicaFacts) -> bool:
    return r.counted and r.serving and not r.coming


def plan(
    signal: Signal,
    fleet: Iterable[ReplicaFacts],
    policy: Policy,
    state: PlannerState,
    now: float,
) -> Plan:
    """The next plan: each class's target (held versions first, then the followers in the room
    they leave), the replicas to retire, the launches that fit, and the state for the next call."""
    counted = [r for r in fleet if r.counted]
    clock = state.startup.see(counted, now, forget_after_s=state.startup.estimate(policy.startup_s))
    lead_s = clock.estimate(policy.startup_s)
    by_class: dict[ClassKey, list[ReplicaFacts]] = {}
    for r in counted:
        by_class.setdefault(r.klass, []).append(r)
    held_keys = sorted({k for k in [*signal.classes, *by_class, *state.classes] if k != LATEST}, key=lambda k: int(k))
    gates, decisions = _held_gates(signal, held_keys, by_class, state, policy, now)
    desired, states, sized = _held_targets(signal, held_keys, by_class, gates, policy, now, lead_s)
    decisions += sized

    # -- the followers (rules 1, 2, 4, 5) -----------------------------------------------------
    d, replicas = signal.demand(LATEST), by_class.get(LATEST, [])
    floor = 1 if d.wanted else 0
    hi = _followers_room(signal, held_keys, desired, policy)
    target, states[LATEST], decision = _decide(
        LATEST, d, replicas, floor, policy.min_replicas, hi, state.of(LATEST), policy, now, lead_s
    )
    desired[LATEST] = target
    if decision is not None:
        decisions.append(decision)

    retire, retiring = _retirements(signal, counted, by_class, [LATEST, *held_keys], desired)
    decisions += retiring
    launched = _launches(signal, len(counted) - len(retire), by_class, held_keys, desired, policy)
    launch = [Launch(None if k == LATEST else int(k), n) for k, n in launched.items()]
    decisions += _launch_decisions(signal, by_class, [LATEST, *held_keys], desired, launched, policy)

    keep = _kept_states(signal, states, by_class, desired, policy, now)
    shown = {k: desired[k] for k in keep}
    serving_in = {
        k: eta
        for k in shown
        if (eta := clock.serving_in(by_class.get(k, []), launched.get(k, 0), lead_s, now)) is not None
    }
    return Plan(
        desired=shown,
        actual={k: len(by_class.get(k, [])) for k in shown},
        launch=tuple(launch),
        retire=tuple(retire),
        decisions=tuple(decisions),
        state=PlannerState(keep, clock.ask(launched.items(), now)),
        startup_s=lead_s,
        startup_measured=bool(clock.samples),
        serving_in=serving_in,
    )


def _held_gates(
    signal: Signal,
    held_keys: list[ClassKey],
    by_class: Mapping[ClassKey, list[ReplicaFacts]],
    state: PlannerState,
    policy: Policy,
    now: float,
) -> tuple[dict[ClassKey, tuple[int, int, ClassState]], list[Decision]]:
    """Rule 3: per held version, (floor, own cap, state) before the shared bound; and the
    ``unavailable`` decisions, once per episode, for versions the store cannot give a replica."""
    gates: dict[ClassKey, tuple[int, int, ClassState]] = {}
    decisions: list[Decision] = []
    for v in held_keys:
        d, replicas, st = signal.demand(v), by_class.get(v, []), state.of(v)
        st = replace(st, wanted_since=(st.wanted_since if st.wanted_since is not None else now) if d.wanted else None)
        floor, hi = 0, policy.max_per_version
        if d.wanted and int(v) in signal.cannot_hold:
            if not st.unavailable_said:
                why = f"version {v} is asked for but the store no longer has it (retention deleted it)"
                if int(v) in signal.never_committed:
                    why = f"version {v} is asked for but was never committed: no replica may serve it"
                decisions.append(Decision(v, "unavailable", len(replicas), 0, why, d))
            st = replace(st, unavailable_said=True)
        elif d.wanted:
            st = replace(st, unavailable_said=False)
            assert st.wanted_since is not None
            if d.refusals > 0 or now - st.wanted_since >= policy.hold_after_s or replicas:
                floor = 1
            else:
                hi = 0  # (not yet: the demand may end before a replica could start)
        else:
            st = replace(st, unavailable_said=False)
        if int(v) in signal.cannot_hold:
            hi = 0
        gates[v] = (floor, hi, st)
    return gates, decisions


def _held_targets(
    signal: Signal,
    held_keys: list[ClassKey],
    by_class: Mapping[ClassKey, list[ReplicaFacts]],
    gates: Mapping[ClassKey, tuple[int, int, ClassState]],
    policy: Policy,
    now: float,
    lead_s: float,
) -> tuple[dict[ClassKey, int], dict[ClassKey, ClassState], list[Decision]]:
    """Rules 1, 2, 4 and 5 for the held versions: each one's target within its share of the held
    replicas' budget, ``max_replicas - min_replicas``."""

    def _prev(v: ClassKey) -> int:
        known = gates[v][2].desired
        return known if known is not None else len(by_class.get(v, []))

    desired: dict[ClassKey, int] = {}
    states: dict[ClassKey, ClassState] = {}
    decisions: list[Decision] = []
    # The held replicas' share, max - min, goes to the versions that hold replicas now first (a
    # newcomer never takes an incumbent's replica), then to the most asked-for.
    budget = policy.max_held
    for v in sorted(
        held_keys,
        key=lambda k: (-_prev(k), -(signal.demand(k).refusals + signal.demand(k).sessions), -signal.demand(k).load),
    ):
        floor, hi, st = gates[v]
        d, replicas = signal.demand(v), by_class.get(v, [])
        cap = max(0, min(hi, budget))
        # (a held version has no minimum: its floor is only asked for, and obeys the cooldown)
        target, states[v], decision = _decide(v, d, replicas, min(floor, cap), 0, cap, st, policy, now, lead_s)
        budget -= target  # (above its cap only while a cooldown keeps it there)
        desired[v] = target
        if decision is not None:
            decisions.append(decision)
    return desired, states, decisions


def _followers_room(signal: Signal, held_keys: list[ClassKey], desired: Mapping[ClassKey, int], policy: Policy) -> int:
    """Rule 2 for the followers: the most they may grow to, the fleet's bound less the room the
    held versions take (never below ``min_replicas``)."""
    # The room a held version will take is kept from the moment it is asked for (not only once it
    # has been asked for ``hold_after_s``), so a constant signal never grows the followers only to
    # shrink them again for it.
    asked = 1 if policy.max_per_version else 0
    claimed = sum(max(desired[v], asked if signal.demand(v).wanted and int(v) not in signal.cannot_hold else 0)
                  for v in held_keys)  # fmt: skip
    return max(policy.min_replicas, policy.max_replicas - min(claimed, policy.max_held))


def _retirements(
    signal: Signal,
    counted: list[ReplicaFacts],
    by_class: Mapping[ClassKey, list[ReplicaFacts]],
    classes: list[ClassKey],
    desired: Mapping[ClassKey, int],
) -> tuple[list[str], list[Decision]]:
    """Rule 6: the replicas each class sheds down to its target, in ``_retire_order``, never the
    only serving copy of a version asked for; with a ``retire`` decision each."""
    demanded = _demanded_versions(signal)
    retire: list[str] = []
    retired: set[str] = set()
    decisions: list[Decision] = []
    for klass in classes:
        replicas = by_class.get(klass, [])
        excess = len(replicas) - desired[klass]
        for r in sorted((r for r in replicas if r.managed), key=_retire_order):
            if excess <= 0:
                break
            if _is_copy(r) and r.active_version in demanded:
                others = [
                    o
                    for o in counted
                    if o.worker_id != r.worker_id and o.worker_id not in retired and _is_copy(o)
                    and o.active_version == r.active_version
                ]  # fmt: skip
                if not others:
                    continue  # the only serving copy of a version asked for
            retire.append(r.worker_id)
            retired.add(r.worker_id)
            excess -= 1
            how = (
                "holds live sessions"
                if r.has_live_sessions
                else f"busy: drains {r.in_flight} jobs"
                if r.in_flight
                else "idle"
            )
            decisions.append(
                Decision(klass, "retire", len(replicas), desired[klass], how, signal.demand(klass), r.worker_id)
            )
    return retire, decisions


def _launches(
    signal: Signal,
    staying: int,
    by_class: Mapping[ClassKey, list[ReplicaFacts]],
    held_keys: list[ClassKey],
    desired: Mapping[ClassKey, int],
    policy: Policy,
) -> dict[ClassKey, int]:
    """Rule 2 for starts: replicas to launch per class, only into the room there is now
    (``max_replicas`` less the ``staying`` replicas, those counted and not retired)."""
    room = policy.max_replicas - staying
    # The followers' minimum first (a bound); then held versions (without one their requests are
    # refused, where followers' jobs only wait longer); then the followers' rest.
    by_need = sorted(held_keys, key=lambda k: -(signal.demand(k).refusals + signal.demand(k).sessions))
    steps: list[tuple[ClassKey, int]] = [(LATEST, min(desired[LATEST], policy.min_replicas))]
    steps += [(k, desired[k]) for k in by_need] + [(LATEST, desired[LATEST])]
    launched: dict[ClassKey, int] = {}
    for klass, goal in steps:
        missing = goal - len(by_class.get(klass, [])) - launched.get(klass, 0)
        count = min(missing, max(room, 0))
        if count > 0:
            launched[klass] = launched.get(klass, 0) + count
            room -= count
    return launched


def _launch_decisions(
    signal: Signal,
    by_class: Mapping[ClassKey, list[ReplicaFacts]],
    classes: list[ClassKey],
    desired: Mapping[ClassKey, int],
    launched: Mapping[ClassKey, int],
    policy: Policy,
) -> list[Decision]:
    """Rule 2, said: a ``launch`` decision per class that starts replicas, and a ``waits`` one per
    class whose target the room left does not reach."""
    decisions: list[Decision] = []
    for klass in classes:
        have, count = len(by_class.get(klass, [])), launched.get(klass, 0)
        if count:
            why = f"{count} to reach {desired[klass]}"
            decisions.append(Decision(klass, "launch", have, have + count, why, signal.demand(klass)))
        if have + count < desired[klass]:
            why = f"{desired[klass] - have - count} wait for room under max {policy.max_replicas}"
            decisions.append(Decision(klass, "waits", have + count, desired[klass], why, signal.demand(klass)))
    return decisions


def _kept_states(
    signal: Signal,
    states: Mapping[ClassKey, ClassState],
    by_class: Mapping[ClassKey, list[ReplicaFacts]],
    desired: Mapping[ClassKey, int],
    policy: Policy,
    now: float,
) -> dict[ClassKey, ClassState]:
    """The classes the next plan remembers: a class with no replica, no demand and a settled
    target is forgotten (its timers too)."""
    return {
        k: s
        for k, s in states.items()
        if k == LATEST
        or by_class.get(k)
        or signal.demand(k).wanted
        or desired.get(k, 0) > 0
        or now - s.changed_at < policy.cooldown_s  # (its cooldown outlives it)
    }
