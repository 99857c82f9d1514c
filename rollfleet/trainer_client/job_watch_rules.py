"""The client's watch over jobs in flight, decided without I/O: when an exact job no replica can
serve is withdrawn, when a replica that may hold it is asked again or probed, and how many
replicas to wake for jobs that wait unpulled. Plain data in, a decision out, time an argument;
``watch.JobWatch`` carries the decisions out against the broker.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rollfleet.schemas import VersionConstraint

ORPHAN_GRACE_S = 2.0  # an exact job no replica can serve is withdrawn after this long
PROBE_S = 1.0  # a replica that may hold an orphaned exact job is asked about (and probed) this often
STALL_AFTER_S = 1.0  # a job unanswered this long makes its subject worth a look
STALL_JOBS_PER_BELL = 4  # a woken replica pulls up to its free slots (4 by default)
STALL_BELLS_MAX = 64

Verdict = Literal["servable", "held", "waiting", "withdraw", "wants_replica"]


def expired(deadlines: Iterable[tuple[str, float]], now: float, grace_s: float) -> list[str]:
    """The keys whose deadline (plus the client's grace) has passed at ``now`` (wall clock)."""
    return [key for key, deadline in deadlines if deadline <= now - grace_s]


def stalled_since(
    jobs: Iterable[tuple[VersionConstraint, float, str | None]], now: float, after_s: float
) -> dict[VersionConstraint, float]:
    """The subjects worth a stall look, each with when its oldest job was stored: ``jobs`` are
    the unanswered jobs (constraint, submitted at, the replica a sticky turn waits on), by this
    client's clock. A job stored less than ``after_s`` ago is not stalled yet; a sticky turn is
    watched by its own rules (``sessions.sticky``). The wait goes with the subject's bells, so a
    replica that hears of it late ages it by the jobs' own wait."""
    out: dict[VersionConstraint, float] = {}
    for constraint, submitted_at, replica in jobs:
        if replica is None and submitted_at < now - after_s:
            out[constraint] = min(submitted_at, out.get(constraint, submitted_at))
    return out


def queued_since(jobs: Iterable[tuple[float, int | None]], delivered_floor: int) -> float | None:
    """When the oldest job still queued on a subject was submitted: ``jobs`` are this client's
    unanswered jobs there (submitted at, stream sequence), ``delivered_floor`` the last stream
    sequence its consumer delivered (it delivers in stream order, so a job stored after it was
    never delivered). None if every one was delivered. A job some replica runs (for as long as a
    long generation takes) is not work waiting to be pulled: a bell that counted its wait would
    make the subject look starving to the replica it wakes, which then drains the subject's
    newer jobs before older work elsewhere (seed 101: a turn on ``min-13`` expired behind ``min-0``
    jobs submitted after it)."""
    queued = [t for t, seq in jobs if seq is not None and seq > delivered_floor]
    return min(queued, default=None)


def stall_bells(num_waiting: int, num_pending: int, num_ack_pending: int) -> int:
    """How many replicas to ring for a subject: none while a pull request waits there (a replica
    is already asking); else one per few jobs queued, and one for jobs delivered to a holder that
    may have died (they come back only to a replica that pulls there), bounded."""
    if num_waiting:
        return 0
    stuck = num_pending + (1 if num_ack_pending else 0)
    return min(-(-stuck // STALL_JOBS_PER_BELL), STALL_BELLS_MAX)


@dataclass
class OrphanWatch:
    """Exact jobs that no live replica can serve any more (every one has moved past the version).

    Such a job is never served: once that has lasted ``grace_s`` it is withdrawn and answered
    ``NoCompatibleReplica`` rather than left to its deadline; unless its caller chose to wait for a
    replica (``submit(..., wait_for_replica=True)``): then it stays queued until its deadline
    (``wants_replica``), and the watch says its demand again, so that the fleet's control loop
    starts a replica at its version (``autoscale``: a replica held there). While a live replica is still at the
    version with jobs in flight (an activation draining its exact jobs) it may be running the job:
    the job is left to it until it has moved on or is gone. Whether it may hold the job is asked of
    the broker at most once per ``probe_s`` per job (``hold_check_due``/``checked``), and each such
    replica is probed at most once per ``probe_s`` (``probes_due``: no responders marks it gone).
    """

    grace_s: float = ORPHAN_GRACE_S
    probe_s: float = PROBE_S
    _since: dict[str, float] = field(default_factory=dict)  # key -> since when nobody can serve it
    _looked: dict[str, tuple[float, bool]] = field(default_factory=dict)  # key -> (when asked, may be held)
    _probed: dict[str, float] = field(default_factory=dict)  # replica -> when last probed

    def keep_only(self, pending: Collection[str]) -> None:
        """Forget the jobs no longer pending (answered, withdrawn, failed)."""
        for book in (self._since, self._looked):
            for key in [k for k in book if k not in pending]:
                del book[key]

    def hold_check_due(self, key: str, now: float) -> bool:
        return now - self._looked.get(key, (float("-inf"), True))[0] >= self.probe_s

    def checked(self, key: str, now: float, may_hold: bool) -> None:
        self._looked[key] = (now, may_hold)

    def may_be_held(self, key: str) -> bool:
        """What the last look said (held until asked: a replica at the version may be running it)."""
        return self._looked.get(key, (0.0, True))[1]

    def probes_due(self, holders: Sequence[str], now: float) -> list[str]:
        """The holders to probe now (each is then not probed again for ``probe_s``)."""
        due = [w for w in holders if now - self._probed.get(w, float("-inf")) >= self.probe_s]
        for worker_id in due:
            self._probed[worker_id] = now
        return due

    def verdict(
        self, key: str, *, servable: bool, holders: Sequence[str], now: float, waits_for_replica: bool = False
    ) -> Verdict:
        """``servable``: a live replica can serve the job's constraint; ``holders``: live replicas
        at its version that may be running it; ``waits_for_replica``: its caller waits for a
        replica to be started rather than take ``NoCompatibleReplica``. ``withdraw`` restarts the
        grace, so a job that could not be withdrawn is looked at again a grace later."""
        if servable:
            self._since.pop(key, None)
            return "servable"
        if holders:
            return "held"
        if waits_for_replica:
            self._since.pop(key, None)  # (its deadline ends it, as any job's)
            return "wants_replica"
        if now - self._since.setdefault(key, now) < self.grace_s:
            return "waiting"
        self._since[key] = now
        return "withdraw"
