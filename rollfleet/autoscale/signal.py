"""The demand signal: what the broker and the registry hold, sorted into classes of demand.

A class of demand is what one kind of replica can serve:

- ``LATEST``: jobs any replica following ``latest`` can serve (every ``min.<v>`` subject, and
  ``exact.<v>`` at the latest version), and the sessions pinned there;
- a version ``v`` older than ``latest``: its ``exact.<v>`` jobs and the sessions pinned at it,
  which only a replica held at ``v`` (``rollfleet worker --hold-version v``) will serve once the
  followers moved on.

A session's own subject (``jobs.replica.<id>``, its sticky turns) belongs to the class of the
replica it names. Per class the signal says how many jobs wait (``backlog``), how many run
(``in_flight``), how long the oldest has waited, how many requests were refused
``NoCompatibleReplica`` lately, the sessions pinned there, and the slots that serve it. Jobs that
only a replica now *preparing* their version will take are counted apart
(``awaiting_activation``): the fleet is about to serve them, and more replicas would not serve
them sooner (KEDA's JetStream rule counts them as backlog).

Everything here is plain data and pure functions: the broker's facts in (``SubjectLoad`` per
subject, ``ReplicaFacts`` per replica), the ``Signal`` out. ``reading.py`` fetches the facts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from rollfleet.schemas.messages import refuses_while_activating

LATEST: Final = "latest"
ClassKey = str | int  # LATEST, or a version older than latest that demand asks for

SubjectKey = tuple[Literal["min", "exact"], int] | tuple[Literal["replica"], str]

# Registry states in which a replica takes no new work: it does not count as serving.
NOT_SERVING: Final = frozenset({"draining", "stopped", "down"})
# A process the driver started that has not written its registry entry yet.
LAUNCHING: Final = "launching"


@dataclass(frozen=True)
class SubjectLoad:
    """What the jobs stream holds on one subject: broker facts."""

    pending: int = 0  # stored, not yet delivered (the consumer's NumPending)
    in_flight: int = 0  # delivered, not yet acknowledged (NumAckPending)
    oldest_at: float | None = None  # when the oldest undelivered job was stored (the broker's stamp)


@dataclass(frozen=True)
class ReplicaFacts:
    """One replica as the planner sees it: its registry entry, or a process the driver started
    that has not registered yet (``state == LAUNCHING``)."""

    worker_id: str
    held: int | None = None  # the version it holds; None: it follows latest
    active_version: int = 0
    preparing_version: int | None = None
    state: str = "ready"
    capacity: int = 4
    in_flight: int = 0
    sessions: int = 0  # sessions whose context its engine holds
    own_pending: int = 0  # jobs waiting on its own subject (sessions' sticky turns)
    managed: bool = True  # the controller's driver started it (and may retire it)
    started_at: float = 0.0
    host: str = ""  # the host name its registry entry gives

    @property
    def counted(self) -> bool:
        """Part of the fleet's size: every replica but one leaving (draining, stopped)."""
        return self.state not in ("draining", "stopped")

    @property
    def serving(self) -> bool:
        return self.state not in NOT_SERVING

    @property
    def coming(self) -> bool:
        """Started and not yet serving: more replicas are on their way."""
        return self.state in (LAUNCHING, "starting")

    @property
    def klass(self) -> ClassKey:
        return LATEST if self.held is None else self.held

    @property
    def has_live_sessions(self) -> bool:
        return self.sessions > 0 or self.own_pending > 0


@dataclass(frozen=True)
class ClassDemand:
    backlog: int = 0  # jobs waiting that a replica of this class can take
    in_flight: int = 0  # jobs running
    oldest_wait_s: float = 0.0  # the oldest waiting job's wait
    awaiting_activation: int = 0  # jobs only a version now being activated will take (not scaled on)
    sessions: int = 0  # sessions pinned to this class's version
    refusals: int = 0  # requests refused NoCompatibleReplica lately
    slots: int = 0  # capacity of the class's serving replicas
    busy: int = 0  # of those, running a job

    @property
    def load(self) -> int:
        """Jobs that want a slot now."""
        return self.backlog + self.in_flight

    @property
    def wanted(self) -> bool:
        """Something asks for this class's version: a job, a pinned session, a refusal."""
        return self.load > 0 or self.sessions > 0 or self.refusals > 0 or self.awaiting_activation > 0


@dataclass(frozen=True)
class Signal:
    latest: int | None
    classes: Mapping[ClassKey, ClassDemand] = field(default_factory=dict)
    # Versions the store can no longer materialize (retention deleted them): demand for them
    # cannot be met by holding a replica there, and the plan says so.
    unavailable: frozenset[int] = frozenset()
    # Versions whose record does not say they were committed (a publisher killed before the
    # compare-and-set of ``latest`` leaves a whole directory and a record without the mark): no
    # replica may serve them, so none is held there, and one held there goes.
    never_committed: frozenset[int] = frozenset()

    @property
    def cannot_hold(self) -> frozenset[int]:
        """Versions no replica is held at, whatever asks for them."""
        return self.unavailable | self.never_committed

    def demand(self, klass: ClassKey) -> ClassDemand:
        return self.classes.get(klass, ClassDemand())


