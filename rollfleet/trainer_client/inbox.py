"""A client's answers arriving: its results consumer, read as answers are stored.

``ResultsInbox`` keeps pull requests open on the client's results consumer (a second request
is added when the first is half used, so an answer never waits for one to be renewed), reads
each answer whole (a chunked one's chunks by subject), drops what is not authentic or not this
client id's own, and drops a late duplicate of an answer already handed out. Each answer goes
to the handle waiting for its key; one nobody waits for is kept as *unclaimed* (an answer that
arrived before a restarted trainer asked again, or, for a shared client id, another process's).

A replica that found a job answered already (a key asked again past the broker's duplicate
window is stored again as the same job) stores no second answer, only an ``AnsweredNotice``: the
handle waiting for that job is handed to ``noticed``, which reads the job's stored answer and
settles it as any answer is settled. A notice carries no answer, so one for a job nobody here
waits for is dropped, and a forged one costs a look-up, never a wrong answer.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.pull_consumer import PullConsumer
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    AnsweredNotice,
    ChunkedOutcome,
    Names,
    Outcome,
    decode,
    decode_outcome,
)
from rollfleet.schemas.errors import BrokerError, RollfleetError, ServiceUnavailable
from rollfleet.trainer_client import answers
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.own_job_ids import JobIds

log = get_logger("rollfleet.client")

DELIVERED_MEMORY = 100_000  # keys whose result was already handed out (drop late duplicates)
_SHARED_UNCLAIMED = 4096  # answers kept for a key no handle of this instance waits on (shared id)
_RESULTS_BATCH = 512
_RESULTS_WAIT_S = 30.0  # the results request's expiry; a lost one is replaced on reconnect or leader change
_CHUNKS_PATIENCE = 20  # deliveries of an answer head whose chunks cannot be read, before it is given up

Settle = Callable[[RolloutHandle, Outcome], bool]  # hand an answer to its handle; True once settled
Noticed = Callable[[RolloutHandle], None]  # a handle whose job a replica found answered already


class ResultsInbox:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        names: Names,
        handles: dict[str, RolloutHandle],
        settle: Settle,
        *,
        shared: bool,
        noticed: Noticed | None = None,
    ) -> None:
        self._nc, self._js, self._names = nc, js, names
        self._handles = handles  # the client's handles by key (shared, not copied)
        self._settle = settle
        self._noticed = noticed
        self._shared = shared
        self.ids: JobIds | None = None
        self.consumer = ""
        self.unclaimed: dict[str, Outcome] = {}  # answers with no handle (e.g. from before a restart)
        self.arrived = asyncio.Event()  # set (and replaced) when an unclaimed answer arrives
        self.delivered: OrderedDict[tuple[str, str | None], None] = OrderedDict()  # (key, job id)
        # Called with every answer message received, before deduplication (for audits and tests).
        self.observe: Callable[[Outcome, int | None], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._puller: PullConsumer | None = None
        self._low = asyncio.Event()  # the results requests need renewing

    def start(self, consumer: str, ids: JobIds) -> None:
        self.consumer, self.ids = consumer, ids
        self._task = asyncio.create_task(self._receive(), name="results")

    @property
    def receiving(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        if self._task is not None:
            await stop_tasks([self._task])

    def renew(self) -> None:
        """Ask again at once (a reconnect, or a new consumer leader: the open request is gone)."""
        if self._puller is not None:
            self._puller.reset()

    def on_leader_change(self, consumer: str) -> None:
        if consumer == self.consumer:
            self.renew()

    def take(self, key: str) -> Outcome | None:
        """The unclaimed answer for ``key``, removed; None if there is none."""
        return self.unclaimed.pop(key, None)

    def answered_here(self, key: str, job_id: str | None) -> bool:
        return (key, job_id) in self.delivered

    def remember(self, answer: tuple[str, str | None]) -> None:
        self.delivered[answer] = None
        if len(self.delivered) > DELIVERED_MEMORY:
            self.delivered.popitem(last=False)

    async def _receive(self) -> None:
        """Keep pull requests open on the results consumer; each answer is handled the moment it
        is stored (no batch to fill, no poll interval)."""
        puller = await PullConsumer(self._nc, self._names.results_stream, self.consumer, self._on_message).start()
        self._puller = puller
        puller.on_end = self._low.set
        try:
            while True:
                self._low.clear()
                if puller.missing:  # no consumer leader answered (a fail-over): ask again shortly
                    puller.missing = False
                    await asyncio.sleep(0.25)
                try:
                    if puller.outstanding <= _RESULTS_BATCH // 2 and (puller.waiting or not puller.busy):
                        with typed_errors():
                            await puller.request(_RESULTS_BATCH, wait_s=_RESULTS_WAIT_S)
                except (BrokerError, OSError) as exc:  # reconnecting
                    log.debug("results pull failed", error=str(exc))
                    await asyncio.sleep(0.5)
                    continue
                # Woken when half used or a request ended; the timer notices an overdue request.
                timer = asyncio.get_running_loop().call_later(1.0, self._low.set)
                try:
                    await self._low.wait()
                finally:
                    timer.cancel()
        finally:
            await puller.close()

    async def _on_message(self, msg: Msg) -> None:
        subject = msg.subject
        if self._names.is_answered_notice(subject):
            self.notice(msg.data)
            with suppress(Exception):
                await msg.ack()
            return
        if self._names.is_result_chunk(subject):
            with suppress(Exception):  # read with its head, by subject
                await msg.ack()
            return
        try:
            stored = decode_outcome(msg.data)
            # (Most answers are whole: only a chunked one is read back, with no coroutine for the rest.)
            if isinstance(stored, ChunkedOutcome):
                outcome = await answers.whole(self._js, self._names, subject, stored)
            else:
                outcome = stored
        except BrokerError as exc:  # chunks unreadable now: redelivered later (before RollfleetError)
            if _deliveries(msg) < _CHUNKS_PATIENCE:
                log.warning("result chunks not readable yet", error=str(exc), subject=subject)
                with suppress(Exception):
                    await msg.nak(delay=1.0)
                return
            log.error("result chunks never became readable; answer dropped", subject=subject)
            self._chunks_lost(stored)
        except RollfleetError as exc:
            log.warning("undecodable result dropped", error=exc.message, subject=subject)
        else:
            if not answers.authentic(self._names, subject, outcome):
                log.warning(
                    "answer stored under another replica's or job's subject dropped",
                    subject=subject,
                    worker_id=outcome.worker_id,
                    job_id=outcome.job_id,
                )
            else:
                if self.observe is not None:
                    self.observe(outcome, _stream_seq(msg))
                self.deliver(outcome)
        puller = self._puller
        if puller is not None and puller.outstanding == _RESULTS_BATCH // 2:
            self._low.set()
        with suppress(Exception):
            await msg.ack()

    def notice(self, data: bytes) -> None:
        """A replica's ``AnsweredNotice`` (its bytes): it found a job answered already and ran
        nothing. The handle waiting for that very job (its key, and the one job id of the key)
        reads the stored answer (``noticed``); nobody else does anything."""
        try:
            notice = decode(data, AnsweredNotice, what="answered notice")
        except RollfleetError as exc:
            log.warning("undecodable notice dropped", error=exc.message)
            return
        key = notice.idempotency_key
        handle = self._handles.get(key)
        if handle is None or handle.done() or handle.job_id != notice.job_id or self._noticed is None:
            return  # (answered meanwhile, or nobody here asked for that job)
        self._noticed(handle)

    def _issued(self, job_id: str | None, key: str) -> bool:
        return self.ids is not None and self.ids.issued(job_id, key)

    def _chunks_lost(self, head: Any) -> None:
        """An answer whose chunks stayed unreadable: its request fails (retryable) instead of
        waiting for its deadline."""
        if not isinstance(head, ChunkedOutcome):
            return
        handle = self._handles.get(head.idempotency_key)
        if handle is not None and self._issued(head.job_id, head.idempotency_key):
            self._handles.pop(head.idempotency_key, None)
            handle.set_error(ServiceUnavailable(f"the stored answer of {head.idempotency_key!r} cannot be read back"))

    def deliver(self, outcome: Outcome) -> None:
        key = outcome.idempotency_key
        answer = (key, outcome.job_id)
        handle = self._handles.get(key)
        if answer in self.delivered and handle is None:
            return  # one answer per job: a late duplicate nobody waits for is dropped
        # (A handle waiting for a key answered before was stored again because its stored answer
        # is gone: the broker lost it with its store. The job id is the key's, so the new run's
        # answer has the same (key, job id) and is the one it waits for, not a duplicate.)
        if not self._issued(outcome.job_id, key):
            log.warning("answer to a job this client never issued dropped", idempotency_key=key, job_id=outcome.job_id)
            return
        if handle is not None:
            if self._settle(handle, outcome):
                self._handles.pop(key, None)
                self.remember(answer)
            return
        self.remember(answer)
        self.keep(key, outcome)

    def keep(self, key: str, outcome: Outcome) -> None:
        """Keep an answer nobody waits for yet. Nobody is asking: keep the newest only (a shared
        id's instance sees every other's answers too, and keeps fewer: a retry of one finds it,
        or looks it up in the stream)."""
        self.unclaimed[key] = outcome
        if len(self.unclaimed) > (_SHARED_UNCLAIMED if self._shared else DELIVERED_MEMORY):
            self.unclaimed.pop(next(iter(self.unclaimed)))
        event, self.arrived = self.arrived, asyncio.Event()
        event.set()


def _stream_seq(msg: Msg) -> int | None:
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:  # not a JetStream message
        return None


def _deliveries(msg: Msg) -> int:
    try:
        return int(msg.metadata.num_delivered)
    except Exception:
        return 1
