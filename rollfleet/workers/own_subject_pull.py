"""Pulling from this replica's own subject, where sessions' sticky turns for it wait.

Its consumer is the trainer's to create, with the first turn; it goes after
``consumer_inactive_s`` idle, so a missing one is looked up again. A bell says a turn waits
(``pending``); turns are fetched into free slots, and ``pending`` holds until a fetch leaves a
slot unfilled (more turns ring again). Turns that find no slot wait there, and their clients
move them to the shared subjects after a bounded wait.
"""

from __future__ import annotations

from collections.abc import Callable

from rollfleet.broker.pull_consumer import PullConsumer
from rollfleet.broker.topology import bind_replica_consumer
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.schemas import Names
from rollfleet.workers.backlog_pull import NO_WAIT_ANSWER_S, fetch_told


class OwnSubjectPull:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        names: Names,
        worker_id: str,
        *,
        dispatch: Callable[[Msg], None],
        on_end: Callable[[], None],
    ) -> None:
        self._nc, self._js, self._names = nc, js, names
        self._worker_id = worker_id
        self._dispatch = dispatch
        self._on_end = on_end
        self.consumer: PullConsumer | None = None
        self.pending = False  # a bell said a job waits there

    async def fetch(self, free: int) -> bool:
        """Fetch what waits into ``free`` slots; True where it filled them all (more may wait)."""
        if self.consumer is None or self.consumer.missing:  # (gone after consumer_inactive_s idle: look again)
            consumer = await bind_replica_consumer(self._js, self._names, self._worker_id)
            if consumer is None:
                self.pending = False  # (the trainer creates it with the first turn)
                return False
            if self.consumer is None:
                self.consumer = await PullConsumer(self._nc, self._names.jobs_stream, consumer, self._dispatch).start()
                self.consumer.on_end = self._on_end
            self.consumer.missing = False
        if self.consumer.busy:
            return False
        got = await self.consumer.fetch_now(free, timeout=NO_WAIT_ANSWER_S)
        told = fetch_told(got, answered=not self.consumer.busy, missing=self.consumer.missing)
        if told == "unanswered":
            return False  # (still pending: the next pass looks again)
        if got < free:
            self.pending = False  # drained (more turns ring again)
            return False
        return True