def class_of_version(version: int, latest: int | None) -> ClassKey:
    """Which class serves a version: the followers at or past ``latest``, else a held replica."""
    return LATEST if latest is None or version >= latest else version


def _takes_now(r: ReplicaFacts, kind: str, version: int) -> bool:
    if not r.serving or r.coming or (r.state == "activating" and refuses_while_activating(kind)):  # type: ignore[arg-type]
        return False
    return r.active_version >= version if kind == "min" else r.active_version == version


def _prepares(r: ReplicaFacts, kind: str, version: int) -> bool:
    p = r.preparing_version
    return r.serving and p is not None and (p >= version if kind == "min" else p == version)


def demand_signal(
    latest: int | None,
    subjects: Mapping[SubjectKey, SubjectLoad],
    replicas: Iterable[ReplicaFacts],
    now: float,
    pinned: Mapping[int, int] | None = None,
    refusals: Mapping[tuple[str, int], int] | None = None,
    unavailable: Iterable[int] = (),
) -> Signal:
    """The signal of one moment.

    ``subjects``: the jobs stream's subjects, ``("min", v)``, ``("exact", v)`` or ``("replica",
    worker_id)``; ``pinned``: open sessions pinned per version; ``refusals``: requests refused
    lately per ``(kind, version)`` of their constraint. A replica subject of a replica the
    registry no longer lists counts nowhere (its client moves those turns)."""
    fleet = [r for r in replicas if r.counted]
    totals = _Totals()
    _add_subject_loads(totals, subjects, fleet, latest, now)
    for version, count in (pinned or {}).items():
        if count > 0:
            totals.add(class_of_version(version, latest), sessions=count)
    for (kind, version), count in (refusals or {}).items():
        if count > 0:
            totals.add(LATEST if kind == "min" else class_of_version(version, latest), refusals=count)
    for r in fleet:
        if r.serving and not r.coming:
            totals.add(r.klass, slots=r.capacity, busy=min(r.in_flight, r.capacity))
    classes = totals.demands()
    return Signal(latest=latest, classes=classes, unavailable=frozenset(unavailable))


class _Totals:
    """Each class's amounts, summed as they are added (``oldest_wait_s``: the largest)."""

    def __init__(self) -> None:
        self.rows: dict[ClassKey, dict[str, float]] = {}

    def add(self, klass: ClassKey, **amounts: float) -> None:
        row = self.rows.setdefault(klass, {})
        for name, amount in amounts.items():
            if name == "oldest_wait_s":
                row[name] = max(row.get(name, 0.0), amount)
            else:
                row[name] = row.get(name, 0) + amount

    def demands(self) -> dict[ClassKey, ClassDemand]:
        return {
            klass: ClassDemand(
                backlog=int(row.get("backlog", 0)),
                in_flight=int(row.get("in_flight", 0)),
                oldest_wait_s=float(row.get("oldest_wait_s", 0.0)),
                awaiting_activation=int(row.get("awaiting_activation", 0)),
                sessions=int(row.get("sessions", 0)),
                refusals=int(row.get("refusals", 0)),
                slots=int(row.get("slots", 0)),
                busy=int(row.get("busy", 0)),
            )
            for klass, row in self.rows.items()
        }


def _add_subject_loads(
    totals: _Totals,
    subjects: Mapping[SubjectKey, SubjectLoad],
    fleet: list[ReplicaFacts],
    latest: int | None,
    now: float,
) -> None:
    """Each subject's jobs, counted in the class that serves them: a replica's own subject in its
    replica's class, a ``min`` one in the latest's, an ``exact`` one in its version's."""
    by_id = {r.worker_id: r for r in fleet}
    for key, load in subjects.items():
        if load.pending <= 0 and load.in_flight <= 0:
            continue
        wait = max(0.0, now - load.oldest_at) if load.pending > 0 and load.oldest_at is not None else 0.0
        if key[0] == "replica":
            owner = by_id.get(str(key[1]))
            if owner is not None:
                totals.add(owner.klass, backlog=load.pending, in_flight=load.in_flight, oldest_wait_s=wait)
            continue
        kind, version = key[0], int(key[1])
        klass = LATEST if kind == "min" else class_of_version(version, latest)
        # Waiting out an activation: nobody takes them now, and a replica is preparing their version.
        waiting_out = not any(_takes_now(r, kind, version) for r in fleet) and any(
            _prepares(r, kind, version) for r in fleet
        )
        if waiting_out:
            totals.add(klass, awaiting_activation=load.pending, in_flight=load.in_flight)
        else:
            totals.add(klass, backlog=load.pending, in_flight=load.in_flight, oldest_wait_s=wait)


def with_own_pending(
    replicas: Iterable[ReplicaFacts], subjects: Mapping[SubjectKey, SubjectLoad]
) -> list[ReplicaFacts]:
    """Each replica with the jobs waiting on its own subject (its sessions' next turns)."""
    out = []
    for r in replicas:
        load = subjects.get(("replica", r.worker_id))
        out.append(replace(r, own_pending=load.pending + load.in_flight) if load is not None else r)
    return out
