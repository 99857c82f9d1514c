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
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollfleet.broker.kv import read_latest
from rollfleet.policy_store import MaterializeResult, materialize
from rollfleet.policy_store.digest import weights_digest
from rollfleet.runtime import faults
from rollfleet.runtime.aio import stop_tasks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, VersionActivated, encode
from rollfleet.schemas.errors import PolicyError, RollfleetError
from rollfleet.workers.engines import Engine
from rollfleet.workers.metrics import WorkerMetrics
from rollfleet.workers.registry import Registration
from rollfleet.workers.serving import ServedVersion


class VersionSync:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        engine: Engine,
        served: ServedVersion,
        store_dir: Path | None,
        local_dir: Path,
        *,
        worker_id: str,
        on_activated: Callable[[], None],
        resync_s: float = 120.0,
        pre_read_hook: str | None = None,
        metrics: WorkerMetrics | None = None,
        verify_live: bool = False,
    ) -> None:
        self._js = js
        self._names = names
        self._engine = engine
        self._served = served
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.local_dir = Path(local_dir)
        self._worker_id = worker_id
        self._on_activated = on_activated  # wakes the worker's pull loop for the new subjects
        self._resync_s = resync_s
        self._pre_read_hook = pre_read_hook
        self._metrics = metrics
        self._verify_live = verify_live
        self._kv: KeyValue | None = None
        self._registration: Registration | None = None
        self._wake = asyncio.Event()
        self._announced: int | None = None  # the newest version announced since the last read
        self._reread = True  # read `latest` at the next wake (start, resync, reconnect)
        self._tasks: list[asyncio.Task[None]] = []
        self._failed_version: int | None = None
        self.activations: list[VersionActivated] = []  # what each activation cost, as announced
        self.failures: list[str] = []
        self.log = get_logger("rollfleet.version_sync", worker_id=worker_id)

    # -- start-up catch-up ------------------------------------------------------------------
    async def catch_up(self, wait_s: float = 0.0, registration: Registration | None = None) -> MaterializeResult:
        """Before serving: materialize the latest committed version (base if none yet)."""
        self._kv = await self._js.key_value(self._names.policy_bucket)
        deadline = time.monotonic() + wait_s
        latest = await read_latest(self._kv)
        while latest is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            latest = await read_latest(self._kv)
        target = latest or 0
        if registration is not None:  # clients see a replica preparing `target`, not an empty fleet
            await registration.write(preparing_version=target)
        t0 = time.perf_counter()
        result = await self._materialize(target)
        self.log.info(
            "caught up",
            version=result.version,
            reseeded=result.reseeded,
            applied=result.applied,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return result

    def _materialize(self, target: int) -> Awaitable[MaterializeResult]:
        if self.store_dir is None:  # nothing to read: the version is all there is to activate
            result = MaterializeResult(version=target, previous_version=self._served.version, changed=[])
            return asyncio.sleep(0, result)
        return asyncio.to_thread(materialize, self.local_dir, self.store_dir, target, pre_read_hook=self._pre_read_hook)

    def start(self, registration: Registration) -> None:
        self._registration = registration
        self._tasks = [
            asyncio.create_task(self._resync(), name="policy-resync"),
            asyncio.create_task(self._follow(), name="policy-follow"),
        ]

    async def stop(self) -> None:
        await stop_tasks(self._tasks)

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
        while True:
            await self._wake.wait()
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
            if latest is None or latest <= self._served.version:
                continue
            if self._failed_version is not None and latest <= self._failed_version:
                continue  # that version failed here; wait for the next one
            await self.update_to(latest)

    # -- prepare, activate, announce --------------------------------------------------------
    async def update_to(self, target: int) -> VersionActivated | None:
        assert self._registration is not None
        previous = self._served.version
        log = self.log.bind(version=target, previous_version=previous)
        if self.store_dir is not None:  # (without a store there is nothing to prepare: activate at once)
            await self._registration.write(state="preparing", preparing_version=target)
        t0 = time.perf_counter()
        try:
            result = await self._materialize(target)
            await self._engine.prepare_weights(self.local_dir, result.changed, result.version)
        except (PolicyError, OSError, RollfleetError) as exc:
            self._failed_version = target
            self.failures.append(reason := f"{getattr(exc, 'code', type(exc).__name__)}: {exc}")
            reason = f"prepare of version {target} failed: {reason}"
            log.warning("prepare failed; still serving the current version", error=str(exc))
            if self._metrics is not None:
                self._metrics.prepare_failures.inc()
            await self._registration.write(state="degraded", preparing_version=None, degraded_reason=reason)
            return None
        prepare_s = time.perf_counter() - t0
        faults.point("worker:before-activation")
        t1 = time.perf_counter()
        await self._engine.pause()  # returns at the next step boundary; generation runs until then
        t2 = time.perf_counter()
        try:
            await self._engine.load_weights(self.local_dir, result.changed, result.version)
        finally:
            await self._engine.resume()
        pause_s = time.perf_counter() - t2  # the stall: no step runs between pause and resume
        pause_wait_s = t2 - t1
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
        )
        self.activations.append(activation)
        if self._metrics is not None:
            self._metrics.prepare.observe(prepare_s)
            self._metrics.pause.observe(pause_s)
            self._metrics.wire_bytes.inc(result.wire_bytes)
            self._metrics.density.set(result.density)
            self._metrics.activations.inc()
        self._failed_version = None
        if self._verify_live:
            # After resume, off the pause: hashing every live tensor is not free.
            live = await asyncio.to_thread(self._engine.live_checksums)
            activation.weights_digest = weights_digest(live) if live is not None else None
        # Advertise, then serve: the registry entry and the announcement say the new version
        # before the worker takes a single job for it.
        self._served.version = result.version
        await self._registration.write(state="ready", preparing_version=None, degraded_reason=None)
        with suppress(Exception):
            await self._js.publish(self._names.versions_activated, encode(activation))
        self._on_activated()
        log.info(
            "activated",
            prepare_s=round(prepare_s, 4),
            pause_s=round(pause_s, 5),
            pause_wait_s=round(pause_wait_s, 5),
            wire_bytes=result.wire_bytes,
            density=round(result.density, 6),
            changed_tensors=len(result.changed),
            versions_applied=result.applied,
        )
        return activation
