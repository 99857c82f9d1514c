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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.pull_consumer import PullConsumer, delivery_info
from rollfleet.broker.topology import bind_job_consumer, bind_replica_consumer, queue_depths
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.runtime.logs import debug_enabled
from rollfleet.schemas import Names
from rollfleet.schemas.errors import BrokerError, Fenced
from rollfleet.schemas.names import listened_subjects
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion, Subject


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
        self._debug = debug_enabled(log)  # per-pass debug lines' fields are worked out only then
        self._in_flight = in_flight  # jobs running now (each holds a slot)
        self._run_job = run_job
        self._stopping = stopping
        self._pullers: dict[Subject, PullConsumer] = {}
        self._no_consumer: dict[Subject, float] = {}  # subject -> when to look for its consumer again
        self._own: PullConsumer | None = None  # this replica's own subject (sessions' sticky turns)
        self._own_pending = False  # a bell said a job waits there
        self._hot: dict[Subject, float] = {}  # subject -> when work last came from it
        self._expired_seen: dict[Subject, int] = {}  # each puller's expiry count at the last look
        self._expired_total = 0
        self._standby: dict[Subject, float] = {}  # subject -> until when it is left to other replicas
        self._rebalance_at: float | None = None  # when parked slots may move (see _fill)
        self._refusals_seen: dict[Subject, float] = {}
        self._listen: list[Subject] = []  # _listen_subjects' last answer, and what it depended on
        self._listen_key: tuple[int, int | None, int] | None = None
        self._listen_at = 0.0
        self.loop_failures = 0  # passes of the pull loop that a defect ended (logged as errors)
        self._tidied: list[Subject] | None = None
        self._wake = asyncio.Event()
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
        self._standby.pop(subject, None)  # called in: wait there again
        self._no_consumer.pop(subject, None)  # a job was stored there: its consumer exists now
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
        self._own_pending = True
        self._wake.set()

    def declared(self) -> None:
        """The trainer declared job consumers: those found missing are looked up again."""
        if self._no_consumer:
            self._no_consumer.clear()
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
        self._no_consumer.clear()
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
        for puller in self._pullers.values():
            with suppress(Exception):
                await puller.cancel()

    async def close(self) -> None:
        for puller in [*self._pullers.values(), *([self._own] if self._own is not None else [])]:
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
    async def _puller(self, subject: Subject) -> PullConsumer | None:
        """The pull consumer of a subject; None while its shared consumer does not exist: the
        trainer creates it (with a commit, or with the first job there), workers only bind (see
        broker_config/auth). A missing one is looked up again after a bell for the subject, an
        activation, a reconnect or ``standby_s``: an idle replica asks the broker nothing."""
        puller = self._pullers.get(subject)
        if puller is not None and not puller.missing:
            return puller
        if time.monotonic() < self._no_consumer.get(subject, 0.0):
            return None
        consumer = await bind_job_consumer(self._js, self._names, *subject)
        if consumer is None:
            self._no_consumer[subject] = time.monotonic() + self.standby_s
            return None
        self._no_consumer.pop(subject, None)
        if puller is None:
            puller = await PullConsumer(self._nc, self._names.jobs_stream, consumer, self._dispatch).start()
            puller.on_end = self._wake.set
            self._pullers[subject] = puller
        puller.missing = False  # (set again when a request finds no consumer, 503)
        return puller

    def _free(self) -> int:
        """Slots neither running a job nor promised to an open pull request."""
        return self.capacity - self._in_flight() - sum(p.outstanding for p in self._pullers.values())

    def _listen_subjects(self, now: float) -> list[Subject]:
        """Where work is likely to arrive, best first: this version's window (``exact-w`` and
        the newest ``min`` subjects, see ``listened_subjects``), then subjects that delivered
        within ``hot_s``, most recent first. Recomputed only when the version, the set of hot
        subjects or a second has passed (it runs after every finished job)."""
        key = (self.served.version, self.served.activating, len(self._hot))
        if self._listen_key == key and now - self._listen_at < 1.0:
            return self._listen
        for subject in [s for s, t in self._hot.items() if now - t > self.hot_s or not self.served.accepts(s)]:
            del self._hot[subject]
        own = [s for s in listened_subjects(self.served.version) if self.served.accepts(s)]
        recent = sorted(self._hot, key=self._hot.__getitem__, reverse=True)
        self._listen = list(dict.fromkeys([*own, *recent]))[: max(self.max_waiting_pulls, len(own))]
        self._listen_key, self._listen_at = key, now
        return self._listen

    def served_changed(self) -> None:
        """Call after ``served`` changed what it accepts (a version moved, or ``exact-<old>``
        closed during an activation): the pull loop's next pass, at once, cancels the open
        requests of every subject it no longer accepts (``release_unaccepted``) and pulls the
        newly accepted ones (whose consumers the commit declared: looked up again)."""
        self._no_consumer.clear()
        self._wake.set()

    async def release_unaccepted(self) -> None:
        """End, now, the open requests of every subject ``served.accepts`` no longer allows (a
        job the broker sent before that is still handled: run if allowed, else handed back)."""
        for subject in [s for s in self._pullers if not self.served.accepts(s)]:
            puller = self._pullers.pop(subject)
            await puller.cancel()
            await puller.close()
            self._expired_seen.pop(subject, None)

    async def run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                with typed_errors():
                    await self._fill(time.monotonic())
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
            # Event-driven; the timer only lets hot subjects cool down and overdue requests be
            # noticed, with no broker traffic. (A timer, not wait_for: this runs after every
            # finished job.)
            timeout = self.hot_s
            if self._rebalance_at is not None:
                timeout = max(0.0, min(timeout, self._rebalance_at - time.monotonic()))
            timer = asyncio.get_running_loop().call_later(timeout, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    def _standing_by(self, subject: Subject, puller: PullConsumer, now: float) -> bool:
        """A subject whose last waiting request the broker refused (``max_waiting`` requests of
        other replicas wait there already) is left to them until a bell for it, an activation,
        a reconnect or ``standby_s``: the broker's work per job stays bounded by ``max_waiting``,
        whatever the size of the fleet."""
        if puller.refused_at > self._refusals_seen.get(subject, -1.0):
            self._refusals_seen[subject] = puller.refused_at
            self._standby[subject] = now + self.standby_s
        until = self._standby.get(subject)
        if until is None:
            return False
        if now < until:
            return True
        del self._standby[subject]
        return False

    async def _fill(self, now: float) -> None:
        """Put every free slot to use: known backlog first (``no_wait`` pulls by priority and
        age), then requests that wait on the subjects work comes from."""
        await self.release_unaccepted()
        listen = self._listen_subjects(now)
        expired = sum(p.expired for p in self._pullers.values())
        if expired != self._expired_total or listen is not self._tidied:
            self._expired_total, self._tidied = expired, listen
            await self._tidy(listen)
        self._rebalance_at = None
        # Sessions' turns for this replica come first, except before work that has waited
        # aging_s or longer elsewhere: a steady stream of turns must not starve it (the turns
        # then wait, and move to the shared subjects after their affinity wait).
        starving = self._own_pending and self.scheduler.starving(now)
        if self._own_pending and not starving:
            await self._pull_own(now)
        free = self._free()
        if self.scheduler.has_candidates():
            self._forget_drained_backlog(now)
        if self.scheduler.has_candidates():
            if free <= 0:
                free += await self._reclaim(now)
            free = await self._pull_backlog(free, now, listen)
        if starving and self._own_pending:
            await self._pull_own(now)
        if self.scheduler.has_candidates():
            return  # backlog left and no slot free: the next finished job pulls it
        if free <= 0 and not any(p.waiting for p in self._pullers.values()):
            return
        # (A subject whose last request was refused, other replicas waiting there, is left to them.)
        pullers = []
        for subject in listen:
            puller = self._pullers.get(subject)
            if puller is None or puller.missing:
                puller = await self._puller(subject)
            if puller is not None and not self._standing_by(subject, puller, now):
                pullers.append(puller)
        if not pullers:
            return
        share = self._placement(pullers, self.capacity, now)
        # Slots parked on a subject beyond its share come back once it has been quiet for
        # rebalance_s (a cancel: protocol only), so they wait where work is expected. (Shares
        # are of the whole capacity: a running job never moves another subject's slot.)
        for puller in list(self._pullers.values()):
            if puller.waiting and puller.outstanding > share.get(puller, 0):
                if self._quiet(puller, now):
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
        if self._own is None or self._own.missing:  # (gone after consumer_inactive_s idle: look again)
            consumer = await bind_replica_consumer(self._js, self._names, self.worker_id)
            if consumer is None:
                self._own_pending = False  # (the trainer creates it with the first turn)
                return
            if self._own is None:
                self._own = await PullConsumer(self._nc, self._names.jobs_stream, consumer, self._dispatch).start()
                self._own.on_end = self._wake.set
            self._own.missing = False
        if self._own.busy:
            return
        got = await self._own.fetch_now(free)
        if got < free:
            self._own_pending = False  # drained (more turns ring again)
        else:
            self._wake.set()

    def _quiet(self, puller: PullConsumer, now: float) -> bool:
        """Nothing delivered for ``rebalance_s`` (nor asked for: a new request gets its chance);
        if not yet, the pull loop wakes when it will be."""
        quiet_at = max(puller.last_delivery, puller.requested_at) + self.rebalance_s
        if now >= quiet_at:
            return True
        if self._rebalance_at is None or quiet_at < self._rebalance_at:
            self._rebalance_at = quiet_at
        return False

    def _forget_drained_backlog(self, now: float) -> None:
        """A subject known to have backlog whose waiting request got nothing for rebalance_s has
        none left (others took it): stop treating it as backlog."""
        for subject in self.scheduler.order(now):
            puller = self._pullers.get(subject)
            if puller is not None and puller.waiting and self._quiet(puller, now):
                self.scheduler.note_empty(subject)

    def _placement(self, pullers: list[PullConsumer], slots: int, now: float) -> dict[PullConsumer, int]:
        """Where this worker's slots should wait: one on each subject in order (the version's
        window first), the rest on the subject that delivered within ``rebalance_s``, else on
        the newest ``min`` subject (where most work comes)."""
        share = dict.fromkeys(pullers, 0)
        for puller in pullers[: max(slots, 0)]:
            share[puller] = 1
        rest = slots - min(max(slots, 0), len(pullers))
        if rest > 0:
            recent = max(pullers, key=lambda p: p.last_delivery)
            if now - recent.last_delivery > self.rebalance_s:
                recent = next((p for p in pullers if p.consumer.startswith("min-")), pullers[0])
            share[recent] += rest
        return share

    async def _pull_backlog(self, free: int, now: float, listen: list[Subject]) -> int:
        """Pull known backlog, best subject first; returns the slots still free."""
        for subject in self.scheduler.order(now):
            if free <= 0 or self._stopping.is_set():
                break
            if not self.served.accepts(subject):
                continue
            puller = await self._puller(subject)
            if puller is None:  # no job was ever submitted there
                self.scheduler.note_empty(subject)
                continue
            if puller.waiting or (subject in listen and not puller.busy):
                # A waiting request takes what is queued at once, and what comes next; deliveries
                # say when the queue is empty again (num_pending 0).
                await puller.request(free, wait_s=self.wait_pull_s)
                self.scheduler.note_served(subject, now)
            elif not puller.busy:
                asked = time.monotonic()
                fetched = await puller.fetch_now(free)
                if self._debug:
                    self._log.debug("backlog fetched", subject=str(subject), fetched=fetched, missing=puller.missing)
                if fetched:
                    self.scheduler.note_served(subject, asked)
                elif not puller.missing:  # (a missing consumer is looked up on the next pass)
                    self.scheduler.note_empty(subject)
            else:
                if self._debug:
                    self._log.debug("backlog left to a busy request", subject=str(subject))
            free = self._free()
        return free

    async def _reclaim(self, now: float) -> int:
        """No slot free while backlog is known: take back slots promised to waiting requests on
        subjects that delivered nothing for ``rebalance_s``. Returns how many came back."""
        candidates = set(self.scheduler.order(now))
        freed = 0
        for subject, puller in list(self._pullers.items()):
            held = puller.outstanding
            if held and subject not in candidates and now - puller.last_delivery > self.rebalance_s:
                await puller.cancel()
                freed += held
        return freed

    async def _tidy(self, listen: list[Subject]) -> None:
        """Cancel what should not wait on: requests of subjects that cooled down (their slots
        go back to the hot ones), and overlapping requests of a subject whose older request
        just expired (renewed as one)."""
        keep = set(listen) | set(self.scheduler.order(time.monotonic()))
        for subject, puller in list(self._pullers.items()):
            expired, seen = puller.expired, self._expired_seen.get(subject, 0)
            self._expired_seen[subject] = expired
            if not puller.waiting:
                continue
            if subject not in keep or (expired != seen and puller.outstanding):
                await puller.cancel()

    def _dispatch(self, msg: Msg) -> None:
        """A job delivered: its subject is hot, and more queued behind it is backlog to pull now;
        then the worker runs it."""
        subject = self._names.parse_job_subject(msg.subject)
        info = delivery_info(msg.reply)
        if subject is not None:
            now = time.monotonic()
            self._hot[subject] = now
            if info is not None:
                # More queued behind it is backlog to pull now, as old as this job at most. (Its
                # stored time is by the broker's clock: a skewed host shifts every subject alike.)
                _, stored_at, pending = info
                self.scheduler.note_delivered(subject, now, time.time() - stored_at, pending)
                if pending > 0:
                    self._wake.set()
        self._run_job(msg, info)
