"""Deciding which jobs to pull, and pulling them: the worker's pull requests, one per subject.

Pulling costs the broker nothing while nothing happens. The worker keeps pull requests
waiting at the broker on the subjects work comes from: its version's window
(``names.listened_subjects``: ``exact-w`` and the newest ``min`` subjects up to ``w``; one slot
on each of the first ``capacity`` of them, which clients compute too, the other slots where
work came from last, moving back after ``rebalance_s`` of quiet) and subjects it served in the
last ``hot_s``, with long expiries (``wait_pull_s``) and no server heartbeats, so a job stored
there is delivered to it at once, with no wake-up at all. Every delivery says how many jobs its
consumer still holds (``num_pending``): more behind it makes that subject known backlog, pulled
at once (``no_wait``), by priority and age (``scheduler``). Work on a subject outside every
replica's window arrives as a bell: a core message to this replica alone
(``rf.<ns>.bell.<worker_id>``), rung by a client that chose this replica because its version can
serve the subject. There is no periodic scan: queue depths are read once at start and after a
reconnect.

A subject this worker may no longer take (``served.accepts`` says no: its version moved on)
stops being pulled at once: ``release_unaccepted`` cancels its open requests (the inbox is
drained, so a job the broker sent before the cancel is still handled, and handed back if it
is not allowed). The same cancel ends requests the broker may have dropped: after a
reconnect, after a consumer leader change (a cluster fail-over), or when a client's bell says
the broker has no request of ours waiting where we think one is.

The pull consumers themselves are ``subject_pullers``'s, this replica's own subject
``own_subject_pull``'s, known backlog ``backlog_pull``'s, and where slots wait a set of pure
decisions in ``pull_placement``; this module is the pull loop that carries them out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.pull_consumer import PullConsumer, delivery_info
from rollfleet.broker.topology import queue_depths
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.schemas import Names
from rollfleet.schemas.errors import BrokerError, Fenced
from rollfleet.workers.backlog_pull import BacklogPull
from rollfleet.workers.own_subject_pull import OwnSubjectPull
from rollfleet.workers.pull_placement import ListenedSubjects, QuietClock, StandbySubjects, placement
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion, Subject
from rollfleet.workers.subject_pullers import SubjectPullers


class JobPuller:
    """One worker's pull requests: where its free slots wait, what it fetches at once, and what
    it stops pulling when its version moves. ``run`` is the pull loop; each delivered job goes to
    ``run_job`` (the worker's, which runs it and calls ``wake`` when it ends)."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        names: Names,
        served: ServedVersion,
        scheduler: SubjectScheduler,
        *,
        worker_id: str,
        capacity: int,
        wait_pull_s: float,
        hot_s: float,
        max_waiting_pulls: int,
        rebalance_s: float,
        standby_s: float,
        log: Any,
        in_flight: Callable[[], int],
        run_job: Callable[[Msg, tuple[int, float, int] | None], None],
        stopping: asyncio.Event,
    ) -> None:
        self._nc, self._js, self._names = nc, js, names
        self.served = served
        self.scheduler = scheduler
        self.worker_id = worker_id
        self.capacity = capacity
        self.wait_pull_s = wait_pull_s
        self.hot_s = hot_s
        self.max_waiting_pulls = max_waiting_pulls
        self.rebalance_s = rebalance_s
        self.standby_s = standby_s
        self._log = log
        self._in_flight = in_flight  # jobs running now (each holds a slot)
        self._run_job = run_job
        self._stopping = stopping
        self._wake = asyncio.Event()
        self._subjects = SubjectPullers(
            nc, js, names, standby_s=standby_s, dispatch=self._dispatch, on_end=self._wake.set
        )
        self._pullers = self._subjects.by_subject  # each subject's pull consumer
        # This replica's own subject (sessions' sticky turns).
        self._own = OwnSubjectPull(nc, js, names, worker_id, dispatch=self._dispatch, on_end=self._wake.set)
        self._listened = ListenedSubjects(hot_s, max_waiting_pulls)  # where work is likely to arrive
        self._expired_total = 0
        self._standby = StandbySubjects(standby_s)  # subjects left to other replicas
        self._quiet = QuietClock(rebalance_s)  # when parked slots may move (see _fill)
        self._backlog = BacklogPull(
            self._subjects,
            scheduler,
            served,
            self._quiet,
            wait_pull_s=wait_pull_s,
            free=self._free,
            stopping=stopping,
            log=log,
        )
        self.loop_failures = 0  # passes of the pull loop that a defect ended (logged as errors)
        self._tidied: list[Subject] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop_background(self) -> None:
        for task in list(self._background):
            task.cancel()

    # -- hearing about work -----------------------------------------------------------------
    def bell(self, subject: Subject, stalled: bool, waited_s: float = 0.0) -> None:
        """A client rang for work on ``subject`` (``stalled``: it saw jobs there and no request of
        ours waiting at the broker; ``waited_s``: how long the oldest of them has waited, by the
        client's clock: the subject's age counts from then, not from this bell)."""
        accepted = self.served.accepts(subject)
        puller = self._pullers.get(subject)
        self._log.debug(
            "bell",
            subject=str(subject),
            stalled=stalled,
            accepted=accepted,
            busy=puller is not None and puller.busy,
            waiting=puller is not None and puller.waiting,
            waited_s=waited_s,
        )
        if not accepted:
            return
        self._standby.called_in(subject)  # called in: wait there again
        self._subjects.look_again(subject)  # a job was stored there: its consumer exists now
        if puller is not None and puller.busy:
            if not (stalled and puller.waiting):
                return  # a request is waiting there: the job is (being) delivered to it already
            # The client saw jobs there and no request waiting at the broker: ours was lost.
            # Renewed, and the subject is known backlog from now on (not left to the next bell).
            self._spawn(self._renew(puller))
        if self.scheduler.note_pending(subject, time.monotonic(), waited_s=waited_s):
            self._wake.set()

    def own_pending(self) -> None:
        """A session's turn waits on this replica's own subject."""
        self._own.pending = True
        self._wake.set()

    def declared(self) -> None:
        """The trainer declared job consumers: those found missing are looked up again."""
        if self._subjects.look_again():
            self._wake.set()

    def leader_changed(self, consumer: str) -> None:
        """A jobs consumer has a new leader: requests held by the old one are gone."""
        for puller in list(self._pullers.values()):
            if puller.consumer == consumer and puller.busy:
                self._spawn(self._renew(puller))

    def reconnected(self) -> None:
        """The broker may have dropped our pull requests: every one counts as ended, subjects
        left to others and consumers found missing are looked at again, depths read once."""
        for puller in self._pullers.values():
            puller.reset()
        self._standby.clear()
        self._subjects.look_again()
        self._spawn(self.scan_once())
        self._wake.set()

    def activated(self) -> None:
        """A version was activated: subjects left to other replicas are ours to wait on again."""
        self._standby.clear()
        self.served_changed()

    def wake(self) -> None:
        self._wake.set()

    async def cancel_all(self) -> None:
        """End every open request (a stop): a job the broker sent before that still runs."""
        await self._subjects.cancel_all()

    async def close(self) -> None:
        own = self._own.consumer
        for puller in [*self._pullers.values(), *([own] if own is not None else [])]:
            await puller.close()

    async def _renew(self, puller: PullConsumer) -> None:
        await puller.cancel()
        self._wake.set()

    async def scan_once(self) -> None:
        """One look at the queue depths (a JetStream API request): at start and after a
        reconnect only, never periodically."""
        try:
            depths = await queue_depths(self._js, self._names)
        except Exception as exc:  # broker away; bells and deliveries will tell
            self._log.debug("queue scan failed", error=str(exc))
            return
        now = time.monotonic()
        if any([self.scheduler.note_pending(subject, now) for subject in depths]):
            self._wake.set()

    # -- deciding what to pull --------------------------------------------------------------
    def _free(self) -> int:
        """Slots neither running a job nor promised to an open pull request."""
        return self.capacity - self._in_flight() - self._subjects.outstanding()

    def served_changed(self) -> None:
        """Call after ``served`` changed what it accepts (a version moved, or ``exact-<old>``
        closed during an activation): the pull loop's next pass, at once, cancels the open
        requests of every subject it no longer accepts (``release_unaccepted``) and pulls the
        newly accepted ones (whose consumers the commit declared: looked up again)."""
        self._subjects.look_again()
        self._wake.set()

    async def release_unaccepted(self) -> None:
        """End, now, the open requests of every subject ``served.accepts`` no longer allows (a
        job the broker sent before that is still handled: run if allowed, else handed back)."""
        await self._subjects.release(self.served.accepts)

    async def run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            began = time.monotonic()
            try:
                with typed_errors():
                    await self._fill(began)
            except (BrokerError, Fenced, OSError) as exc:  # (any error of the broker's, typed)
                self._log.warning("pull failed", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            except Exception as exc:  # a defect: said loudly, and the replica goes on pulling
                # (A pull loop that ended would leave a replica registered ready that takes no
                # job, with nothing said until it stopped.)
                self._log.exception("pull loop failed; pulling again", error=repr(exc))
                self.loop_failures += 1
                await asyncio.sleep(0.2)
                continue
            self._backlog.say_slow_pass(began)
            # Event-driven; the timer only lets hot subjects cool down and overdue requests be
            # noticed, with no broker traffic. (A timer, not wait_for: this runs after every
            # finished job.)
            timeout = self.hot_s
            if self._quiet.next_at is not None:
                timeout = max(0.0, min(timeout, self._quiet.next_at - time.monotonic()))
            timer = asyncio.get_running_loop().call_later(timeout, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    async def _fill(self, now: float) -> None:
        """Put every free slot to use: known backlog first (``no_wait`` pulls by priority and
        age), then requests that wait on the subjects work comes from."""
        await self.release_unaccepted()
        listen = self._listened.now(self.served, now)
        expired = sum(p.expired for p in self._pullers.values())
        if expired != self._expired_total or listen is not self._tidied:
            self._expired_total, self._tidied = expired, listen
            await self._subjects.tidy(set(listen) | set(self.scheduler.order(time.monotonic())))
        self._quiet.restart()
        # Sessions' turns for this replica come first, except before work that has waited
        # aging_s or longer elsewhere: a steady stream of turns must not starve it (the turns
        # then wait, and move to the shared subjects after their affinity wait).
        starving = self._own.pending and self.scheduler.starving(now)
        if self._own.pending and not starving:
            await self._pull_own(now)
        free = self._free()
        if self.scheduler.has_candidates():
            self._backlog.forget_drained(now)
        if self.scheduler.has_candidates():
            if free <= 0:
                free += await self._reclaim(now)
            free = await self._backlog.pull(free, now, listen)
        if starving and self._own.pending:
            await self._pull_own(now)
        if self.scheduler.has_candidates():
            self._backlog.say_held(self._in_flight(), self.capacity)
            return  # backlog left and no slot free: the next finished job pulls it
        if free <= 0 and not any(p.waiting for p in self._pullers.values()):
            return
        # (A subject whose last request was refused, other replicas waiting there, is left to them.)
        pullers = []
        for subject in listen:
            puller = self._pullers.get(subject)
            if puller is None or puller.missing:
                puller = await self._subjects.bound(subject)
            if puller is not None and not self._standby.standing_by(subject, puller.refused_at, now):
                pullers.append(puller)
        if not pullers:
            return
        share = placement(pullers, self.capacity, now, self.rebalance_s)
        # Slots parked on a subject beyond its share come back once it has been quiet for
        # rebalance_s (a cancel: protocol only), so they wait where work is expected. (Shares
        # are of the whole capacity: a running job never moves another subject's slot.)
        for puller in list(self._pullers.values()):
            if puller.waiting and puller.outstanding > share.get(puller, 0):
                if self._quiet.quiet(puller, now):
                    await puller.cancel()
        free = self._free()
        for puller in pullers:
            want = min(share[puller] - puller.outstanding, free)
            if want > 0 and (puller.waiting or not puller.busy):
                await puller.request(want, wait_s=self.wait_pull_s)
                free -= want

    async def _pull_own(self, now: float) -> None:
        """Fetch what waits on this replica's own subject into free slots (taking back slots
        parked on quiet subjects if none is free). If no slot frees up, the turns wait there
        and their clients move them to the shared subjects after a bounded wait."""
        free = self._free()
        if free <= 0:
            free += await self._reclaim(now)
        if free <= 0 or self.served.down:
            return
        if await self._own.fetch(free):
            self._wake.set()  # every slot filled: more may wait

    async def _reclaim(self, now: float) -> int:
        """No slot free while backlog is known: take back slots promised to waiting requests on
        subjects that delivered nothing for ``rebalance_s``. Returns how many came back."""
        return await self._subjects.reclaim(set(self.scheduler.order(now)), now, self.rebalance_s)

    def _dispatch(self, msg: Msg) -> None:
        """A job delivered: its subject is hot, and more queued behind it is backlog to pull now;
        then the worker runs it."""
        subject = self._names.parse_job_subject(msg.subject)
        info = delivery_info(msg.reply)
        if subject is not None:
            now = time.monotonic()
            self._listened.delivered(subject, now)
            if info is not None:
                # More queued behind it is backlog to pull now, as old as this job at most. (Its
                # stored time is by the broker's clock: a skewed host shifts every subject alike.)
                _, stored_at, pending = info
                self.scheduler.note_delivered(subject, now, time.time() - stored_at, pending)
                if pending > 0:
                    self._wake.set()
        self._run_job(msg, info)
