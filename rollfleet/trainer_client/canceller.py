"""Carrying out ``RolloutHandle.cancel``: withdraw the job, or stop it where it runs.

The decisions are ``cancelling``'s pure rules (what the first cancel of a handle does, whether
the fleet must be asked to stop it, what the answer says happened); ``Canceller`` does the I/O
between them: it removes the job from the queue, asks whether a replica was delivered it, asks
the fleet to stop it, and waits for its answer.
"""

from __future__ import annotations

import asyncio
import weakref
from contextlib import suppress

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.types import NATS
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, RolloutResult, claim_key
from rollfleet.schemas.errors import BrokerError, Cancelled, RollfleetError
from rollfleet.trainer_client import cancelling
from rollfleet.trainer_client.cancelling import CancelOutcome
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.placement import JobPlacement

log = get_logger("rollfleet.client")


class Canceller:
    """Each handle's one cancel, kept while the handle lives (``cancelling.next_cancel``)."""

    def __init__(
        self,
        nc: NATS,
        names: Names,
        client_id: str,
        handles: dict[str, RolloutHandle],
        placement: JobPlacement,
        metrics: ClientMetrics,
    ) -> None:
        self.nc = nc
        self.names = names
        self.client_id = client_id
        self._handles = handles
        self.placement = placement
        self.metrics = metrics
        self._cancels: weakref.WeakKeyDictionary[RolloutHandle, asyncio.Future[CancelOutcome]] = (
            weakref.WeakKeyDictionary()
        )

    async def cancel(self, handle: RolloutHandle, timeout: float) -> CancelOutcome:
        """``RolloutHandle.cancel``: withdrawn if nobody took it, else stopped where it runs and
        answered from there (``cancelling``). The first cancel of a handle decides; any other
        joins it (``cancelling.next_cancel``), waiting as long as the first one waits."""
        earlier = self._cancels.get(handle)
        step = cancelling.next_cancel(_earlier_cancel(earlier), handle.done())
        if step == "answered":
            return "answered"
        if step == "cancel" or earlier is None:
            # A task, not the caller's own await: a first caller that is itself cancelled leaves
            # the decision running for those who joined it.
            earlier = asyncio.ensure_future(self._cancel_once(handle, timeout))
            self._cancels[handle] = earlier
        return await asyncio.shield(earlier)

    async def _cancel_once(self, handle: RolloutHandle, timeout: float) -> CancelOutcome:
        key = handle.idempotency_key
        async with handle.placing:  # (a move or requeue under way ends first; none comes after)
            handle.cancelled = True
            removed = await self.placement.delete(handle)  # (queued or running: never delivered again)
            # Asked after the removal, not before: a delivery between the two looks (campaign 10,
            # seed 6803: "withdrawn", yet the replica it reached ran and answered it) is seen, and
            # none can follow a removal (the consumer counts a delivery as it sends it).
            delivered = await self.placement.delivered(handle)
        if not cancelling.must_stop(delivered, removed):
            self._handles.pop(key, None)
            handle.set_error(Cancelled(f"{key!r} withdrawn before a replica took it"))
            self.metrics.cancelled.labels(client_id=self.client_id, outcome="withdrawn").inc()
            return "withdrawn"
        with suppress(BrokerError), typed_errors():
            await self.nc.publish(self.names.cancel_subject(), claim_key(handle.job_id).encode())
        answer: RolloutResult | RollfleetError | None = None
        try:
            answer = await handle.result(timeout)
        except RollfleetError as exc:
            answer = exc
        except TimeoutError:
            self._handles.pop(key, None)
            handle.set_error(Cancelled(f"{key!r} cancelled; no answer came in {timeout:g} s"))
        outcome = cancelling.outcome_of(answer)
        self.metrics.cancelled.labels(client_id=self.client_id, outcome=outcome).inc()
        log.info("cancelled", idempotency_key=key, outcome=outcome)
        return outcome


def _earlier_cancel(task: asyncio.Future[CancelOutcome] | None) -> cancelling.EarlierCancel:
    """The facts ``cancelling.next_cancel`` reads about a handle's earlier cancel."""
    if task is None:
        return "none"
    if not task.done():
        return "deciding"
    return "failed" if task.cancelled() or task.exception() is not None else "decided"
