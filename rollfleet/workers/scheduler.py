"""Which jobs subject a worker pulls from next.

A worker at version ``w`` may serve ``exact-w`` and ``min-v`` for every ``v <= w``, never
anything else. It prefers the most constrained work (exact, then the highest ``min``),
but a subject that has waited longer than ``aging_s`` goes first, so loose work never
starves behind a steady stream of tight work. A subject's wait is its work's own: a client's
stalled bell says how long its oldest job there has waited (``note_pending``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollfleet.workers.served_version import ServedVersion, Subject, compatible

__all__ = ["Subject", "SubjectScheduler", "compatible"]


@dataclass
class SubjectScheduler:
    served: ServedVersion
    aging_s: float = 5.0
    # subject -> when it was first seen with work we have not pulled since
    _waiting_since: dict[Subject, float] = field(default_factory=dict)
    _delivered_at: dict[Subject, float] = field(default_factory=dict)  # subject -> its last delivery's word
    _pending: dict[Subject, int] = field(default_factory=dict)  # subject -> jobs its last delivery said wait behind it

    def _prune(self) -> None:
        """Forget subjects the live version can no longer serve (it moved on)."""
        for book in (self._waiting_since, self._delivered_at, self._pending):
            for subject in [s for s in book if not self.served.accepts(s)]:
                del book[subject]

    def note_pending(self, subject: Subject, now: float, waited_s: float = 0.0) -> bool:
        """Work may be waiting on ``subject``, for ``waited_s`` already (what a client's stalled
        bell says of its oldest job); returns whether this worker may serve it. Its age is the
        work's own wait: a replica that hears of it late (it just started, or the bells went to
        replicas that died or froze) must not make it wait ``aging_s`` more behind newer work
        (campaign seed 747109: a turn expired behind jobs submitted after it). A later word never
        makes a subject younger."""
        if not self.served.accepts(subject):
            return False
        since = now - max(0.0, waited_s)
        if since < self._waiting_since.get(subject, since + 1.0):
            self._waiting_since[subject] = since
        return True

    def note_delivered(self, subject: Subject, now: float, age_s: float, pending: int) -> None:
        """A job was delivered from ``subject``, stored ``age_s`` ago, with ``pending`` jobs still
        queued behind it. Those were stored no earlier (a stream keeps its order), so the subject's
        age becomes that job's: a starving subject keeps its place while what it serves is as old,
        and gives way to an older subject's work once what it serves is newer (seed 101: a replica
        drained ``min-0``, newer jobs included, while a turn moved to ``min-13`` waited behind them
        until it expired). Nothing behind it: the subject is empty."""
        self._delivered_at[subject] = now
        if pending <= 0:
            self.note_empty(subject)
        elif self.served.accepts(subject):
            self._waiting_since[subject] = now - max(0.0, age_s)
            self._pending[subject] = pending

    def note_served(self, subject: Subject, now: float) -> None:
        """Pulled from ``subject`` (a request asked at ``now``); there may be more behind. A
        delivery since then said how old that is (``note_delivered``), and its word stands.
        Else its age restarts now, unless it was starving: then it keeps its place (one job per
        ``aging_s`` would starve it still, behind a steady stream of newer work)."""
        if self._delivered_at.get(subject, -1.0) >= now:
            return
        since = self._waiting_since.get(subject)
        if since is None or now - since < self.aging_s:
            self._waiting_since[subject] = now

    def starving(self, now: float) -> bool:
        """Whether some subject has waited ``aging_s`` or longer."""
        self._prune()
        return any(now - since >= self.aging_s for since in self._waiting_since.values())

    def note_empty(self, subject: Subject) -> None:
        self._waiting_since.pop(subject, None)
        self._pending.pop(subject, None)

    def known_pending(self, subject: Subject) -> int | None:
        """How many jobs the subject's last delivery said wait behind it, less those asked for
        since (None: no delivery said)."""
        return self._pending.get(subject)

    def note_asked(self, subject: Subject, n: int) -> None:
        """A request asked for ``n`` more of the subject's jobs: they are no longer to ask for."""
        if subject in self._pending:
            self._pending[subject] = max(0, self._pending[subject] - n)

    def order(self, now: float) -> list[Subject]:
        """Candidates, best first."""
        self._prune()

        def rank(subject: Subject) -> tuple[int, float, int, int]:
            kind, v = subject
            age = now - self._waiting_since[subject]
            starving = age >= self.aging_s
            # starving first (oldest first), then exact before min, then higher min first
            return (0 if starving else 1, -age if starving else 0.0, 0 if kind == "exact" else 1, -v)

        return sorted(self._waiting_since, key=rank)

    def has_candidates(self) -> bool:
        self._prune()
        return bool(self._waiting_since)
