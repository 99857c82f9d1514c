"""An activation's drain: exact jobs of the version being left are no longer taken, and those
running may finish, bounded, so that every exact job runs entirely at its version or not at
all. Past the bound they are aborted and handed back unanswered (another replica at that
version may serve them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping

from rollfleet.runtime.aio import wait_event
from rollfleet.workers.engines import Engine
from rollfleet.workers.running_job import RunningJob


def pinned_to(runs: Iterable[RunningJob], version: int) -> list[RunningJob]:
    """The running jobs whose constraint is ``exact-<version>``, not yet handed back."""
    return [
        r
        for r in runs
        if r.job.constraint.kind == "exact" and r.job.constraint.version == version and not r.handed_back
    ]


async def drain_exact(
    running: Mapping[int, RunningJob], changed: asyncio.Event, engine: Engine, version: int, bound_s: float
) -> tuple[float, int]:
    """Wait until no admitted ``exact-<version>`` job is ``running``; past ``bound_s``, abort
    them and hand them back unanswered. ``changed`` is set whenever a running job ends.
    Returns (seconds waited, jobs handed back)."""
    t0 = time.monotonic()
    deadline = t0 + bound_s
    while pinned_to(running.values(), version) and time.monotonic() < deadline:
        changed.clear()
        await wait_event(changed, max(0.0, deadline - time.monotonic()))
    late = pinned_to(running.values(), version)
    for run in late:
        run.handed_back = True
        await run.abort(engine)
    while any(r.handed_back for r in running.values()):  # until they have unwound (nak)
        changed.clear()
        await wait_event(changed, 1.0)
    return time.monotonic() - t0, len(late)
