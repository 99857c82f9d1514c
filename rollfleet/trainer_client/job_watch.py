"""The client's watch over its jobs in flight: deadlines, exact jobs nobody can serve any more,
subjects whose jobs wait unpulled, and resumable jobs the broker gave up on. Two loops
(``deadlines``, ``stalls``) that carry out the decisions of ``watch_rules`` against the broker;
one sweep over what is in flight per tick instead of a timer per job, and nothing asked of the
broker while nothing is pending.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from rollfleet.broker.stream_reads import consumer_state, delivered_through
from rollfleet.broker.topology import given_up_seq
from rollfleet.broker.types import JetStreamContext, Msg
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, VersionConstraint
from rollfleet.schemas.errors import BrokerError, Expired, NoCompatibleReplica, NotFound
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.job_watch_rules import (
    STALL_AFTER_S,
    OrphanWatch,
    expired,
    queued_since,
    stall_bells,
    stalled_since,
)
from rollfleet.trainer_client.placement import JobPlacement
from rollfleet.trainer_client.sessions import Session, expire_idle

log = get_logger("rollfleet.client")

_DEADLINE_TICK_S = 0.25


def _sweep(sweeps: dict[str, asyncio.Task[None]], name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Start ``run`` unless the last one of that name is still running."""
    task = sweeps.get(name)
    if task is not None and not task.done():
        return
    task = sweeps[name] = asyncio.create_task(run(), name=f"sweep-{name}")
    task.add_done_callback(_said_if_failed)


def _said_if_failed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("a sweep of the jobs in flight failed", sweep=task.get_name(), error=repr(task.exception()))


