"""RolloutClient: what a training loop imports to submit version-constrained rollouts.

``submit`` stores a job on ``jobs.min.<v>`` / ``jobs.exact.<v>`` (deduplicated by its
idempotency key) and returns a handle; results arrive on this client's durable results
consumer, so a restarted trainer with the same ``client_id`` still receives them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rollfleet.broker.connection import connect
from rollfleet.broker.publish import publish_retrying
from rollfleet.broker.pull import PullConsumer
from rollfleet.broker.topology import (
    DEFAULT_TOPOLOGY,
    TopologyConfig,
    ensure_job_consumer,
    ensure_results_consumer,
    ensure_topology,
)
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import (
    DEFAULT_LIMITS,
    Limits,
    Names,
    Outcome,
    ReplicaStatus,
    RetryPolicy,
    RolloutFailure,
    RolloutJob,
    RolloutPayload,
    RolloutResult,
    VersionConstraint,
    VersionRecord,
    check_job,
    check_token,
    decode_outcome,
    encode,
    error_from_code,
)
from rollfleet.schemas.errors import Expired, InvalidRequest, NoCompatibleReplica, RollfleetError, ServiceUnavailable
from rollfleet.schemas.names import HDR_CLIENT_ID, HDR_MSG_ID
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.versions import adopt_version, commit_version

log = get_logger("rollfleet.client")

_DELIVERED_MEMORY = 100_000  # keys whose result was already handed out (drop late duplicates)
_RESULTS_BATCH = 512
_RESULTS_WAIT_S = 30.0  # the results request's expiry; a lost one is replaced on reconnect or leader change
_BELL_INTERVAL_S = 0.05
_STALL_AFTER_S = 1.0  # a job unanswered this long makes its subject worth a look (see _watch_stalls)
_STALL_JOBS_PER_BELL = 4  # a woken replica pulls up to its free slots (4 by default)
_STALL_BELLS_MAX = 64
_PUBLISH_BUDGET_S = 30.0  # how long submit keeps trying to store a job while the broker recovers


class RolloutClient:
    def __init__(
        self,
        nc: NATS,
        names: Names,
        client_id: str,
        *,
        topology: TopologyConfig = DEFAULT_TOPOLOGY,
        limits: Limits = DEFAULT_LIMITS,
        default_timeout_s: float = 600.0,
        deadline_grace_s: float = 2.0,
        fail_fast: bool = True,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.names = names
        self.client_id = check_token(client_id, "client_id")
        self.topology = topology
        self.limits = limits
        self.default_timeout_s = default_timeout_s
        self.deadline_grace_s = deadline_grace_s
        self.fail_fast = fail_fast
        self.fleet = FleetView(self.js, names)
        self._handles: dict[str, RolloutHandle] = {}
        self._unclaimed: dict[str, Outcome] = {}  # results with no handle (e.g. from before a restart)
        self._unclaimed_event = asyncio.Event()
        self._delivered: OrderedDict[str, None] = OrderedDict()
        self._results_task: asyncio.Task[None] | None = None
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()
        self._bells: dict[tuple[str, int], float] = {}
        self._bell_inbox = ""
        self._results_puller: PullConsumer | None = None
        self._results_low = asyncio.Event()  # the results requests need renewing

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        namespace: str,
        client_id: str,
        topology: TopologyConfig = DEFAULT_TOPOLOGY,
        limits: Limits = DEFAULT_LIMITS,
        default_timeout_s: float = 600.0,
        fail_fast: bool = True,
        **connect_options: Any,
    ) -> RolloutClient:
        """Connect, declare the namespace if needed, and start receiving results."""
        check_token(client_id, "client_id")
        hooks: list[Callable[[], None]] = []
        nc = await connect(url, name=f"rollfleet-client-{client_id}", reconnect_hooks=hooks, **connect_options)
        client = cls(
            nc,
            Names(namespace),
            client_id,
            topology=topology,
            limits=limits,
            default_timeout_s=default_timeout_s,
            fail_fast=fail_fast,
        )
        hooks.append(client._on_reconnect)
        try:
            await client._start()
        except BaseException:
            await nc.close()
            raise
        return client

    async def _start(self) -> None:
        await ensure_topology(self.js, self.names, self.topology)
        self._results_consumer = await ensure_results_consumer(self.js, self.names, self.client_id, self.topology)
        await self.fleet.start()
        # A bell rung at a replica that is gone comes back as "no responders" on this inbox.
        self._bell_inbox = self.nc.new_inbox()
        await self.nc.subscribe(self._bell_inbox + ".>", cb=self._on_bell_unanswered)
        advisory = self.names.consumer_leader_advisory(self.names.results_stream)
        await self.nc.subscribe(advisory, cb=self._on_results_leader)
        self._results_task = asyncio.create_task(self._receive_results(), name="results")
        self._expiry_task = asyncio.create_task(self._expire_handles(), name="deadlines")
        self._stall_task = asyncio.create_task(self._watch_stalls(), name="stalls")

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._results_task is not None:
            await stop_tasks([self._results_task, self._expiry_task, self._stall_task, *self._background])
        await self.fleet.close()
        for handle in self._handles.values():
            handle.set_error(ServiceUnavailable("client closed before the result arrived"))
        # flush + close rather than drain: drain waits on the watchers' push subscriptions.
        with suppress(Exception):
            await self.nc.flush(timeout=2)
        with suppress(Exception):
            await self.nc.close()

    # -- submitting -------------------------------------------------------------------------
    @property
    def latest_version(self) -> int | None:
        return self.fleet.latest_version

    async def submit(
        self,
        payload: RolloutPayload,
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        max_staleness: int | None = None,
        idempotency_key: str | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        retry_policy: RetryPolicy = "replayable",
        session_id: str | None = None,
    ) -> RolloutHandle:
        """Queue one rollout job and return its handle.

        Exactly one of ``min_version``, ``exact_version`` or ``max_staleness`` (meaning
        ``min_version = latest - max_staleness``) says which policy versions may serve it.
        Resubmitting an ``idempotency_key`` within the duplicate window makes no second job.
        """
        constraint = self._constraint(min_version, exact_version, max_staleness)
        if retry_policy not in ("replayable", "at_most_once"):
            raise InvalidRequest(f"retry_policy must be 'replayable' or 'at_most_once', got {retry_policy!r}")
        if deadline is not None and timeout is not None:
            raise InvalidRequest("give deadline or timeout, not both")
        now = time.time()
        job_id = uuid.uuid4().hex
        key = idempotency_key or job_id
        existing = self._handles.get(key)
        if existing is not None:
            return existing
        job = RolloutJob(
            job_id=job_id,
            idempotency_key=key,
            client_id=self.client_id,
            constraint=constraint,
            payload=payload,
            deadline=deadline if deadline is not None else now + (timeout or self.default_timeout_s),
            submitted_at=now,
            retry_policy=retry_policy,
            session_id=session_id,
            trainer_version=self.latest_version,
        )
        check_job(job, self.limits)
        data = encode(job)
        if len(data) > self.limits.max_job_bytes:
            raise InvalidRequest(f"job is {len(data)} bytes, over the limit of {self.limits.max_job_bytes}")

        if self.fail_fast and not self.fleet.compatible(constraint):
            try:
                await self.fleet.refresh()  # the view may lag a replica that just registered
            except Exception as exc:  # broker unreachable: a retryable error, never a raw one
                raise ServiceUnavailable(f"cannot read the fleet registry: {exc}") from exc
            if not self.fleet.compatible(constraint):
                handle = RolloutHandle(job, self._withdraw)
                handle.set_error(NoCompatibleReplica(self._no_replica_message(constraint)))
                return handle

        handle = RolloutHandle(job, self._withdraw)
        self._handles[key] = handle
        unclaimed = self._unclaimed.pop(key, None)
        if unclaimed is not None:  # the answer came before we asked again (trainer restart)
            self._settle(handle, unclaimed)
            return handle
        headers = {HDR_MSG_ID: key, HDR_CLIENT_ID: self.client_id}
        subject = self.names.job_subject(constraint.kind, constraint.version)
        try:
            until = min(job.deadline, time.time() + _PUBLISH_BUDGET_S)
            ack = await publish_retrying(self.js, subject, data, headers, until=until)
        except RollfleetError:
            self._handles.pop(key, None)
            raise
        handle.stream_seq = None if ack.duplicate else ack.seq
        self._ring(constraint)
        if ack.duplicate and (stored := await self._stored_outcome(key)) is not None:
            self._settle(handle, stored)  # a duplicate submit whose result was delivered earlier
        log.debug("submitted", idempotency_key=key, constraint=str(constraint), duplicate=bool(ack.duplicate))
        return handle

    def _constraint(
        self, min_version: int | None, exact_version: int | None, max_staleness: int | None
    ) -> VersionConstraint:
        given = [x is not None for x in (min_version, exact_version, max_staleness)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of min_version, exact_version or max_staleness")
        if exact_version is not None:
            return VersionConstraint("exact", int(exact_version))
        if min_version is not None:
            return VersionConstraint("min", int(min_version))
        assert max_staleness is not None
        if max_staleness < 0:
            raise InvalidRequest("max_staleness must be >= 0")
        latest = self.latest_version or 0
        return VersionConstraint("min", max(0, latest - int(max_staleness)))

    async def _expire_handles(self) -> None:
        """Fail pending handles whose deadline (plus grace) passed without a result: one sweep
        over what is in flight, four times a second, instead of a timer per job."""
        while True:
            await asyncio.sleep(0.25)
            cutoff = time.time() - self.deadline_grace_s
            for handle in [h for h in self._handles.values() if h.job.deadline <= cutoff]:
                if handle.set_error(Expired(f"no result for {handle.idempotency_key!r} by its deadline")):
                    self._spawn(self._withdraw(handle))

    def _ring(self, constraint: VersionConstraint, *, stalled: bool = False) -> None:
        """Wake one replica for a job just stored on a subject outside every live replica's
        window (``FleetView.covered``: no request is surely waiting there): a core message to that
        replica alone, chosen round robin among those whose version can take it, at most one per
        subject per interval. It may be lost; ``_watch_stalls`` rings again where jobs wait unpulled."""
        if not stalled and self.fleet.covered(constraint):
            return
        key = (constraint.kind, constraint.version)
        now = time.monotonic()
        if not stalled and now - self._bells.get(key, 0.0) < _BELL_INTERVAL_S:
            return
        target = self.fleet.bell_target(constraint)
        if target is None:
            return  # nobody serves it yet; a replica activating the version pulls it then
        self._bells[key] = now
        data = self.names.bell_payload(constraint.kind, constraint.version, stalled=stalled)
        reply = f"{self._bell_inbox}.{constraint.kind}.{constraint.version}{'.stalled' if stalled else ''}"
        self._spawn(self.nc.publish(self.names.bell_subject(target.worker_id), data, reply=reply))

    async def _on_bell_unanswered(self, msg: Msg) -> None:
        """No responders for a bell: that replica is gone. Drop it and ring the next one."""
        headers = msg.headers or {}
        if headers.get("Status") != "503":
            return
        self.fleet.mark_gone(headers.get("Nats-Subject", "").rpartition(".")[2])
        parsed = self.names.parse_bell_payload(msg.subject[len(self._bell_inbox) + 1 :].encode())
        if parsed is not None:
            (kind, version), _ = parsed
            self._ring(VersionConstraint(kind, version), stalled=True)

    async def _watch_stalls(self) -> None:
        """Once a second, while some job has waited over a second for its answer: for each of
        their subjects, ask the broker (one consumer look-up) whether jobs wait there with no
        pull request waiting for them, and if so ring one replica per few of them. This covers
        lost bells, replicas that keep a subject's jobs queued behind full slots, and replicas
        standing by (the subject's ``max_waiting`` was reached when they asked). Nothing pending,
        nothing asked: an idle client makes no request."""
        while True:
            await asyncio.sleep(_STALL_AFTER_S)
            cutoff = time.time() - _STALL_AFTER_S
            waiting = {
                (h.job.constraint.kind, h.job.constraint.version)
                for h in list(self._handles.values())
                if h.job.submitted_at < cutoff and not h.done()
            }
            for kind, version in waiting:
                consumer = self.names.job_consumer(kind, version)  # type: ignore[arg-type]
                try:
                    info = await self.js.consumer_info(self.names.jobs_stream, consumer)
                except nats.js.errors.NotFoundError:
                    stuck = 1  # no replica ever pulled this subject
                except (nats.errors.Error, nats.js.errors.Error) as exc:
                    log.debug("stall check failed", subject=consumer, error=str(exc))
                    continue
                else:
                    stuck = 0 if info.num_waiting else (info.num_pending or 0)
                # One replica per few queued jobs (each pulls up to its free slots), bounded.
                for _ in range(min(-(-stuck // _STALL_JOBS_PER_BELL), _STALL_BELLS_MAX)):
                    self._ring(VersionConstraint(kind, version), stalled=True)  # type: ignore[arg-type]

    def _no_replica_message(self, constraint: VersionConstraint) -> str:
        live = {r.worker_id: f"{r.state}@{r.active_version}" for r in self.fleet.replicas()}
        return f"no live replica is at, or preparing, a version allowed by {constraint}; fleet: {live or 'empty'}"

    def _settle(self, handle: RolloutHandle, outcome: Outcome) -> None:
        if isinstance(outcome, RolloutResult):
            self._attach_staleness(outcome)
            handle.set_result(outcome)
        else:
            handle.set_error(error_from_code(outcome.code, outcome.message, outcome.retryable))

    def _attach_staleness(self, result: RolloutResult) -> None:
        latest = self.latest_version
        if latest is not None:
            # Measured from the oldest policy that produced any of its tokens.
            result.staleness = max(0, latest - result.version_start)

    async def _stored_outcome(self, key: str) -> Outcome | None:
        """The outcome stored for ``key`` on the results stream, if any (e.g. one an earlier
        process received and acked). None too when the broker is away: then the result, if
        any, still arrives through the consumer."""
        subject = self.names.result_subject(self.client_id, key)
        try:
            raw = await self.js.get_last_msg(self.names.results_stream, subject)
            return decode_outcome(raw.data or b"")
        except (nats.errors.Error, nats.js.errors.Error, InvalidRequest):
            return None

    async def _withdraw(self, handle: RolloutHandle) -> bool:
        self._handles.pop(handle.idempotency_key, None)
        if handle.stream_seq is None:
            return False
        try:
            return bool(await self.js.delete_msg(self.names.jobs_stream, handle.stream_seq))
        except Exception:  # already taken (acked and removed) or broker away
            return False

    # -- policy versions --------------------------------------------------------------------
    async def publish_policy(self, publisher: Any, named_tensors: Any) -> VersionRecord:
        """Write the next version with a ``PolicyPublisher`` (in a thread) and commit it.

        The first call records the base checkpoint as version 0 and commits that.
        """
        record = await asyncio.to_thread(publisher.publish, named_tensors)
        await self.commit_version(record)
        return record

    async def commit_version(self, record: VersionRecord) -> None:
        """Make a written version visible to the fleet (create ``v.<N>``, CAS ``latest``, announce)."""
        await self._declare_version_consumers(record.version)  # before replicas hear of it
        await commit_version(self.js, self.names, record)
        self.fleet.note_committed(record.version)

    async def adopt_version(self, store_dir: str | Path, version_dir: str | Path) -> VersionRecord:
        """Verify and commit a version directory written by another publisher, without re-encoding."""
        record = await adopt_version(self.js, self.names, Path(store_dir), Path(version_dir))
        self.fleet.note_committed(record.version)
        await self._declare_version_consumers(record.version)  # (adopt verifies, then commits)
        return record

    async def _declare_version_consumers(self, version: int) -> None:
        """The new version's job consumers, declared once here rather than discovered missing
        by every replica that activates it."""
        for kind in ("min", "exact"):
            try:
                await ensure_job_consumer(self.js, self.names, kind, version, self.topology)  # type: ignore[arg-type]
            except Exception as exc:  # the replicas declare it themselves if needed
                log.debug("declaring job consumer failed", version=version, error=str(exc))

    async def wait_for_version(
        self, version: int, *, replicas: int | None = None, fraction: float | None = None, timeout: float = 120.0
    ) -> list[ReplicaStatus]:
        """Wait until ``replicas`` (or ``fraction``, default all live) replicas serve ``version``+."""
        return await self.fleet.wait_for_version(version, replicas=replicas, fraction=fraction, timeout=timeout)

    # -- results ----------------------------------------------------------------------------
    async def result(self, idempotency_key: str, timeout: float | None = None) -> RolloutResult:
        """The result for a key, whether submitted by this process or before a restart."""
        handle = self._handles.get(idempotency_key)
        if handle is not None:
            return await handle.result(timeout)
        if idempotency_key not in self._unclaimed:
            # Delivered to an earlier process that died before using it: read it back.
            stored = await self._stored_outcome(idempotency_key)
            if stored is not None:
                self._unclaimed.setdefault(idempotency_key, stored)
        deadline = None if timeout is None else time.monotonic() + timeout
        while idempotency_key not in self._unclaimed:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no result for {idempotency_key!r}")
            event = self._unclaimed_event
            with suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)
        outcome = self._unclaimed.pop(idempotency_key)
        if isinstance(outcome, RolloutFailure):
            raise error_from_code(outcome.code, outcome.message, outcome.retryable)
        self._attach_staleness(outcome)
        return outcome

    def unclaimed(self) -> dict[str, Outcome]:
        """Results that arrived for keys this process did not submit (e.g. before a restart)."""
        return dict(self._unclaimed)

    def _on_reconnect(self) -> None:
        if self._results_puller is not None:
            self._results_puller.reset()  # re-request at once instead of waiting out the old one
        self.fleet.note_reconnected()

    async def _on_results_leader(self, msg: Msg) -> None:
        """The results consumer has a new leader (a cluster fail-over): our request is gone."""
        if self._results_puller is not None and msg.subject.rpartition(".")[2] == self._results_consumer:
            self._results_puller.reset()

    async def _receive_results(self) -> None:
        """Keep pull requests open on this client's results consumer; each result is handled the
        moment it is stored (no batch to fill, no poll interval). A second request is added when
        the first is half used, so results never wait for a request to be renewed."""
        puller = await PullConsumer(self.nc, self.names.results_stream, self._results_consumer, self._on_result).start()
        self._results_puller = puller
        puller.on_end = self._results_low.set
        try:
            while True:
                self._results_low.clear()
                if puller.missing:  # no consumer leader answered (a fail-over): ask again shortly
                    puller.missing = False
                    await asyncio.sleep(0.25)
                try:
                    if puller.outstanding <= _RESULTS_BATCH // 2 and (puller.waiting or not puller.busy):
                        await puller.request(_RESULTS_BATCH, wait_s=_RESULTS_WAIT_S)
                except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:  # reconnecting
                    log.debug("results pull failed", error=str(exc))
                    await asyncio.sleep(0.5)
                    continue
                # Woken when half used or a request ended; the timer notices an overdue request.
                timer = asyncio.get_running_loop().call_later(1.0, self._results_low.set)
                try:
                    await self._results_low.wait()
                finally:
                    timer.cancel()
        finally:
            await puller.close()

    async def _on_result(self, msg: Msg) -> None:
        self._deliver(msg)
        puller = self._results_puller
        if puller is not None and puller.outstanding == _RESULTS_BATCH // 2:
            self._results_low.set()
        with suppress(Exception):
            await msg.ack()

    def _deliver(self, msg: Msg) -> None:
        try:
            outcome = decode_outcome(msg.data)
        except RollfleetError as exc:
            log.warning("undecodable result dropped", error=exc.message, subject=msg.subject)
            return
        key = outcome.idempotency_key
        if key in self._delivered:
            return  # one result per key: a late duplicate is dropped
        handle = self._handles.pop(key, None)
        if handle is not None:
            self._settle(handle, outcome)
        else:
            self._unclaimed[key] = outcome
            if len(self._unclaimed) > _DELIVERED_MEMORY:  # nobody is asking: keep the newest only
                self._unclaimed.pop(next(iter(self._unclaimed)))
            event, self._unclaimed_event = self._unclaimed_event, asyncio.Event()
            event.set()
        self._delivered[key] = None
        if len(self._delivered) > _DELIVERED_MEMORY:
            self._delivered.popitem(last=False)
