"""RolloutHandle: the awaitable a caller holds for one submitted job.

The client that created a handle settles it (``set_result`` / ``set_error``) when the job's
answer arrives or its deadline passes; the caller only awaits or cancels it. Cancelling
goes through the ``cancel`` function the client gave the handle (``trainer_client.cancelling``).

A handle also says where its job is stored (``subject``, ``stream_seq``, ``replica``) and the
bytes stored there (moved as they are, so the job keeps its id and its one answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from rollfleet.schemas import RolloutJob, RolloutResult
from rollfleet.trainer_client.cancelling import CancelOutcome


class RolloutHandle:
    """``await handle`` returns a ``RolloutResult`` or raises the job's typed error (``Expired``,
    ``NoCompatibleReplica``, ``InvalidRequest``, ...)."""

    def __init__(
        self,
        job: RolloutJob,
        data: bytes,
        cancel: Callable[[RolloutHandle, float], Awaitable[CancelOutcome]],
    ) -> None:
        self.job = job
        self.data = data  # the job as stored (moved as is: the same job id wherever it runs)
        self.stored = False  # its key is spent: a job was stored under it, or an answer was found
        self.subject: str | None = None  # where it is stored
        self.stream_seq: int | None = None  # its sequence in the jobs stream, when known
        self.replica: str | None = None  # stored on this replica's own subject (a session's sticky turn)
        self.moves = 0  # times moved from a replica's own subject to the shared one
        # Its caller waits, within its deadline, for a replica that can serve it to be started,
        # rather than take NoCompatibleReplica (``submit(..., wait_for_replica=True)``).
        self.waits_for_replica = False
        # Its caller cancelled it: it is never stored again (a move off its replica, or a requeue
        # when its holder is gone, would run it for nobody). Set under ``placing``, which every
        # change of where the job lies holds: no move under way outlives the cancel's withdrawal.
        self.cancelled = False
        self.placing = asyncio.Lock()
        self._cancel = cancel
        self._future: asyncio.Future[RolloutResult] = asyncio.get_running_loop().create_future()

    @property
    def idempotency_key(self) -> str:
        return self.job.idempotency_key

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def adopt(self, job: RolloutJob, data: bytes, subject: str, seq: int, replica: str | None) -> None:
        """The job this handle asked for is already stored (a resubmission): follow that one."""
        self.job, self.data = job, data
        self.subject, self.stream_seq, self.replica = subject, seq, replica

    def done(self) -> bool:
        return self._future.done()

    def settled_result(self) -> RolloutResult | None:
        """The result it was settled with; None while unsettled or when it holds an error."""
        if not self._future.done() or self._future.cancelled() or self._future.exception() is not None:
            return None
        return self._future.result()

    def __await__(self) -> Generator[Any, None, RolloutResult]:
        return self._future.__await__()

    async def result(self, timeout: float | None = None) -> RolloutResult:
        return await asyncio.wait_for(asyncio.shield(self._future), timeout)

    async def cancel(self, timeout: float = 10.0) -> CancelOutcome:
        """Cancel the job, and say what happened:

        - ``"withdrawn"``: no replica had taken it; it never runs (the handle raises ``Cancelled``);
        - ``"stopped"``: a replica was running it and stopped within about a second, freeing its
          slot; the handle holds its answer, the tokens made so far (finish reason ``"abort"``),
          or raises ``Cancelled`` if it had not started generating;
        - ``"answered"``: it had been answered already (the handle holds that answer);
        - ``"unknown"``: no answer came within ``timeout`` (the broker away, or its replica gone);
          the handle raises ``Cancelled``, and the job is not delivered again.
        """
        return await self._cancel(self, timeout)

    # -- settled by the client that owns the handle --------------------------------------------

    def set_result(self, result: RolloutResult) -> bool:
        """Settle with a result; False if the handle was already settled."""
        if self._future.done():
            return False
        self._future.set_result(result)
        return True

    def set_error(self, exc: BaseException) -> bool:
        """Settle with an error; False if the handle was already settled."""
        if self._future.done():
            return False
        self._future.set_exception(exc)
        self._future.exception()  # retrieved: an unawaited failed handle does not warn at exit
        return True
