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

Where each part lives: this module follows ``latest`` (the follow loop and its timers, the rules
being ``version_following``'s); ``version_prepare`` materializes and stages a version
(``materializations`` for the threads, ``version_startup`` for the first one, ``version_failures``
for retries); ``version_activation`` drains, swaps (``weight_swap``) and announces.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollfleet.broker.kv import read_latest
from rollfleet.broker.types import JetStreamContext, KeyValue, Msg
from rollfleet.policy_store import MaterializeResult
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.digest import content_digest
from rollfleet.policy_store.remote import open_store, store_label
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, VersionActivated, VersionPublished, decode
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.workers.committed_versions import older_committed
from rollfleet.workers.engines import Engine
from rollfleet.workers.registry import Registration
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.version_activation import VersionActivation
from rollfleet.workers.version_following import FailedVersion, fall_back_to, follow
from rollfleet.workers.version_prepare import VersionPreparer
from rollfleet.workers.worker_metrics import WorkerMetrics


def _open(store_dir: Path | str | None, endpoint: str | None) -> Path | Bucket | None:
    """A directory, or a bucket whose versions are downloaded into local_dir's cache first."""
    if store_dir is None:
        return None
    return open_store(store_dir, **({"endpoint": endpoint} if endpoint else {}))


class VersionSync:
    """Following ``latest``: noticing commits, choosing the next version, and the follow loop that
    prepares (``VersionPreparer``) and activates (``VersionActivation``) it."""

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
        self._js, self._names, self._served = js, names, served
        self.log = get_logger("rollfleet.version_sync", worker_id=worker_id)
        self.prepared = VersionPreparer(
            engine,
            served,
            _open(store_dir, store_endpoint),
            local_dir,
            pre_read_hook=pre_read_hook,
            prepare_timeout_s=prepare_timeout_s,
            metrics=metrics,
            on_failed=self._failed_here,
            on_late=self._landed_late,
            log=self.log,
        )
        self._wake = asyncio.Event()
        self.activation = VersionActivation(
            js,
            names,
            engine,
            served,
            self.prepared,
            worker_id=worker_id,
            on_activated=on_activated,
            drain_exact=drain_exact,
            exact_drain_s=exact_drain_s,
            metrics=metrics,
            verify_live=verify_live,
            wake=self._wake,
            read_latest=self._read_latest,
            stopping=lambda: self._stopping,
            log=self.log,
        )
        self._resync_s, self.hold_version = resync_s, hold_version
        self._kv: KeyValue | None = None
        self._announced: int | None = None  # the newest version announced since the last read
        self._reread = True  # read `latest` at the next wake (start, resync, reconnect)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._retry_wake: asyncio.TimerHandle | None = None

    # What the replica reads of it: where the engine's checkpoint is, what it holds, how it went.
    @property
    def store(self) -> Path | Bucket | None:
        return self.prepared.store

    @property
    def local_dir(self) -> Path:
        """The checkpoint directory the engine loads from (at start-up, maybe the fallback slot)."""
        return self.prepared.local_dir

    @property
    def engine_sums(self) -> dict[str, str] | None:
        """Checksums of the tensors the engine holds (None: not known)."""
        return self.prepared.engine_sums

    @property
    def start_degraded(self) -> str | None:
        """Why the replica started on a version older than the latest commit (None: it did not)."""
        return self.prepared.start_degraded

    @property
    def failures(self) -> list[str]:
        return self.prepared.failures

    @property
    def activations(self) -> list[VersionActivated]:
        """What each activation cost, as announced."""
        return self.activation.activations

    @property
    def stuck(self) -> bool:
        """Whether a materialization's thread is still running (a prepare stuck in a read, or one
        a stop did not wait for): its pool's threads would hold the interpreter's exit."""
        return self.prepared.stuck

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
        result = await self.prepared.start_on(
            target, self.hold_version is not None, registration, self._older_committed
        )
        self.prepared.engine_sums = dict(result.checksums)  # the engine starts on this checkpoint, whole
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

    async def _older_committed(self, latest: int, above: int = -1) -> list[int]:
        """The committed versions below ``latest`` (and above ``above``) in the store, newest first."""
        assert self.prepared.store is not None and self._kv is not None  # (without a store nothing fails)
        return await older_committed(self.prepared.store, self._kv, self._names, latest, self.log, above)

    def start(self, registration: Registration) -> None:
        self.prepared.registration = self.activation.registration = registration
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
        return self.prepared.failed.newest_above(self._served.version)

    def _failed_here(self) -> None:
        """A version failed here: look again at the first retry due (once the loop runs)."""
        retry_at = self.prepared.failed.next_retry_above(self._served.version)
        if self._tasks and retry_at is not None:
            self._wake_at(retry_at)

    def _landed_late(self) -> None:
        """A prepare past its bound returned: the follow loop continues from what it materialized."""
        if self._tasks:
            self.notice(None)

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

    async def on_published(self, msg: Msg) -> None:
        """A ``versions.published`` announcement."""
        try:
            announced = decode(msg.data, VersionPublished, what="version announcement")
        except InvalidRequest:
            self.notice(None)  # unreadable: read the version from the policy KV instead
            return
        self.notice(announced.record.version)

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
            target = await self._next_target(latest)
            if target is not None:
                await self.activation.update_to(target)

    async def _next_target(self, latest: int | None) -> int | None:
        """The version to move to now (``following.follow``), or meanwhile the newest committed one
        below a newest that failed here lately; arms the retry timer where one failed."""
        decision = follow(
            latest,
            self._served.version,
            self._failed,
            time.monotonic(),
            held=self.hold_version is not None,
            busy=self.prepared.busy,
        )  # (busy: a prepare past its bound holds the checkpoint; its return wakes us)
        if decision.wake_at is not None:
            self._wake_at(decision.wake_at)  # that version failed here lately: try it again then
        target = decision.target
        if target is None and decision.wake_at is not None and latest is not None and self.prepared.store is not None:
            # Meanwhile the newest committed version below it that has not failed here.
            older = await self._older_committed(latest, above=self._served.version)
            target = fall_back_to(older, self._served.version, self.prepared.failed.by_version, time.monotonic())
            if target is not None:
                self.log.info(
                    "newest version failed here; moving to an older one meanwhile", version=target, latest=latest
                )
        return target

    async def _read_latest(self) -> int | None:
        assert self._kv is not None
        try:
            return await read_latest(self._kv)
        except Exception as exc:  # broker away: the follow loop tries again later
            self.log.debug("reading latest failed", error=str(exc))
            return None

    async def update_to(self, target: int) -> VersionActivated | None:
        """Prepare ``target`` and activate it (``VersionActivation.update_to``)."""
        return await self.activation.update_to(target)
