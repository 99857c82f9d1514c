"""Following published policy versions: prepare while serving, activate with a short pause.

The policy KV's ``latest`` key is the commit point. When it moves past the active version,
the worker coalesces to the newest version, materializes it on the host-local checkpoint
(pull, apply, verify — in a thread, while the engine keeps serving), stages it on the
engine, then pauses, swaps the changed tensors in, resumes, and only then advertises it
(registry + ``versions.activated``) and starts pulling its job subjects.

Noticing a commit costs an idle replica nothing: the worker hears each commit's
``versions.published`` announcement on a core subscription and hands the version to
``notice``. An announcement can be missed (the replica was disconnected, or the publisher died
between the commit and the announcement), so ``latest`` is also read after every reconnect
(``notice(None)``) and once per ``resync_s`` (120 s by default, jittered): a commit is followed
within milliseconds normally, and at the latest ``resync_s`` later.

Without a weight store (``store_dir`` None, e.g. the echo engine) an activation only moves the
engine's version: no files are read.

Preparing is bounded (``prepare_timeout_s``): a read that is slow or never returns (a wedged
mount, a hook that hangs) marks the replica ``degraded`` instead of leaving it ``preparing``
forever, and the stuck thread is a daemon, so it never keeps the process from exiting on SIGTERM.
Past its bound the prepare is not abandoned: its thread goes on holding the checkpoint directory
it writes, and its work is kept. A serving replica keeps its version meanwhile and tries nothing
else in that directory (``following.follow``'s ``busy``); the thread's return wakes the follow
loop, which continues from what it materialized.

What to reload is computed against what the engine holds, never against the local checkpoint's
marker: a version materialized but never activated (its prepare, staging or activation failed,
or a newer version failed on the way) has moved the checkpoint past the engine, and a later
delta's tensors alone would leave the engine with a mix of versions. The engine's tensors are
known by their checksums (those of the checkpoint it loaded, then of each version it
activated); every tensor whose checksum differs from the checkpoint's is reloaded. With
``verify_live`` the live weights are hashed after each activation and compared with the
checkpoint: a mismatch reloads every tensor, and one that persists degrades the replica.

A (re)started replica whose latest committed version cannot be materialized and verified (corrupt,
unreadable, missing) serves the newest version below it that can be (``fallback_versions``), reports
``degraded`` naming the bad version, and follows commits as usual; it exits
(``NoServableVersion``) only when no version can be served. Exiting instead would let a bad commit
take down every replica that restarts after it. The steps are ``following.start_step``'s. A
start-up prepare past its bound (slow reads) does not refuse the others: the next older version
is tried in a second checkpoint directory (``<local-dir>/.rollfleet-fallback``, a second copy of
the model on disk, made only then), the first of them to materialize is served, and while
nothing has yet the replica waits, ``starting`` with its ``degraded_reason`` saying why, for as
long as a prepare may still return.

``hold_version``: the replica serves that version and no other (pinned sessions and exact jobs
of an old version keep a replica while they need one); announcements of newer ones are ignored.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rollfleet.broker.buckets import KVBucket
from rollfleet.broker.kv import read_latest
from rollfleet.broker.types import JetStreamContext, KeyValue
from rollfleet.policy_store import CheckpointLayout, MaterializeResult
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.digest import content_digest, weights_digest
from rollfleet.policy_store.local_disk import as_local_disk_error
from rollfleet.policy_store.materialize import checkpoint_checksums
from rollfleet.policy_store.remote import materialize_from, open_store, store_label
from rollfleet.policy_store.store import list_versions
from rollfleet.runtime import faults
from rollfleet.runtime.aio import in_daemon_thread, stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, VersionActivated, VersionRecord, decode, encode
from rollfleet.schemas.errors import NoServableVersion, PolicyError, PrepareTimeout, RollfleetError
from rollfleet.workers.engines import Engine
from rollfleet.workers.registry import Registration
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.version_following import (
    Attempt,
    FailedVersion,
    after_failure,
    after_late_prepare,
    fall_back_to,
    fallback_versions,
    follow,
    start_step,
)
from rollfleet.workers.worker_metrics import WorkerMetrics

FALLBACK_SLOT = ".rollfleet-fallback"  # the second checkpoint directory, inside the first


@dataclass
class _Flight:
    """A materialization running on a daemon thread into ``where``; ``abandoned``: its caller
    stopped waiting (past its bound, or the start that launched it moved on)."""

    version: int
    where: Path
    task: asyncio.Task[MaterializeResult]
    abandoned: bool = False


class VersionSync:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        engine: Engine,
        served: ServedVersion,
        store_dir: Path | str | None,
        local_dir: Path,
        *,
        worker_id: str,
        on_activated: Callable[[], None],
        drain_exact: Callable[[int, float], Awaitable[tuple[float, int]]] | None = None,
        exact_drain_s: float = 30.0,
        resync_s: float = 120.0,
        pre_read_hook: str | None = None,
        metrics: WorkerMetrics | None = None,
        verify_live: bool = False,
        prepare_timeout_s: float = 1800.0,
        hold_version: int | None = None,
        store_endpoint: str | None = None,
    ) -> None:
        self._js = js
        self._names = names
        self._engine = engine
        self._served = served
        # A directory, or a bucket whose versions are downloaded into local_dir's cache first.
        self.store: Path | Bucket | None = (
            None
            if store_dir is None
            else open_store(store_dir, **({"endpoint": store_endpoint} if store_endpoint else {}))
        )
        # The checkpoint directory the engine loads from; at start-up it may become the fallback
        # slot (another directory, where a prepare stuck in the first cannot block it).
        self.local_dir = Path(local_dir)
        self._slots = (self.local_dir, self.local_dir / FALLBACK_SLOT)
        self._flights: dict[Path, _Flight] = {}  # materializations running, by the directory they hold
        self._worker_id = worker_id
        self._on_activated = on_activated  # wakes the worker's pull loop for the new subjects
        self._drain_exact = drain_exact  # waits for (then hands back) exact jobs of the old version
        self._exact_drain_s = exact_drain_s
        self._resync_s = resync_s
        self._pre_read_hook = pre_read_hook
        self._metrics = metrics
        self._verify_live = verify_live
        self.prepare_timeout_s = prepare_timeout_s
        self.hold_version = hold_version
        # Checksums of the tensors the engine holds ("fmt:hex"): those of the checkpoint it started
        # on, then of each version it activated. None: not known (reload what materialize says).
        self.engine_sums: dict[str, str] | None = None
        self._kv: KeyValue | None = None
        self._registration: Registration | None = None
        self._wake = asyncio.Event()
        self._announced: int | None = None  # the newest version announced since the last read
        self._reread = True  # read `latest` at the next wake (start, resync, reconnect)
        self._tasks: list[asyncio.Task[None]] = []
        # Each version that failed here, and when it may be tried again (``following``); the
        # newest of those above the served one is what ``follow`` waits on.
        self._failures: dict[int, FailedVersion] = {}
        self._stopping = False
        self._retry_wake: asyncio.TimerHandle | None = None
        # Why the replica started on a version older than the latest commit (None: it did not).
        self.start_degraded: str | None = None
        self.activations: list[VersionActivated] = []  # what each activation cost, as announced
        self.failures: list[str] = []
        self.log = get_logger("rollfleet.version_sync", worker_id=worker_id)

    # -- start-up catch-up ------------------------------------------------------------------
    async def catch_up(self, wait_s: float = 0.0, registration: Registration | None = None) -> MaterializeResult:
        """Before serving: materialize the latest committed version (base if none yet)."""
        self._kv = await self._js.key_value(self._names.policy_bucket)
        deadline = time.monotonic() + wait_s
        latest = await read_latest(self._kv)
        if latest is None and wait_s > 0:
            self.log.info("waiting for a first committed version", store=store_label(self.store), wait_s=wait_s)
        while latest is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            latest = await read_latest(self._kv)
        target = latest or 0
        if self.hold_version is not None:
            target = self.hold_version
        if registration is not None:  # clients see a replica preparing `target`, not an empty fleet
            await registration.write(preparing_version=target)
        t0 = time.perf_counter()
        result = await self._start_on(target, registration)
        self.engine_sums = dict(result.checksums)  # the engine starts on this checkpoint, whole
        if result.checksums:
            self._served.record_digest(result.version, content_digest(result.checksums))
        self.log.info(
            "caught up",
            version=result.version,
            local_dir=str(self.local_dir),
            reseeded=result.reseeded,
            applied=result.applied,
            fetched_bytes=result.fetched_bytes,  # from an object store (0 for a directory)
            seconds=round(time.perf_counter() - t0, 3),
        )
        return result

    async def _committed(self, version: int) -> bool:
        """Whether ``v.<version>`` says the version was committed (unknown, unreadable: no)."""
        assert self._kv is not None
        try:
            entry = await KVBucket(self._kv).get(self._names.version_key(version))
            return decode(entry.value or b"", VersionRecord, what="version record").committed
        except RollfleetError:  # (the broker's errors are ones)
            return False

    async def _older_committed(self, latest: int, above: int = -1) -> list[int]:
        """The versions below ``latest`` (and above ``above``) a replica may fall back to, newest
        first. Only those are looked up in the broker: a record read per version, so a serving
        replica asks of the few between its own version and the newest, not of the whole store."""
        store = self.store
        assert store is not None  # (without a store nothing is read, so nothing fails)
        try:
            if isinstance(store, Bucket):
                present = await asyncio.to_thread(store.versions)
            else:
                present = await asyncio.to_thread(list_versions, store)
        except (PolicyError, OSError) as exc:
            self.log.error("listing the store failed", error=str(exc))
            present = []
        committed = [v for v in present if above < v < latest and await self._committed(v)]
        return fallback_versions(present, latest, committed)

    async def _start_on(self, latest: int, registration: Registration | None) -> MaterializeResult:
        """The checkpoint to start serving on: ``latest`` if it materializes, else the newest older
        committed version that does (``following.start_step`` decides each step); waits while a
        prepare past its bound may still return; ``NoServableVersion`` when every one failed."""
        if self.store is None:
            return await self._materialize(latest)
        held = self.hold_version is not None
        older: list[int] | None = [] if held else None  # held: that version and no other
        attempts: dict[int, Attempt] = {}
        flights: dict[int, _Flight] = {}
        errors: dict[int, BaseException] = {}
        bound_at: dict[int, float] = {}
        for flight in self._flights.values():  # (left by an earlier try of this start: waited for too)
            attempts[flight.version], flights[flight.version] = "stuck", flight
            errors[flight.version] = PrepareTimeout(f"an earlier prepare of version {flight.version} is still running")
        while True:
            free = [slot for slot in self._slots if slot not in self._flights]
            step = start_step(latest, older, attempts, len(free))
            if step.action == "serve":
                assert step.version is not None
                flight = flights[step.version]
                self.local_dir = flight.where
                if step.version < latest:
                    self._start_degraded(latest, step.version, errors[latest])
                return flight.task.result()
            if step.action == "list":
                older = await self._older_committed(latest)
            elif step.action == "try":
                assert step.version is not None
                if step.version != latest:
                    self.log.warning("trying an older version", version=step.version, local_dir=str(free[0]))
                flights[step.version] = self._launch(step.version, free[0])
                attempts[step.version] = "running"
                bound_at[step.version] = time.monotonic() + self.prepare_timeout_s
            elif step.action == "give_up":
                if held:
                    raise errors[latest]
                shown = "; ".join(f"version {v}: {_reason(exc)}" for v, exc in list(errors.items())[:4])
                raise NoServableVersion(
                    f"no committed version at or below {latest} can be served from {store_label(self.store)} ({shown})",
                    latest=latest,
                    failures={v: getattr(exc, "code", type(exc).__name__) for v, exc in errors.items()},
                )
            else:  # wait: for a prepare to return, or for the one within its bound to pass it
                running = [bound_at[v] for v, a in attempts.items() if a == "running"]
                pending = {flights[v].task for v, a in attempts.items() if a in ("running", "stuck")}
                pending |= {f.task for f in self._flights.values()}  # (whatever holds a directory)
                timeout = max(0.0, min(running) - time.monotonic()) if running else None
                await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if self._settle_start(attempts, flights, errors, bound_at) and registration is not None:
                    # Serving nothing yet, and why ("degraded" would tell clients it pulls jobs).
                    await registration.write(degraded_reason=_waiting_reason(errors))

    def _settle_start(
        self,
        attempts: dict[int, Attempt],
        flights: dict[int, _Flight],
        errors: dict[int, BaseException],
        bound_at: dict[int, float],
    ) -> bool:
        """Record how the start-up prepares went since the last look; True if one failed or passed
        its bound while one is stuck (what the replica says while it waits changed)."""
        changed = False
        for v, attempt in list(attempts.items()):
            task = flights[v].task
            if attempt in ("running", "stuck") and task.done():
                exc = task.exception()
                if exc is None:
                    attempts[v] = "done"
                    continue
                if not isinstance(exc, (PolicyError, OSError)):
                    raise exc
                attempts[v], errors[v] = "failed", exc
                self.log.warning("a version cannot be served", version=v, error=str(exc))
                changed = True
            elif attempt == "running" and time.monotonic() >= bound_at[v]:
                flights[v].abandoned = True  # (its thread goes on; this start no longer waits on it alone)
                attempts[v] = "stuck"
                errors[v] = PrepareTimeout(
                    f"materializing version {v} took longer than {self.prepare_timeout_s:g} s (a read that is slow "
                    "or never returns); still running"
                )
                self.log.warning("a prepare is past its bound; waiting for it", version=v, error=str(errors[v]))
                changed = True
        return changed and "stuck" in attempts.values()

    def _start_degraded(self, latest: int, version: int, error: BaseException) -> None:
        """Started on ``version`` although ``latest`` is committed: say why; the follow loop tries
        ``latest`` again later, or follows a newer commit."""
        self._fail(latest)
        self.start_degraded = f"version {latest} cannot be served ({_reason(error)}); serving {version}"
        self.failures.append(self.start_degraded)
        self.log.error("the latest version cannot be served; serving an older one", version=latest, serving=version)
        if self._metrics is not None:
            self._metrics.prepare_failures.inc()

    def start(self, registration: Registration) -> None:
        self._registration = registration
        self._tasks = [
            asyncio.create_task(self._resync(), name="policy-resync"),
            asyncio.create_task(self._follow(), name="policy-follow"),
        ]
        failed = self._failed
        if failed is not None:  # (the version it could not start on is retried too)
            self._wake_at(failed.retry_at)

    async def stop(self) -> None:
        # The flag as well as the cancel: on Python 3.11 an asyncio.wait_for whose inner await
        # finishes as the cancel arrives swallows the cancel, and the follow loop would go on
        # activating versions on a draining replica until the process exits.
        self._stopping = True
        if self._retry_wake is not None:
            self._retry_wake.cancel()
        await stop_tasks(self._tasks)

    @property
    def _failed(self) -> FailedVersion | None:
        """The newest version above the served one that failed here (what ``follow`` waits on)."""
        above = [f for v, f in self._failures.items() if v > self._served.version]
        return max(above, key=lambda f: f.version, default=None)

    def _fail(self, version: int) -> None:
        """``version`` failed here: the follow loop tries it again after a backoff (``following``)."""
        failed = self._failures[version] = after_failure(self._failures.get(version), version, time.monotonic())
        self.log.info(
            "version failed here; retried later",
            version=version,
            failures=failed.failures,
            retry_in_s=round(failed.retry_at - time.monotonic(), 3),
        )
        if self._tasks:
            self._wake_at(min(f.retry_at for f in self._failures.values() if f.version > self._served.version))

    def _wake_at(self, at: float) -> None:
        """Read ``latest`` again at monotonic time ``at`` (one timer: a newer call replaces it)."""
        if self._retry_wake is not None:
            self._retry_wake.cancel()
        self._retry_wake = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), self.notice, None)

    # -- noticing new versions --------------------------------------------------------------
    def notice(self, version: int | None) -> None:
        """A commit of ``version`` was announced; None: read ``latest`` (e.g. after a reconnect)."""
        if version is None:
            self._reread = True
        elif self._announced is None or version > self._announced:
            self._announced = version
        self._wake.set()

    async def _resync(self) -> None:
        """A periodic re-read of ``latest``: the guard against a missed announcement."""
        while True:
            await asyncio.sleep(self._resync_s * random.uniform(0.8, 1.2))
            self.notice(None)

    async def _follow(self) -> None:
        assert self._kv is not None
        while not self._stopping:
            await self._wake.wait()
            if self._stopping:
                return
            self._wake.clear()
            latest, self._announced = self._announced, None
            if self._reread:
                self._reread = False
                try:
                    read = await read_latest(self._kv)
                except Exception as exc:
                    self.log.debug("reading latest failed", error=str(exc))
                    self._reread = True  # the next resync or reconnect tries again
                    read = None
                if read is not None and (latest is None or read > latest):
                    latest = read
            now = time.monotonic()
            decision = follow(
                latest,
                self._served.version,
                self._failed,
                now,
                held=self.hold_version is not None,
                busy=self.local_dir in self._flights,  # a prepare past its bound: its return wakes us
            )
            if decision.wake_at is not None:
                self._wake_at(decision.wake_at)  # that version failed here lately: try it again then
            target = decision.target
            if target is None and decision.wake_at is not None and latest is not None and self.store is not None:
                # Meanwhile the newest committed version below it that has not failed here.
                older = await self._older_committed(latest, above=self._served.version)
                target = fall_back_to(older, self._served.version, self._failures, time.monotonic())
                if target is not None:
                    self.log.info("newest version failed here; moving to an older one meanwhile",
                                  version=target, latest=latest)  # fmt: skip
            if target is not None:
                await self.update_to(target)

    async def _read_latest(self) -> int | None:
        assert self._kv is not None
        try:
            return await read_latest(self._kv)
        except Exception as exc:  # broker away: the follow loop tries again later
            self.log.debug("reading latest failed", error=str(exc))
            return None

    async def _prepare(self, target: int, log: Any, since: MaterializeResult | None = None) -> MaterializeResult | None:
        """Materialize ``target`` and stage it on the engine, serving meanwhile; ``since`` is a
        materialization already staged on the way from the live version. On failure the replica
        is marked degraded and keeps serving what it serves (None)."""
        assert self._registration is not None
        t0 = time.perf_counter()
        try:
            faults.point("worker:mid-prepare")
            result = await self._materialize(target)
            faults.point("worker:after-materialize")
            if since is not None:
                result = _combined(since, result)
            result.changed = self._to_reload(result)
            # Staged relative to the live weights: every tensor that differs from what the engine holds.
            left = max(0.0, self.prepare_timeout_s - (time.perf_counter() - t0))
            staging = self._engine.prepare_weights(self.local_dir, result.changed, result.version)
            try:
                await asyncio.wait_for(staging, left)
            except TimeoutError:
                raise PrepareTimeout(f"staging version {target} took over {self.prepare_timeout_s:g} s") from None
        except (PolicyError, OSError, RollfleetError) as exc:
            self._fail(target)
            self.failures.append(reason := _reason(exc))
            log.warning("prepare failed; still serving the current version", error=str(exc))
            if self._metrics is not None:
                self._metrics.prepare_failures.inc()
            reason = f"prepare of version {target} failed: {reason}"
            await self._registration.write(state="degraded", preparing_version=None, degraded_reason=reason)
            return None
        return result

    def _to_reload(self, result: MaterializeResult) -> list[str]:
        """The tensors whose bytes in the checkpoint differ from those the engine holds (all that
        the materialization touched, where what the engine holds is not known)."""
        held = self.engine_sums
        if held is None or not result.checksums:
            return list(result.changed)
        return [name for name, digest in result.checksums.items() if held.get(name) != digest]

    async def _drain_watching(self, previous: int, target: int) -> tuple[float, int]:
        """Drain exact jobs of ``previous``; meanwhile advertise a newer commit as the version being
        prepared, so clients do not fail fast on a fleet that is about to serve it."""
        assert self._drain_exact is not None and self._registration is not None
        drain = asyncio.ensure_future(self._drain_exact(previous, self._exact_drain_s))
        advertised = target
        while not drain.done():
            self._wake.clear()
            woken = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({drain, woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            latest = await self._read_latest() if not drain.done() else None
            if latest is not None and latest > advertised:
                advertised = latest
                await self._registration.write(preparing_version=latest)
        self._wake.set()  # let the follow loop look at `latest` again afterwards
        return drain.result()

    async def _materialize(self, target: int) -> MaterializeResult:
        """Materialize ``target`` into the engine's checkpoint directory, bounded; past the bound
        the thread goes on (``_launch``) and ``PrepareTimeout`` is raised."""
        if self.store is None:  # nothing to read: the version is all there is to activate
            return MaterializeResult(version=target, previous_version=self._served.version, changed=[])
        held = self._flights.get(self.local_dir)
        if held is not None:  # (the follow loop waits for it; never two writers in one directory)
            raise PrepareTimeout(f"the prepare of version {held.version} is still running; not preparing {target}")
        flight = self._launch(target, self.local_dir)
        try:
            return await asyncio.wait_for(asyncio.shield(flight.task), self.prepare_timeout_s)
        except TimeoutError:
            flight.abandoned = True
            raise PrepareTimeout(
                f"materializing version {target} took longer than {self.prepare_timeout_s:g} s (a read that is slow "
                "or never returns); still running"
            ) from None

    def _launch(self, target: int, where: Path) -> _Flight:
        """``materialize`` of ``target`` into ``where`` on a daemon thread (a stop never waits for it),
        held in ``_flights`` until the thread returns, however long after its caller gave up."""
        store = self.store
        assert store is not None and where not in self._flights

        def run() -> MaterializeResult:
            try:
                return materialize_from(store, where, target, pre_read_hook=self._pre_read_hook)
            except OSError as exc:  # the replica's own disk refusing a write: typed, retried later
                typed = as_local_disk_error(exc, str(where))
                if typed is None:
                    raise
                raise typed from exc

        flight = _Flight(target, where, asyncio.ensure_future(in_daemon_thread(run)))
        self._flights[where] = flight
        flight.task.add_done_callback(lambda _: self._landed(flight))
        return flight

    def _landed(self, flight: _Flight) -> None:
        """A materialization's thread returned. One its caller gave up on wakes the follow loop, and
        its success clears the failure it was counted as (the next prepare continues from it)."""
        self._flights.pop(flight.where, None)
        if flight.task.cancelled():
            return
        exc = flight.task.exception()  # (retrieved here: nobody may be awaiting it any more)
        if not flight.abandoned:
            return
        self.log.info(
            "a prepare past its bound returned",
            version=flight.version,
            local_dir=str(flight.where),
            error=None if exc is None else str(exc),
        )
        if exc is None and flight.where == self.local_dir:
            # (a failure of that version or an older one is moot: the checkpoint holds it now)
            self._failures = {v: f for v, f in self._failures.items() if after_late_prepare(f, flight.version)}
        if self._tasks:
            self.notice(None)

    @property
    def stuck(self) -> bool:
        """Whether a materialization's thread is still running (a prepare stuck in a read, or one
        a stop did not wait for): its pool's threads would hold the interpreter's exit."""
        return bool(self._flights)

    # -- prepare, activate, announce --------------------------------------------------------
    async def update_to(self, target: int) -> VersionActivated | None:
        assert self._registration is not None
        previous = self._served.version
        log = self.log.bind(version=target, previous_version=previous)
        if self.store is not None:  # (without a store there is nothing to prepare: activate at once)
            await self._registration.write(state="preparing", preparing_version=target)
        t0 = time.perf_counter()
        result = await self._prepare(target, log)
        if result is None:
            return None
        prepare_s = time.perf_counter() - t0
        faults.point("worker:before-activation")
        # From here exact jobs for `previous` are no longer taken; those running may finish
        # (bounded), so that every exact job runs entirely at its version or not at all.
        self._served.activating = result.version
        await self._registration.write(state="activating")  # clients: no more exact jobs for `previous` here
        drain_s, handed_back = 0.0, 0
        faults.point("worker:mid-drain")
        if self._drain_exact is not None:
            drain_s, handed_back = await self._drain_watching(previous, result.version)
        t_more = time.perf_counter()
        newer = await self._newer_after_drain(result, log)
        if newer is None:
            self._served.activating = None  # degraded (said by _prepare); keep serving `previous`
            return None
        if newer is not result:
            result = newer
            self._served.activating = result.version
            prepare_s += time.perf_counter() - t_more
            log = log.bind(version=result.version)
        if self._stopping:  # (a stop whose cancel was lost: never activate on a draining replica)
            self._served.activating = None
            return None
        paused = await self._swap_weights(result, target, log)
        if paused is None:
            return None
        pause_s, pause_wait_s = paused
        if result.checksums:
            self.engine_sums = dict(result.checksums)
            self._served.record_digest(result.version, content_digest(result.checksums))
        activation = VersionActivated(
            worker_id=self._worker_id,
            version=result.version,
            previous_version=previous,
            prepare_s=prepare_s,
            pause_s=pause_s,
            wire_bytes=result.wire_bytes,
            density=result.density,
            activated_at=time.time(),
            changed_tensors=len(result.changed),
            drain_s=drain_s,
            handed_back=handed_back,
        )
        self.activations.append(activation)
        self._observe(activation)
        # What failed at or below the version now served is moot; a newer one's retry stands.
        self._failures = {v: f for v, f in self._failures.items() if v > result.version}
        if not await self._announce(activation, result, log):
            return None
        log.info(
            "activated",
            prepare_s=round(prepare_s, 4),
            pause_s=round(pause_s, 5),
            pause_wait_s=round(pause_wait_s, 5),
            drain_s=round(drain_s, 4),
            handed_back=handed_back,
            wire_bytes=result.wire_bytes,
            density=round(result.density, 6),
            changed_tensors=len(result.changed),
            versions_applied=result.applied,
        )
        return activation

    async def _announce(self, activation: VersionActivated, result: MaterializeResult, log: Any) -> bool:
        """Announce, then serve: the registry entry and the announcement say the new version
        before the worker takes a single job for it. False where the live weights are not the
        checkpoint's (``--verify-live``; the replica is degraded and says why)."""
        assert self._registration is not None
        if self._verify_live:
            # After resume, off the pause: hashing every live tensor is not free.
            live = await asyncio.to_thread(self._engine.live_checksums)
            if live is not None and not await self._live_matches(live, result, log):
                return False
            activation.weights_digest = weights_digest(live) if live is not None else None
        await self._registration.write(
            state="ready", active_version=result.version, preparing_version=None, degraded_reason=None
        )
        with suppress(Exception):
            await self._js.publish(self._names.versions_activated, encode(activation))
        self._served.version, self._served.activating = result.version, None
        self._on_activated()
        return True

    async def _newer_after_drain(self, result: MaterializeResult, log: Any) -> MaterializeResult | None:
        """A long drain may have let newer versions be committed: go straight to the newest (once),
        rather than activate a version already superseded. ``result`` itself where there is none
        newer to go to (or the newest failed here lately: ``result`` is then the version below it,
        served meanwhile); None where preparing the newest failed."""
        newest = await self._read_latest()
        failed = self._failures.get(newest) if newest is not None else None
        if newest is None or newest <= result.version or (failed is not None and time.monotonic() < failed.retry_at):
            return result
        return await self._prepare(newest, log.bind(version=newest), since=result)

    async def _swap_weights(self, result: MaterializeResult, target: int, log: Any) -> tuple[float, float] | None:
        """Pause the engine, load the prepared version, resume: (the pause, the wait for it), or
        None where the load failed (the replica is degraded and says why)."""
        assert self._registration is not None
        t1 = time.perf_counter()
        try:
            faults.point("worker:mid-activation")
            await self._engine.pause()  # returns at the next step boundary; generation runs until then
            t2 = time.perf_counter()
            try:
                await self._engine.load_weights(self.local_dir, result.changed, result.version)
            finally:
                await self._engine.resume()
        except (RollfleetError, OSError) as exc:
            self._served.activating = None
            self.engine_sums = None  # a load that failed midway: what the engine holds is not known
            self._fail(target)
            self.failures.append(reason := _reason(exc))
            log.warning("activation failed; still serving the current version", error=str(exc))
            await self._registration.write(
                state="degraded", preparing_version=None, degraded_reason=f"activation of {target} failed: {reason}"
            )
            return None
        return time.perf_counter() - t2, t2 - t1  # (the stall: no step runs between pause and resume)

    def _observe(self, activation: VersionActivated) -> None:
        if self._metrics is not None:
            self._metrics.prepare.observe(activation.prepare_s)
            self._metrics.pause.observe(activation.pause_s)
            self._metrics.wire_bytes.inc(activation.wire_bytes)
            self._metrics.density.set(activation.density)
            self._metrics.activations.inc()
            self._metrics.drain.observe(activation.drain_s)

    async def _live_matches(self, live: dict[str, str], result: MaterializeResult, log: Any) -> bool:
        """The live weights hash to the checkpoint's bytes; if not, every tensor is reloaded once,
        and a mismatch that persists degrades the replica (it never serves mixed weights
        silently). True when they match (``live`` is then updated in place)."""
        want = _xxh3_sums(self.local_dir, result.checksums)
        if want is None:
            return True  # (no checkpoint to compare with: a model-free engine)
        wrong = sorted(n for n in want if live.get(n) != want[n])
        if not wrong:
            return True
        log.error("live weights differ from the checkpoint; reloading them all", tensors=wrong[:8], count=len(wrong))
        assert self._registration is not None
        await self._engine.pause()
        try:
            await self._engine.load_weights(self.local_dir, list(want), result.version)
        finally:
            await self._engine.resume()
        live.clear()
        live.update(await asyncio.to_thread(self._engine.live_checksums) or {})
        still = sorted(n for n in want if live.get(n) != want[n])
        if not still:
            self.engine_sums = dict(result.checksums)
            return True
        self.engine_sums = None
        reason = f"live weights differ from version {result.version} after a full reload: {still[:4]}"
        await self._registration.write(state="degraded", degraded_reason=reason)
        log.error("live weights still differ after a full reload; degraded", tensors=still[:8])
        return False


