"""An info line per interval for operators: the version served, jobs done and their rate, jobs
running and the outcomes so far (per-job lines are at debug level). Silent while idle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """What a replica has done so far, read at one moment."""

    version: int
    jobs_done: int
    in_flight: int
    outcomes: dict[str, int]


async def report_progress(log: Any, every_s: float, read: Callable[[], Progress]) -> None:
    """Say ``read()``'s progress every ``every_s`` while jobs were done or run. Runs until cancelled."""
    last_done, last_t = read().jobs_done, time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        now = time.monotonic()
        progress = read()
        done = progress.jobs_done - last_done
        if done or progress.in_flight:
            log.info(
                "progress",
                version=progress.version,
                jobs_done=progress.jobs_done,
                jobs_per_s=round(done / (now - last_t), 2),
                in_flight=progress.in_flight,
                outcomes=progress.outcomes,
            )
        last_done, last_t = progress.jobs_done, now
