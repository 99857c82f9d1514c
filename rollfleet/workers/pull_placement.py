"""Where a worker's free slots wait, as pure decisions: each subject's share of the slots, when
a parked slot's subject counts as quiet, which subjects are left to other replicas, and which
subjects are listened on. Plain data in (the time an argument), a decision out; the pull loop
(``job_puller``) carries them out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollfleet.broker.pull_consumer import PullConsumer
from rollfleet.schemas.names import listened_subjects
from rollfleet.workers.served_version import ServedVersion, Subject


def placement(pullers: Sequence[PullConsumer], slots: int, now: float, rebalance_s: float) -> dict[PullConsumer, int]:
    """Where this worker's slots should wait: one on each subject in order (the version's
    window first), the rest on the subject that delivered within ``rebalance_s``, else on
    the newest ``min`` subject (where most work comes)."""
    share = dict.fromkeys(pullers, 0)
    for puller in pullers[: max(slots, 0)]:
        share[puller] = 1
    rest = slots - min(max(slots, 0), len(pullers))
    if rest > 0:
        recent = max(pullers, key=lambda p: p.last_delivery)
        if now - recent.last_delivery > rebalance_s:
            recent = next((p for p in pullers if p.consumer.startswith("min-")), pullers[0])
        share[recent] += rest
    return share


def quiet_at(puller: PullConsumer, rebalance_s: float) -> float:
    """When a subject's waiting request counts as quiet: nothing delivered for ``rebalance_s``
    (nor asked for: a new request gets its chance)."""
    return max(puller.last_delivery, puller.requested_at) + rebalance_s


def listen_order(
    version: int, hot: dict[Subject, float], accepts: Callable[[Subject], bool], max_waiting: int
) -> list[Subject]:
    """Where work is likely to arrive, best first: this version's window (``exact-w`` and the
    newest ``min`` subjects, see ``listened_subjects``), then subjects that delivered lately
    (``hot``: subject -> when), most recent first; at most ``max_waiting`` beyond the window."""
    own = [s for s in listened_subjects(version) if accepts(s)]
    recent = sorted(hot, key=hot.__getitem__, reverse=True)
    return list(dict.fromkeys([*own, *recent]))[: max(max_waiting, len(own))]


class StandbySubjects:
    """A subject whose last waiting request the broker refused (``max_waiting`` requests of
    other replicas wait there already) is left to them until a bell for it, an activation,
    a reconnect or ``standby_s``: the broker's work per job stays bounded by ``max_waiting``,
    whatever the size of the fleet."""

    def __init__(self, standby_s: float) -> None:
        self._standby_s = standby_s
        self._until: dict[Subject, float] = {}  # subject -> until when it is left to other replicas
        self._refusals_seen: dict[Subject, float] = {}

    def standing_by(self, subject: Subject, refused_at: float, now: float) -> bool:
        """Whether ``subject`` is left to others now; ``refused_at``: its last refusal."""
        if refused_at > self._refusals_seen.get(subject, -1.0):
            self._refusals_seen[subject] = refused_at
            self._until[subject] = now + self._standby_s
        until = self._until.get(subject)
        if until is None:
            return False
        if now < until:
            return True
        del self._until[subject]
        return False

    def called_in(self, subject: Subject) -> None:
        """A bell for ``subject``: wait there again."""
        self._until.pop(subject, None)

    def clear(self) -> None:
        """Every subject is ours to wait on again (an activation, a reconnect)."""
        self._until.clear()


class ListenedSubjects:
    """The subjects listened on (``listen_order``), from the version served and the subjects work
    came from within ``hot_s``. Recomputed only when the version, the set of hot subjects or a
    second has passed (it is asked after every finished job): the same list object until then."""

    def __init__(self, hot_s: float, max_waiting: int) -> None:
        self._hot_s = hot_s
        self._max_waiting = max_waiting
        self.hot: dict[Subject, float] = {}  # subject -> when work last came from it
        self._last: list[Subject] = []  # the last answer, and what it depended on
        self._key: tuple[int, int | None, int] | None = None
        self._at = 0.0

    def delivered(self, subject: Subject, now: float) -> None:
        self.hot[subject] = now

    def now(self, served: ServedVersion, now: float) -> list[Subject]:
        """Where work is likely to arrive, best first."""
        key = (served.version, served.activating, len(self.hot))
        if self._key == key and now - self._at < 1.0:
            return self._last
        for subject in [s for s, t in self.hot.items() if now - t > self._hot_s or not served.accepts(s)]:
            del self.hot[subject]
        self._last = listen_order(served.version, self.hot, served.accepts, self._max_waiting)
        self._key, self._at = key, now
        return self._last


class QuietClock:
    """Whether a subject's waiting request is quiet (``quiet_at``), and the earliest time one not
    quiet yet will be (``next_at``: when the pull loop wakes to move parked slots). Restarted at
    each pass of the loop."""

    def __init__(self, rebalance_s: float) -> None:
        self._rebalance_s = rebalance_s
        self.next_at: float | None = None  # when parked slots may move

    def restart(self) -> None:
        self.next_at = None

    def quiet(self, puller: PullConsumer, now: float) -> bool:
        """Nothing delivered for ``rebalance_s`` (nor asked for: a new request gets its chance);
        if not yet, ``next_at`` says when it will be."""
        at = quiet_at(puller, self._rebalance_s)
        if now >= at:
            return True
        if self.next_at is None or at < self.next_at:
            self.next_at = at
        return False