async def announce_start(sync: VersionSync, version: int) -> None:
    """With ``verify_live``: the version a replica starts serving, with a digest of its live weights,
    announced like an activation (``at_start``), so every answer it gives is covered by one."""
    live = await asyncio.to_thread(sync._engine.live_checksums)
    if live is None:
        return
    announcement = VersionActivated(
        worker_id=sync._worker_id,
        version=version,
        previous_version=version,
        prepare_s=0.0,
        pause_s=0.0,
        wire_bytes=0,
        density=0.0,
        activated_at=time.time(),
        weights_digest=weights_digest(live),
        at_start=True,
    )
    with suppress(Exception):
        await sync._js.publish(sync._names.versions_activated, encode(announcement))


def _waiting_reason(errors: dict[int, BaseException]) -> str:
    """What a starting replica that serves nothing yet says while it waits."""
    shown = "; ".join(f"version {v}: {_reason(errors[v])}" for v in sorted(errors, reverse=True)[:4])
    return f"serving nothing yet, waiting for a prepare still running ({shown})"


def _reason(exc: BaseException) -> str:
    """An error as a registry reason: its code (typed errors) and its message."""
    return f"{getattr(exc, 'code', type(exc).__name__)}: {exc}"


def _xxh3_sums(local_dir: Path, sums: dict[str, str]) -> dict[str, str] | None:
    """Every tensor's xxh3-128 (what ``Engine.live_checksums`` reports) in the checkpoint: taken
    from the marker's checksums where they are xxh3-128, hashed from the files otherwise."""
    if not sums:
        return None
    out = {name: digest.partition(":")[2] for name, digest in sums.items() if digest.startswith("xxh3-128:")}
    if len(out) < len(sums):
        layout = CheckpointLayout.read(local_dir)
        hashed = checkpoint_checksums(layout, "xxh3-128")
        out = {name: hashed[name] for name in sums if name in hashed}
    return out


def _combined(first: MaterializeResult, then: MaterializeResult) -> MaterializeResult:
    """Two materializations in a row, as one step from ``first.previous_version``."""
    order = {name: i for i, name in enumerate(then.changed + first.changed)}
    changed = sorted(set(first.changed) | set(then.changed), key=order.__getitem__)
    changed_bytes = first.changed_bytes + then.changed_bytes
    total = then.total_bytes or first.total_bytes
    return replace(
        then,
        previous_version=first.previous_version,
        changed=changed,
        applied=first.applied + then.applied,
        wire_bytes=first.wire_bytes + then.wire_bytes,
        changed_bytes=changed_bytes,
        density=min(1.0, changed_bytes / total) if total else 0.0,
        seconds=first.seconds + then.seconds,
    )
