"""The pull loop's walk over known backlog, when a subject's ``no_wait`` fetch goes unanswered.

A live broker answers a ``no_wait`` pull request at once. One left unanswered (campaign seed
747605: a replica just thawed from SIGSTOP, its first fetch never answered) held the whole loop
for the fetch's 5 s while a job the replica could serve, on another subject, expired. The loop
now waits ``NO_WAIT_ANSWER_S`` and goes on; the unanswered subject stays known backlog.
The pullers here stand in for ``broker.PullConsumer`` (the loop's decisions are under test, not
NATS; ``tests/test_wakeups.py`` and the campaign drive the real consumers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollfleet.workers.backlog_pull import NO_WAIT_ANSWER_S, BacklogPull, fetch_told, pull_step
from rollfleet.workers.pull_placement import QuietClock
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion, Subject


class Puller:
    """A subject's pull consumer: ``answers`` says whether its ``no_wait`` request is answered
    (with ``queued`` messages) or left open."""

    def __init__(self, answers: bool, queued: int, waiting: bool = False) -> None:
        self.answers, self.queued = answers, queued
        self.waiting = self.busy = waiting  # (a waiting request open, holding ``outstanding`` slots)
        self.missing = False
        self.outstanding = 1 if waiting else 0
        self.asked_timeouts: list[float] = []
        self.requested: list[int] = []  # batches of waiting requests (top-ups)

    async def fetch_now(self, batch: int, timeout: float = 5.0) -> int:
        self.asked_timeouts.append(timeout)
        if self.answers:
            got = min(batch, self.queued)
            self.queued -= got
            return got
        self.busy = True  # (its request stays open)
        await asyncio.sleep(timeout)
        return 0

    async def request(self, batch: int, wait_s: float | None = None) -> None:
        self.requested.append(batch)
        self.outstanding += batch


class Pullers:
    def __init__(self, by_subject: dict[Subject, Puller]) -> None:
        self.by_subject = by_subject

    async def bound(self, subject: Subject) -> Puller | None:
        return self.by_subject.get(subject)


def backlog(
    pullers: dict[Subject, Puller], scheduler: SubjectScheduler, free: Callable[[], int], wait_pull_s: float = 240.0
) -> BacklogPull:
    """The walk over ``pullers``, with ``free`` slots (stand-in consumers, a real scheduler)."""
    return BacklogPull(
        Pullers(pullers),  # type: ignore[arg-type]
        scheduler,
        scheduler.served,
        QuietClock(1.0),
        wait_pull_s=wait_pull_s,
        free=free,
        stopping=asyncio.Event(),
        log=logging.getLogger("test"),
    )


def test_how_a_subject_with_backlog_is_pulled() -> None:
    """The decision alone: a waiting request is topped up with what its last delivery said waits
    (one where none said); a listened subject with at least as many queued as free slots gets a
    waiting request that fills at once; any other subject with no request open is fetched no_wait."""
    assert pull_step(waiting=True, busy=True, listened=False, known=None, free=3) == ("wait", 1)
    assert pull_step(waiting=True, busy=True, listened=True, known=2, free=3) == ("wait", 2)
    assert pull_step(waiting=True, busy=True, listened=True, known=0, free=3) == ("wait", 0)
    assert pull_step(waiting=False, busy=False, listened=True, known=5, free=3) == ("wait", 3)
    assert pull_step(waiting=False, busy=False, listened=True, known=2, free=3) == ("fetch", 3)
    assert pull_step(waiting=False, busy=False, listened=True, known=None, free=3) == ("fetch", 3)
    assert pull_step(waiting=False, busy=False, listened=False, known=9, free=3) == ("fetch", 3)
    assert pull_step(waiting=False, busy=True, listened=True, known=9, free=3) == ("leave", 0)


def test_what_a_fetch_says_of_its_subject() -> None:
    assert fetch_told(2, answered=True, missing=False) == "served"
    assert fetch_told(1, answered=False, missing=False) == "served"
    assert fetch_told(0, answered=True, missing=False) == "empty"
    assert fetch_told(0, answered=True, missing=True) == "unknown"
    assert fetch_told(0, answered=False, missing=False) == "unanswered"


async def test_an_unanswered_fetch_holds_the_loop_only_briefly_and_its_subject_stays_backlog() -> None:
    served = ServedVersion(13)
    scheduler = SubjectScheduler(served)
    stuck, ready = Puller(answers=False, queued=1), Puller(answers=True, queued=1)
    # min-5 has waited longest (it is fetched first); min-12 holds the job that must not wait.
    scheduler.note_pending(("min", 5), 100.0, waited_s=12.0)
    scheduler.note_pending(("min", 12), 100.0, waited_s=3.0)
    free = [3]
    loop = backlog({("min", 5): stuck, ("min", 12): ready}, scheduler, lambda: free[0], wait_pull_s=5.0)
    left = await loop.pull(3, 100.0, [])
    assert stuck.asked_timeouts == [NO_WAIT_ANSWER_S] and NO_WAIT_ANSWER_S <= 1.0
    assert ready.asked_timeouts  # the loop went on to min-12
    assert left == 3 and ("min", 5) in scheduler.order(100.0)  # unanswered: neither served nor empty


async def test_backlog_never_parks_every_free_slot_on_one_subject() -> None:
    """Campaign 8, seed 101: a restarted replica drained a hot subject (``min-4``) and, in the next
    pass, asked it for all its free slots with a waiting request (the subject was hot), which held
    them while ``min-13`` and ``min-14``'s older jobs waited; one expired. A subject with no request
    open is fetched ``no_wait`` (what is queued comes, the rest goes on); one with a waiting request
    is topped up with what its last delivery said still waits, no more."""
    served = ServedVersion(19)
    scheduler = SubjectScheduler(served)
    hot, older = Puller(answers=True, queued=0), Puller(answers=True, queued=2)
    busy = Puller(answers=True, queued=0, waiting=True)
    scheduler.note_pending(("min", 4), 100.0, waited_s=14.0)
    scheduler.note_pending(("min", 13), 100.0, waited_s=11.0)
    scheduler.note_delivered(("min", 16), 100.0, age_s=9.0, pending=1)  # its waiting request got one; 1 waits
    pullers = {("min", 4): hot, ("min", 13): older, ("min", 16): busy}
    ran = [0]

    def free() -> int:
        return 4 - ran[0] - sum(p.outstanding for p in pullers.values())

    loop = backlog(pullers, scheduler, free, wait_pull_s=240.0)
    left = await loop.pull(free(), 100.0, [("min", 4), ("min", 16), ("min", 19)])  # min-4 and min-16 hot
    assert hot.requested == [] and hot.asked_timeouts == [NO_WAIT_ANSWER_S]  # fetched, not parked on
    assert older.queued == 0  # min-13's two jobs came
    assert busy.requested == [1]  # topped up with the one its delivery said waits, not every slot
    assert ("min", 4) not in scheduler.order(100.0)  # answered empty
    assert left == free()


async def test_a_listened_subject_with_more_queued_than_slots_gets_a_waiting_request() -> None:
    """Under load the queue holds more than the free slots: a waiting request fills at once and goes
    on taking what comes (no round trip per fetch); with fewer queued, a fetch takes them."""
    served = ServedVersion(3)
    scheduler = SubjectScheduler(served)
    deep, shallow = Puller(answers=True, queued=9), Puller(answers=True, queued=1)
    scheduler.note_delivered(("min", 3), 100.0, age_s=0.1, pending=9)
    scheduler.note_delivered(("min", 2), 100.0, age_s=0.1, pending=1)
    pullers = {("min", 3): deep, ("min", 2): shallow}
    loop = backlog(pullers, scheduler, lambda: 4 - sum(p.outstanding for p in pullers.values()), wait_pull_s=240.0)
    await loop.pull(2, 100.0, [("min", 3)])
    assert deep.requested == [2] and deep.asked_timeouts == []
    assert shallow.requested == [] and shallow.queued == 0  # fetched: min(2, 1) came
