"""The hf engine's decode loop: one background task advancing every active sequence a token a step.

Each iteration admits pending samples into the batch (``RequestScheduler``), runs one forward
pass over it on the step thread (``BatchStepper``; the event loop, and so NATS heartbeats, stays
responsive) and gives each sample its token. A pause lands between steps: the loop checks the
pause flag under the step lock, so ``pause()`` returns once the current step finished and no step
runs until ``resume()``. Idle, it hands finished rows to their sessions and lets idle sessions
expire on time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from rollfleet.runtime.aio import wait_event
from rollfleet.schemas.errors import EngineFailure
from rollfleet.workers.engines.base import Engine
from rollfleet.workers.engines.hf_batch import BatchStepper
from rollfleet.workers.engines.hf_requests import HFSeq
from rollfleet.workers.engines.hf_scheduler import RequestScheduler
from rollfleet.workers.engines.session_cache import SessionCache


class DecodeLoop:
    def __init__(
        self,
        engine: Engine,
        queue: RequestScheduler,
        stepper: BatchStepper,
        sessions: SessionCache,
        executor: ThreadPoolExecutor,
        *,
        max_batch: int,
        step_log_size: int,
    ) -> None:
        """``engine``: whose ``version`` is live at each step; ``executor``: the step thread."""
        self.engine = engine
        self.queue = queue
        self.stepper = stepper
        self.sessions = sessions
        self.executor = executor
        self.max_batch = max_batch
        self.max_len = 0  # the model's context, in tokens (set once it is loaded)
        # Observability and test hooks.
        self.steps = 0
        self.step_log: deque[tuple[int, int, tuple[str, ...]]] = deque(maxlen=step_log_size)
        self.failure: str | None = None  # why the loop died (a bug): the engine is unhealthy
        self.running = asyncio.Event()  # cleared from pause to resume: no step runs
        self.running.set()
        self.wake = asyncio.Event()
        self.step_lock = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None
        self.closed = False

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="hf-decode-loop")

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    async def stop(self) -> None:
        self.closed = True
        self.running.set()
        self.wake.set()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    async def pause(self) -> None:
        self.running.clear()
        async with self.step_lock:  # wait for the step in progress, if any
            pass

    def resume(self) -> None:
        self.running.set()
        self.wake.set()

    async def _run(self) -> None:
        try:
            await self._decode_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not a bad request: fail everything, report unhealthy
            self.failure = f"decode loop died: {type(exc).__name__}: {exc}"
            for req in list(self.queue.requests.values()):
                self.queue.fail(req, EngineFailure(self.failure))

    async def _decode_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed:
            if self.queue.idle():
                if self.stepper.batch.members:  # idle: finished rows go to their sessions now
                    async with self.step_lock:
                        await loop.run_in_executor(self.executor, self.stepper.settle)
                    continue
                self.wake.clear()
                if not await wait_event(self.wake, self.sessions.ttl_s):  # idle: sessions still expire
                    self.sessions.expire()
                continue
            await self.running.wait()
            async with self.step_lock:
                if not self.running.is_set() or self.closed:
                    continue  # paused between our check and the lock: do not step
                batch = self.queue.next_batch(self.max_batch)
                if not batch or not await self._step(loop, batch):
                    continue
            await asyncio.sleep(0)  # let abort/pause/new requests in between steps

    async def _step(self, loop: asyncio.AbstractEventLoop, batch: list[HFSeq]) -> bool:
        """One forward pass over ``batch`` on the step thread, its tokens then given to each;
        False when the pass failed (its requests failed with it)."""
        version = self.engine.version
        try:
            sampled = await loop.run_in_executor(self.executor, self.stepper.step, batch)
        except Exception as exc:  # a failed forward fails its requests, not the engine
            self.stepper.reset()
            err = EngineFailure(f"hf forward failed: {type(exc).__name__}: {exc}")
            for req in {s.req for s in batch}:
                self.queue.fail(req, err)
            return False
        self.steps += 1
        self.step_log.append((self.steps, version, tuple(sorted({s.req.rid for s in batch}))))
        for seq, (token, logprob) in zip(batch, sampled, strict=True):
            self.queue.advance(seq, token, logprob, version, self.max_len)
        return True
