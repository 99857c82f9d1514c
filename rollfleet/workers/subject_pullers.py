"""The pull consumers a worker holds, one per job subject, and the open requests on them.

A subject's shared consumer is the trainer's to create (with a commit, or with the first job
there); workers only bind. A missing one is looked up again after a bell for the subject, an
activation, a reconnect or ``standby_s``: an idle replica asks the broker nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from contextlib import suppress

from rollfleet.broker.pull_consumer import PullConsumer
from rollfleet.broker.topology import bind_job_consumer
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.schemas import Names
from rollfleet.workers.served_version import Subject


class SubjectPullers:
    """Each subject's pull consumer (``by_subject``), bound on first use; ``dispatch`` gets every
    delivered job, ``on_end`` is called whenever a request ends."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        names: Names,
        *,
        standby_s: float,
        dispatch: Callable[[Msg], None],
        on_end: Callable[[], None],
    ) -> None:
        self._nc, self._js, self._names = nc, js, names
        self._standby_s = standby_s
        self._dispatch = dispatch
        self._on_end = on_end
        self.by_subject: dict[Subject, PullConsumer] = {}
        self._no_consumer: dict[Subject, float] = {}  # subject -> when to look for its consumer again
        self._expired_seen: dict[Subject, int] = {}  # each puller's expiry count at the last look

    async def bound(self, subject: Subject) -> PullConsumer | None:
        """The pull consumer of a subject; None while its shared consumer does not exist (looked
        up again once ``look_again`` is called for it, or after ``standby_s``)."""
        puller = self.by_subject.get(subject)
        if puller is not None and not puller.missing:
            return puller
        if time.monotonic() < self._no_consumer.get(subject, 0.0):
            return None
        consumer = await bind_job_consumer(self._js, self._names, *subject)
        if consumer is None:
            self._no_consumer[subject] = time.monotonic() + self._standby_s
            return None
        self._no_consumer.pop(subject, None)
        if puller is None:
            puller = await PullConsumer(self._nc, self._names.jobs_stream, consumer, self._dispatch).start()
            puller.on_end = self._on_end
            self.by_subject[subject] = puller
        puller.missing = False  # (set again when a request finds no consumer, 503)
        return puller

    def look_again(self, subject: Subject | None = None) -> bool:
        """Consumers found missing (of ``subject``; None: all) are looked up on their next use.
        True where one was missing."""
        if subject is not None:
            return self._no_consumer.pop(subject, None) is not None
        missing = bool(self._no_consumer)
        self._no_consumer.clear()
        return missing

    def outstanding(self) -> int:
        """Slots promised to open requests."""
        return sum(p.outstanding for p in self.by_subject.values())

    async def release(self, accepts: Callable[[Subject], bool]) -> None:
        """End, now, the open requests of every subject ``accepts`` no longer allows."""
        for subject in [s for s in self.by_subject if not accepts(s)]:
            puller = self.by_subject.pop(subject)
            await puller.cancel()
            await puller.close()
            self._expired_seen.pop(subject, None)

    async def reclaim(self, keep: Collection[Subject], now: float, rebalance_s: float) -> int:
        """Take back slots promised to waiting requests on subjects outside ``keep`` that
        delivered nothing for ``rebalance_s``. Returns how many came back."""
        freed = 0
        for subject, puller in list(self.by_subject.items()):
            held = puller.outstanding
            if held and subject not in keep and now - puller.last_delivery > rebalance_s:
                await puller.cancel()
                freed += held
        return freed

    async def tidy(self, keep: Collection[Subject]) -> None:
        """Cancel what should not wait on: requests of subjects outside ``keep`` (cooled down:
        their slots go back to the hot ones), and overlapping requests of a subject whose older
        request just expired (renewed as one)."""
        for subject, puller in list(self.by_subject.items()):
            expired, seen = puller.expired, self._expired_seen.get(subject, 0)
            self._expired_seen[subject] = expired
            if not puller.waiting:
                continue
            if subject not in keep or (expired != seen and puller.outstanding):
                await puller.cancel()

    async def cancel_all(self) -> None:
        """End every open request (a stop): a job the broker sent before that still runs."""
        for puller in self.by_subject.values():
            with suppress(Exception):
                await puller.cancel()
