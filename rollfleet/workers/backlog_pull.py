"""Pulling known backlog: subjects the scheduler knows hold jobs (a delivery said more waits
behind it, a bell, a scan of the queue depths), best subject first, into the free slots.

A subject with no request open is fetched at once (``no_wait``): what is queued comes, the rest
of the slots go on to the next subject; a listened one whose last delivery said at least as many
jobs wait as slots are free gets a waiting request instead (it fills at once, and goes on taking
what comes). One whose waiting request is open is topped up with what its last delivery said
still waits, no more: slots parked on a subject with little left would idle
while older backlog elsewhere waits (campaign 8, seed 101: a restarted replica parked its free
slots on a hot subject it had just drained with a waiting request, while a job of another subject
expired). A subject whose waiting request got nothing for ``rebalance_s`` has no backlog left
(others took it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

from rollfleet.runtime.logs import debug_enabled
from rollfleet.workers.pull_placement import QuietClock
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion, Subject
from rollfleet.workers.subject_pullers import SubjectPullers

# How long the pull loop waits for a ``no_wait`` request's answer before it goes on to the next
# subject. A live broker answers one at once (its messages, or 404); one unanswered for this long
# was delayed or lost, and every other subject's backlog waited behind it while the loop waited
# its whole 5 s (campaign seed 747605: a replica just thawed from SIGSTOP sat 5 s with free
# slots, its first fetch unanswered, while a job it could serve expired). The request stays
# open: what it delivers later is run, and its end frees it as any request's does.
NO_WAIT_ANSWER_S = 0.5

# A pull pass that took longer than this is said (debug): it awaited the broker, and nothing
# else was pulled meanwhile (campaign 8, seed 101: a replica with free slots and stalled bells
# fetched nothing for 1.8 s, and its log could not say why).
SLOW_PASS_S = 0.5

FetchTold = Literal["served", "empty", "unknown", "unanswered"]


def fetch_told(fetched: int, *, answered: bool, missing: bool) -> FetchTold:
    """What a ``no_wait`` fetch says of its subject's backlog: ``served`` (it delivered),
    ``empty`` (answered with nothing), ``unknown`` (the consumer was missing: looked up on the
    next pass) or ``unanswered`` (no answer yet: neither served nor empty; the next pass, or a
    bell, looks again)."""
    if fetched:
        return "served"
    if not answered:
        return "unanswered"
    return "unknown" if missing else "empty"


PullStep = Literal["wait", "fetch", "leave"]


def pull_step(*, waiting: bool, busy: bool, listened: bool, known: int | None, free: int) -> tuple[PullStep, int]:
    """How to pull a subject known to hold backlog into ``free`` slots, and how many to ask for:
    ``wait``, a waiting request (a top-up beside one open, or a new one where the subject is
    listened and its last delivery said at least ``free`` jobs wait: it fills at once), asking
    for what that delivery said still waits (``known``; one where none said), never more;
    ``fetch``, a ``no_wait`` fetch of what is queued now (no request open); ``leave``, a
    ``no_wait`` request of its own still open."""
    if waiting or (listened and not busy and known is not None and known >= free):
        return "wait", min(free, 1 if known is None else known)
    if not busy:
        return "fetch", free
    return "leave", 0


class BacklogPull:
    def __init__(
        self,
        subjects: SubjectPullers,
        scheduler: SubjectScheduler,
        served: ServedVersion,
        quiet: QuietClock,
        *,
        wait_pull_s: float,
        free: Callable[[], int],
        stopping: asyncio.Event,
        log: Any,
    ) -> None:
        self._subjects = subjects
        self._scheduler = scheduler
        self._served = served
        self._quiet = quiet
        self._wait_pull_s = wait_pull_s
        self._free = free  # slots neither running a job nor promised to an open request
        self._stopping = stopping
        self._log = log
        self._debug = debug_enabled(log)

    def forget_drained(self, now: float) -> None:
        """A subject known to have backlog whose waiting request got nothing for rebalance_s has
        none left (others took it): stop treating it as backlog."""
        for subject in self._scheduler.order(now):
            puller = self._subjects.by_subject.get(subject)
            if puller is not None and puller.waiting and self._quiet.quiet(puller, now):
                self._scheduler.note_empty(subject)

    async def pull(self, free: int, now: float, listen: list[Subject]) -> int:
        """Pull known backlog, best subject first; returns the slots still free. ``listen``: the
        subjects work is expected on (a waiting request there is no waste while jobs queue)."""
        for subject in self._scheduler.order(now):
            if free <= 0 or self._stopping.is_set():
                break
            if not self._served.accepts(subject):
                continue
            puller = await self._subjects.bound(subject)
            if puller is None:  # no job was ever submitted there
                if self._debug:  # (said: a subject dropped here waits for its next bell)
                    self._log.debug("backlog subject has no consumer", subject=str(subject))
                self._scheduler.note_empty(subject)
                continue
            step, want = pull_step(
                waiting=puller.waiting,
                busy=puller.busy,
                listened=subject in listen,
                known=self._scheduler.known_pending(subject),
                free=free,
            )
            if step == "wait":
                if self._debug:
                    self._log.debug("backlog topped up", subject=str(subject), asked=want, free=free)
                if want > 0:  # (0: asked for all the last delivery said waits; it is on its way)
                    await puller.request(want, wait_s=self._wait_pull_s)
                    self._scheduler.note_asked(subject, want)
                    self._scheduler.note_served(subject, now)
            elif step == "fetch":
                asked = time.monotonic()
                fetched = await puller.fetch_now(free, timeout=NO_WAIT_ANSWER_S)
                told = fetch_told(fetched, answered=not puller.busy, missing=puller.missing)
                if self._debug:
                    self._log.debug("backlog fetched", subject=str(subject), fetched=fetched, told=told)
                if told == "served":
                    self._scheduler.note_served(subject, asked)
                elif told == "empty":
                    self._scheduler.note_empty(subject)
            else:
                if self._debug:
                    self._log.debug("backlog left to a busy request", subject=str(subject))
            free = self._free()
        return free

    # -- what a stalled pull loop says (debug) ---------------------------------------------------
    def say_slow_pass(self, began: float) -> None:
        """A pass of the pull loop begun at ``began`` (monotonic) that took over ``SLOW_PASS_S``."""
        if self._debug and (took := time.monotonic() - began) > SLOW_PASS_S:
            self._log.debug("pull pass slow", took_s=round(took, 3), free=self._free())

    def say_held(self, in_flight: int, capacity: int) -> None:
        """Backlog is known and no slot is free, though fewer jobs run than ``capacity``: the
        slots are promised to open requests; which."""
        if self._debug and in_flight < capacity and self._free() <= 0:
            held = {str(s): p.outstanding for s, p in self._subjects.by_subject.items() if p.outstanding}
            self._log.debug("backlog waits behind open requests", in_flight=in_flight, held=held)