class JobWatch:
    def __init__(
        self,
        handles: dict[str, RolloutHandle],
        fleet: FleetView,
        placement: JobPlacement,
        js: JetStreamContext,
        names: Names,
        *,
        deadline_grace_s: float,
        fail_fast: bool,
        sessions: Callable[[], Mapping[str, Any]],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        withdraw: Callable[[RolloutHandle], Awaitable[bool]],
        settle_stored: Callable[[RolloutHandle], Awaitable[bool]],
        no_replica_message: Callable[[VersionConstraint], str],
        redeclare: Callable[[VersionConstraint], Awaitable[None]],
        ring: Callable[..., None],
        note_demand: Callable[[VersionConstraint], Awaitable[None]] | None = None,
    ) -> None:
        self._handles = handles  # the client's own map of pending keys (shared, not copied)
        self.fleet, self.placement, self._js, self._names = fleet, placement, js, names
        self.deadline_grace_s = deadline_grace_s
        self.fail_fast = fail_fast
        self._sessions = sessions
        self._spawn = spawn
        self._withdraw = withdraw
        self._settle_stored = settle_stored
        self._no_replica_message = no_replica_message
        self._redeclare = redeclare
        self._ring = ring
        self._note_demand = note_demand  # (the fleet's control loop hears a job that waits for a replica)
        self.orphans = OrphanWatch()

    # -- deadlines and orphans -----------------------------------------------------------------
    async def deadlines(self) -> None:
        """Fail pending handles whose deadline (plus grace) passed without a result, and (with
        fail_fast) exact jobs that no replica can serve any more; end idle sessions."""
        # The sweeps that ask the broker run beside the deadlines, one of each at a time: a broker
        # that does not answer (frozen, a cluster's node cut off) held up every Expired answer for
        # as long as its requests took to time out (7 s late in campaign seed 313, --cluster).
        sweeps: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(_DEADLINE_TICK_S)
                now = time.time()
                due = expired(((k, h.job.deadline) for k, h in self._handles.items()), now, self.deadline_grace_s)
                for key in due:
                    handle = self._handles.get(key)
                    if handle is not None and handle.set_error(Expired(f"no result for {key!r} by its deadline")):
                        self._spawn(self._withdraw(handle))
                if self.fail_fast:
                    _sweep(sweeps, "orphans", self.fail_orphaned)
                sessions = self._sessions()
                if sessions:
                    idle = [s for s in sessions.values() if isinstance(s, Session)]
                    _sweep(sweeps, "sessions", lambda idle=idle: expire_idle(idle))
        finally:
            for task in sweeps.values():
                task.cancel()

    async def fail_orphaned(self) -> None:
        """One look at every exact job still queued (not sticky): ``OrphanWatch`` decides; a job
        withdrawn that was answered just before keeps its answer (a worker stores before it acks)."""
        now = time.monotonic()
        pending = {
            key: h
            for key, h in self._handles.items()
            if h.job.constraint.kind == "exact" and h.replica is None and h.stream_seq is not None
        }
        self.orphans.keep_only(pending)
        for key, handle in pending.items():
            constraint = handle.job.constraint
            servable = self.fleet.compatible(constraint)
            holders: list[str] = []
            if not servable:
                # (One that holds no job at all, e.g. activating away after it handed this one
                # back, holds nothing of it: it takes no more jobs of the version it is leaving.)
                holders = [
                    r.worker_id for r in self.fleet.replicas() if r.active_version == constraint.version and r.in_flight
                ]
                if holders and self.orphans.hold_check_due(key, now):
                    self.orphans.checked(key, now, await self.may_hold(handle, holders))
                if not self.orphans.may_be_held(key):
                    holders = []
                for worker_id in self.orphans.probes_due(holders, now):  # (no responders: marked gone)
                    self.placement.probe(worker_id)
            verdict = self.orphans.verdict(
                key, servable=servable, holders=holders, now=now, waits_for_replica=handle.waits_for_replica
            )
            if verdict == "wants_replica" and self._note_demand is not None:
                await self._note_demand(constraint)  # (at most once a second per version: RefusalNotes)
            if verdict != "withdraw":
                continue
            await self.placement.delete(handle)
            if handle.done() or await self._settle_stored(handle):
                continue
            self._handles.pop(key, None)
            handle.set_error(NoCompatibleReplica(self._no_replica_message(constraint)))

    async def may_hold(self, handle: RolloutHandle, holders: list[str]) -> bool:
        """Whether one of these replicas, at the job's version but no longer taking its jobs
        (draining, activating away), may be running it: only if it was ever delivered, and for a
        claimed job only if its claim names one of them. A draining replica finishing its own
        long jobs must not keep a job it never took (or one a dead replica took) waiting."""
        delivered = await self.placement.delivered(handle)
        if delivered is False:
            return False
        if delivered is None or not handle.job.claimed:
            return True  # delivered, or unknown (broker away, its consumer deleted): leave it be
        try:
            holder = await self.placement.holder(handle, strict=True)
        except BrokerError:
            return True
        return holder is not None and holder.worker_id in holders

    # -- jobs the broker gave up on -------------------------------------------------------------
    async def given_up(self, msg: Msg) -> None:
        """The broker gave up on a job: delivered ``max_deliver`` times (its holders died, or handed
        it back), it is never delivered again. A resumable job is stored again, the same job, so
        the next replica resumes it from its checkpoints: outliving its holders is what it is for.
        (Other jobs keep the broker's bound on a job that kills its workers: their deadline.)"""
        seq = given_up_seq(msg.data or b"")
        for handle in list(self._handles.values()):
            if seq is None or handle.stream_seq != seq or handle.done() or not handle.job.behaviour.checkpoints:
                continue
            place = self.placement
            stored = await (place.requeue(handle) if handle.replica is None else place.move_to_shared(handle))
            log.info("resumable job given up on by the broker; stored again", key=handle.idempotency_key, stored=stored)

    # -- stalls --------------------------------------------------------------------------------
    async def stalls(self) -> None:
        """Once a second, while some job has waited over a second for its answer: for each of
        their subjects, ask the broker (one consumer look-up) whether jobs wait there with no
        pull request waiting for them, and if so ring replicas (``stall_bells``). This covers
        lost bells, replicas that keep a subject's jobs queued behind full slots, replicas
        standing by (the subject's ``max_waiting`` was reached when they asked), and jobs whose
        holder died on a subject outside every live replica's window (they are redelivered only
        to a replica that pulls there). A consumer found missing is declared again (it was
        deleted, or cleaned up while cached as existing)."""
        while True:
            await asyncio.sleep(STALL_AFTER_S)
            now = time.time()
            unanswered = [(h.job.constraint, h.job.submitted_at, h.replica, h.stream_seq)
                          for h in self._handles.values() if not h.done()]  # fmt: skip
            waiting = stalled_since([(c, t, r) for c, t, r, _ in unanswered], now, STALL_AFTER_S)
            on_shared: dict[VersionConstraint, list[tuple[float, int | None]]] = defaultdict(list)
            for c, t, r, seq in unanswered:  # (grouped once, not scanned again per subject)
                if r is None:
                    on_shared[c].append((t, seq))
            for constraint, since in waiting.items():
                consumer = self._names.job_consumer(constraint.kind, constraint.version)
                try:
                    info = await consumer_state(self._js, self._names.jobs_stream, consumer)
                except NotFound:
                    await self._redeclare(constraint)
                    continue
                except BrokerError as exc:
                    log.debug("stall check failed", subject=consumer, error=str(exc))
                    continue
                bells = stall_bells(info.num_waiting or 0, info.num_pending or 0, info.num_ack_pending or 0)
                # The wait a bell says is that of the oldest job still queued, where one is.
                floor = delivered_through(info)
                queued = queued_since(on_shared[constraint], floor)
                since = since if queued is None else queued
                log.debug(
                    "stall check",
                    subject=consumer,
                    num_waiting=info.num_waiting,
                    num_pending=info.num_pending,
                    num_ack_pending=info.num_ack_pending,
                    bells=bells,
                )
                for _ in range(bells):
                    self._ring(constraint, stalled=True, waited_s=now - since)
