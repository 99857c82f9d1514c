"""One delivery of a job as it runs on this worker: its message, its claim's state, its
checkpoints, and the flags that end it early (handed back by a drain, cancelled by its trainer,
its claim lost to another replica)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollfleet.broker.types import Msg
from rollfleet.schemas import RolloutJob
from rollfleet.workers.engines import Engine
from rollfleet.workers.progress_log import ProgressLog


@dataclass(eq=False)
class RunningJob:
    msg: Msg
    job: RolloutJob
    since: float = field(default_factory=time.monotonic)  # for progress acks
    handed_back: bool = False  # an activation's drain gave up on it: discard whatever it produced
    cancelled: bool = False  # its trainer cancelled it: stopped, and answered with what it made
    claimed_at: float | None = None  # when its claim was last written (claimed jobs)
    claim_revision: int | None = None  # of our last write of the claim (resumable jobs refresh by it)
    # The stamp (this process's clock) of our write of the claim last found current: how fresh
    # the proof is that no other replica has written over it (``claims.proof_of_holding``).
    claim_proved_at: float | None = None
    took_over: bool = False  # its claim was taken over from a holder that stopped
    claim_lost: bool = False  # its claim changed under it (another replica has the job): answer nothing
    progress: ProgressLog | None = None  # resumable jobs: its checkpoints
    # The engine requests it runs (a resumed job runs one per unfinished sample): what is aborted.
    request_ids: list[str] = field(default_factory=list)

    async def abort(self, engine: Engine) -> None:
        for rid in self.request_ids or [self.job.job_id]:
            await engine.abort(rid)
