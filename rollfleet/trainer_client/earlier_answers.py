"""Answers that came, or were stored, before this process asked for them.

A key may be answered before the handle asking for it exists here: delivered while no handle
waited (a restarted trainer asking again, or an answer arriving while ``submit`` awaited a
look-up), stored by an earlier process that died before using it, or answered by the job stored
earlier under the key and found answered again by the replica that pulled its copy
(``AnsweredNotice``). ``EarlierAnswers`` looks those up and settles the asking handle from them
(``Settler.settle``, judged as any answer); which stored answers answer a request, and when a
key is looked up before its job is stored, are ``answers``' pure rules.
"""

from __future__ import annotations

import time
from typing import Protocol

from rollfleet.broker.retry_call import call_retrying
from rollfleet.broker.topology import TopologyConfig
from rollfleet.broker.types import NATS, JetStreamContext
from rollfleet.runtime.aio import wait_event
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, Outcome, RolloutResult
from rollfleet.schemas.errors import RollfleetError
from rollfleet.trainer_client import answers
from rollfleet.trainer_client.answer_settling import Settler
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.inbox import ResultsInbox
from rollfleet.trainer_client.placement import PUBLISH_BUDGET_S

log = get_logger("rollfleet.client")


class AnswersHost(Protocol):
    """What the look-ups need of their client (``RolloutClient`` is one)."""

    nc: NATS
    js: JetStreamContext
    names: Names
    client_id: str
    topology: TopologyConfig
    default_timeout_s: float
    settler: Settler
    inbox: ResultsInbox


class EarlierAnswers:
    """The client's look-ups of answers its handles did not receive themselves."""

    def __init__(self, host: AnswersHost, handles: dict[str, RolloutHandle]) -> None:
        self._host = host
        self._handles = handles
        # Until then, a key given explicitly is looked up among the stored answers before its job
        # is stored (see answered_before).
        self.recheck_until = time.monotonic() + host.topology.duplicate_window_s

    def note_reconnected(self) -> None:
        """The broker may have restarted meanwhile: look keys up again for a duplicate window."""
        self.recheck_until = time.monotonic() + self._host.topology.duplicate_window_s

    def settle_unclaimed(self, handle: RolloutHandle) -> bool:
        """Settle the handle with an answer for its key that arrived while no handle waited for it
        (before a restarted trainer asked again, or while ``submit`` awaited a look-up)."""
        host = self._host
        unclaimed = host.inbox.take(handle.idempotency_key)
        if unclaimed is None or not host.settler.settle(handle, unclaimed):
            return False
        handle.stored = True
        return True

    async def answered_before(self, handle: RolloutHandle) -> bool:
        """Within a duplicate window of this client's start or of a reconnect, while the broker is
        away, or for a key this process already had answered, an explicit key is looked up among
        the stored answers before its job is stored (``answers.look_up_before_storing``): a broker
        that restarted meanwhile rebuilt its duplicate detection from the jobs it still stores, and
        a job that was answered and acked is no longer among them. The look-up waits for the
        broker (as storing would): a broker that does not answer is never taken for "nothing
        stored". It is a shortcut, not the guarantee: any key whose job is stored again (past the
        window, by any process) is the same job, and the replica that pulls it looks up its
        stored answers first, runs nothing if one is there and says so (``AnsweredNotice``), and
        this client settles the request from the stored answer (``settle_noticed``). A key still
        pending elsewhere is stored as the same job, which its claim keeps from running twice
        where it is claimed: ``JobIds``."""
        host = self._host
        answered_here = host.inbox.answered_here(handle.idempotency_key, handle.job_id)
        if not answers.look_up_before_storing(
            time.monotonic(), self.recheck_until, host.nc.is_connected, answered_here
        ):
            return False
        found = await self.stored_answer(handle)
        if found is None:
            return False
        self._handles.pop(handle.idempotency_key, None)
        handle.stored = True
        return host.settler.settle(handle, found)

    async def settle_noticed(self, handle: RolloutHandle) -> None:
        """A replica found the handle's job answered already and ran nothing (``AnsweredNotice``:
        the key was asked again past the broker's duplicate window, and its job stored again): the
        answer stored for the request settles it, judged as any answer (``Settler.settle``)."""
        key = handle.idempotency_key
        try:
            found = await self._settle_stored(handle)
        except RollfleetError as exc:  # (the broker away past the publish budget: its deadline ends it)
            log.warning("a replica found the job answered; its answer not read", idempotency_key=key, code=exc.code)
            return
        if not found:
            log.warning("a replica found the job answered; no answer is stored", idempotency_key=key)

    async def settle_waiting(self) -> None:
        """Every handle still waiting is settled from an answer stored for it, if there is one
        (a results consumer declared again from new answers on has missed what was stored while
        it was missing); one with none stored waits on as before."""
        settled = 0
        for handle in list(self._handles.values()):
            if handle.done():
                continue
            try:
                if await self._settle_stored(handle) and handle.done():
                    settled += 1
            except RollfleetError as exc:  # (the broker away again: its reconnect asks once more)
                log.warning("stored answers not read for the waiting handles", code=exc.code)
                return
        if settled:
            log.info("handles settled from answers stored while the results consumer was missing", settled=settled)

    async def _settle_stored(self, handle: RolloutHandle) -> bool:
        """Settle the handle from the answer stored for its request; False when none is stored."""
        key = handle.idempotency_key
        found = await self.stored_answer(handle)
        if found is None:
            return False
        if handle.done() or not self._host.settler.settle(handle, found):
            return True
        if self._handles.get(key) is handle:
            del self._handles[key]
        self._host.inbox.remember((key, found.job_id))  # (asked again here: looked up before storing)
        return True

    async def stored_answer(self, handle: RolloutHandle) -> Outcome | None:
        """The oldest stored answer to the handle's request, asked until the broker answers (as
        storing the job would be); ServiceUnavailable once that has taken the publish budget."""
        host = self._host
        key = handle.idempotency_key
        accepts = host.settler.accepts(handle)
        found = await call_retrying(
            lambda: answers.first_answer(
                host.js, host.names, host.client_id, key, handle.job.fingerprint, accepts, strict=True
            ),
            until=min(handle.job.deadline, time.time() + PUBLISH_BUDGET_S),
            what=f"look up the stored answers of {key!r}",
            nc=host.nc,
        )
        return None if found is None else found[1]

    async def result(self, idempotency_key: str, timeout: float | None) -> RolloutResult:
        """``RolloutClient.result``: the key's answer, from its handle here, from those that
        arrived unclaimed, or read back from the results stream."""
        host = self._host
        handle = self._handles.get(idempotency_key)
        if handle is not None:
            return await handle.result(timeout)
        unclaimed = host.inbox.unclaimed
        if idempotency_key not in unclaimed:
            # Delivered to an earlier process that died before using it: read it back.
            mine = host.settler.issued(idempotency_key)
            found = await answers.first_answer(host.js, host.names, host.client_id, idempotency_key, None, mine)
            if found is not None:
                unclaimed.setdefault(idempotency_key, found[1])
        wait = host.default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        while idempotency_key not in unclaimed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no result for {idempotency_key!r} within {wait:g} s")
            await wait_event(host.inbox.arrived, remaining)
        return host.settler.deliver(idempotency_key, unclaimed.pop(idempotency_key))
