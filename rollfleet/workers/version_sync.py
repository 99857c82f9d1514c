"""Following published policy versions: prepare while serving, activate with a short pause.

The policy KV's ``latest`` key is the commit point. When it moves past the active version,
the worker coalesces to the newest version, materializes it on the host-local checkpoint
(pull, apply, verify — in a thread, while the engine keeps serving), stages it on the
engine, then pauses, swaps the changed tensors in, resumes, and only then advertises it
(registry + ``versions.activated``) and starts pulling its job subjects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollfleet import faults
from rollfleet.broker.kv import read_latest
from rollfleet.logs import get_logger
from rollfleet.policy_store import MaterializeResult, materialize
from rollfleet.policy_store.digest import weights_digest
from rollfleet.schemas import Names, VersionActivated, encode
from rollfleet.schemas.errors import PolicyError, RollfleetError
from rollfleet.tasks import stop_tasks, watch_keys
from rollfleet.workers.engines import Engine
from rollfleet.workers.metrics import WorkerMetrics
from rollfleet.workers.registry import Registration


@dataclass
class Activation:
    """What one activation cost; also the payload of the activation announcement."""

    version: int
    previous_version: int
    prepare_s: float
    pause_s: float
    wire_bytes: int
    density: float
    changed_tensors: int


class VersionSync:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        engine: Engine,
        store_dir: Path,
        local_dir: Path,
        *,
        worker_id: str,
        on_activated: Callable[[int], Awaitable[None]],
        resync_s: float = 5.0,
        pre_read_hook: str | None = None,
        metrics: WorkerMetrics | None = None,
        verify_live: bool = False,
    ) -> None:
        self._js = js
        self._names = names
        self._engine = engine
        self.store_dir = Path(store_dir)
        self.local_dir = Path(local_dir)
        self._worker_id = worker_id
        self._on_activated = on_activated  # the worker switches its subjects here
        self._resync_s = resync_s
        self._pre_read_hook = pre_read_hook
        self._metrics = metrics
        self._verify_live = verify_live
        self._kv: KeyValue | None = None
        self._registration: Registration | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._failed_version: int | None = None
        self.activations: list[Activation] = []
        self.failures: list[str] = []
        self.log = get_logger("rollfleet.version_sync", worker_id=worker_id)

    # -- start-up catch-up ------------------------------------------------------------------
    async def catch_up(self, wait_s: float = 0.0, registration: Registration | None = None) -> MaterializeResult:
        """Before serving: materialize the latest committed version (base if none yet)."""
        self._kv = await self._js.key_value(self._names.policy_bucket)
        deadline = time.monotonic() + wait_s
        latest = await read_latest(self._kv)
        if latest is None and wait_s > 0:
            self.log.info("waiting for a first committed version", store=str(self.store_dir), wait_s=wait_s)
        while latest is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            latest = await read_latest(self._kv)
        target = latest or 0
        if registration is not None:  # clients see a replica preparing `target`, not an empty fleet
            await registration.write(preparing_version=target)
        t0 = time.perf_counter()
        result = await asyncio.to_thread(
            materialize, self.local_dir, self.store_dir, target, pre_read_hook=self._pre_read_hook
        )
        self.log.info(
            "caught up",
            version=result.version,
            reseeded=result.reseeded,
            applied=result.applied,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return result

    def start(self, registration: Registration) -> None:
        self._registration = registration
        self._tasks = [
            asyncio.create_task(
                watch_keys(self._kv, self._names.LATEST_KEY, lambda _: self._wake.set(), self.log), name="policy-watch"
            ),
            asyncio.create_task(self._resync(), name="policy-resync"),
            asyncio.create_task(self._follow(), name="policy-follow"),
        ]

    async def stop(self) -> None:
        await stop_tasks(self._tasks)

    # -- noticing new versions --------------------------------------------------------------
    async def _resync(self) -> None:
        """A periodic re-read of ``latest``: the guard against a missed watcher update."""
        while True:
            await asyncio.sleep(self._resync_s)
            self._wake.set()

    async def _follow(self) -> None:
        assert self._kv is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                latest = await read_latest(self._kv)
            except Exception as exc:
                self.log.debug("reading latest failed", error=str(exc))
                continue
            if latest is None or latest <= self._engine.version:
                continue
            if self._failed_version is not None and latest <= self._failed_version:
                continue  # that version failed here; wait for the next one
            await self.update_to(latest)

    # -- prepare, activate, announce --------------------------------------------------------
    async def update_to(self, target: int) -> Activation | None:
        assert self._registration is not None
        previous = self._engine.version
        log = self.log.bind(version=target, previous_version=previous)
        await self._registration.write(state="preparing", preparing_version=target)
        t0 = time.perf_counter()
        try:
            result = await asyncio.to_thread(
                materialize, self.local_dir, self.store_dir, target, pre_read_hook=self._pre_read_hook
            )
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
        faults.point("before-activation")
        t1 = time.perf_counter()
        await self._engine.pause()  # returns at the next step boundary; generation runs until then
        t2 = time.perf_counter()
        try:
            await self._engine.load_weights(self.local_dir, result.changed, result.version)
        finally:
            await self._engine.resume()
        pause_s = time.perf_counter() - t2  # the stall: no step runs between pause and resume
        pause_wait_s = t2 - t1
        activation = Activation(
            version=result.version,
            previous_version=previous,
            prepare_s=prepare_s,
            pause_s=pause_s,
            wire_bytes=result.wire_bytes,
            density=result.density,
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
        # Advertise only now: registry, announcement, then the new version's subjects.
        await self._on_activated(result.version)
        await self._registration.write(
            state="ready", active_version=result.version, preparing_version=None, degraded_reason=None
        )
        announcement = VersionActivated(
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
        if self._verify_live:
            # After resume, off the pause: hashing every live tensor is not free.
            live = await asyncio.to_thread(self._engine.live_checksums)
            announcement.weights_digest = weights_digest(live) if live is not None else None
        with suppress(Exception):
            await self._js.publish(self._names.versions_activated, encode(announcement))
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
