"""Preparing a version while the engine serves: materialize it from the store on the host-local
checkpoint (pull, apply, verify, in a thread), then stage it on the engine.

Preparing is bounded (``prepare_timeout_s``): a read that is slow or never returns (a wedged
mount, a hook that hangs) marks the replica ``degraded`` instead of leaving it ``preparing``
forever; past its bound the thread goes on, holding the checkpoint directory it writes
(``materializations``). A version whose prepare failed here is tried again after a backoff
(``version_failures``). Without a store (``store_dir`` None, e.g. the echo engine) preparing
reads nothing: the version is all there is to activate.

What is staged is computed against what the engine holds (``engine_sums``), never against the
checkpoint's marker (``weights_to_reload``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollfleet.policy_store import MaterializeResult
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.remote import store_label
from rollfleet.runtime import faults
from rollfleet.schemas.errors import PolicyError, PrepareTimeout, RollfleetError
from rollfleet.workers.engines import Engine
from rollfleet.workers.materializations import Flight, Materializations
from rollfleet.workers.registry import Registration
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.version_failures import VersionFailures, reason_of
from rollfleet.workers.version_startup import StartUp
from rollfleet.workers.weights_to_reload import combined, to_reload
from rollfleet.workers.worker_metrics import WorkerMetrics

FALLBACK_SLOT = ".rollfleet-fallback"  # the second checkpoint directory, inside the first


class VersionPreparer:
    """The checkpoint directory the engine loads from, what the engine holds, and each version
    that failed here."""

    def __init__(
        self,
        engine: Engine,
        served: ServedVersion,
        store: Path | Bucket | None,
        local_dir: Path,
        *,
        pre_read_hook: str | None,
        prepare_timeout_s: float,
        metrics: WorkerMetrics | None,
        on_failed: Callable[[], None],
        on_late: Callable[[], None],
        log: Any,
    ) -> None:
        self._engine = engine
        self._served = served
        self.store = store
        # Materializations running, by the directory they hold (none without a store).
        self._running = (
            None
            if store is None
            else Materializations(store, pre_read_hook=pre_read_hook, on_late=self._landed_late, log=log)
        )
        # The checkpoint directory the engine loads from; at start-up it may become the fallback
        # slot (another directory, where a prepare stuck in the first cannot block it).
        self.local_dir = Path(local_dir)
        self._slots = (self.local_dir, self.local_dir / FALLBACK_SLOT)
        self.prepare_timeout_s = prepare_timeout_s
        self._metrics = metrics
        self._on_failed = on_failed  # a version failed: the follow loop's retry timer
        self._on_late = on_late  # a prepare past its bound returned: the follow loop looks again
        self.log = log
        # Checksums of the tensors the engine holds ("fmt:hex"): those of the checkpoint it started
        # on, then of each version it activated. None: not known (reload what materialize says).
        self.engine_sums: dict[str, str] | None = None
        self.failed = VersionFailures()  # each version that failed here, and its retry
        self.failures: list[str] = []  # why, in order
        # Why the replica started on a version older than the latest commit (None: it did not).
        self.start_degraded: str | None = None
        self.registration: Registration | None = None

    @property
    def stuck(self) -> bool:
        """Whether a materialization's thread is still running (a prepare stuck in a read, or one
        a stop did not wait for): its pool's threads would hold the interpreter's exit."""
        return self._running is not None and self._running.stuck

    @property
    def busy(self) -> bool:
        """A prepare past its bound still holds the checkpoint directory (its return wakes the loop)."""
        return self._running is not None and self._running.holds(self.local_dir) is not None

    async def start_on(
        self, latest: int, held: bool, registration: Registration | None, older: Callable[[int], Awaitable[list[int]]]
    ) -> MaterializeResult:
        """The checkpoint to start serving on: ``latest`` if it materializes, else the newest older
        committed version that does (``version_startup``); ``NoServableVersion`` when none does."""
        if self._running is None:
            return await self.materialize(latest)
        start = StartUp(
            self._running,
            self._slots,
            bound_s=self.prepare_timeout_s,
            older_committed=older,
            store_label=str(store_label(self.store)),
            log=self.log,
        )
        started = await start.run(latest, held, registration)
        self.local_dir = started.where
        if started.latest_error is not None:
            self._start_degraded(latest, started.version, started.latest_error)
        return started.result

    def _start_degraded(self, latest: int, version: int, error: BaseException) -> None:
        """Started on ``version`` although ``latest`` is committed: say why; the follow loop tries
        ``latest`` again later, or follows a newer commit."""
        self.fail(latest)
        self.start_degraded = f"version {latest} cannot be served ({reason_of(error)}); serving {version}"
        self.failures.append(self.start_degraded)
        self.log.error("the latest version cannot be served; serving an older one", version=latest, serving=version)
        if self._metrics is not None:
            self._metrics.prepare_failures.inc()

    def _landed_late(self, flight: Flight, exc: BaseException | None) -> None:
        """A prepare its caller gave up on returned: it wakes the follow loop, and its success
        clears the failure it was counted as (the next prepare continues from it)."""
        if exc is None and flight.where == self.local_dir:
            # (a failure of that version or an older one is moot: the checkpoint holds it now)
            self.failed.materialized_late(flight.version)
        self._on_late()

    def fail(self, version: int) -> None:
        """``version`` failed here: the follow loop tries it again after a backoff (``following``)."""
        failed = self.failed.failed(version, time.monotonic())
        self.log.info(
            "version failed here; retried later",
            version=version,
            failures=failed.failures,
            retry_in_s=round(failed.retry_at - time.monotonic(), 3),
        )
        self._on_failed()

    async def prepare(self, target: int, log: Any, since: MaterializeResult | None = None) -> MaterializeResult | None:
        """Materialize ``target`` and stage it on the engine, serving meanwhile; ``since`` is a
        materialization already staged on the way from the live version. On failure the replica
        is marked degraded and keeps serving what it serves (None)."""
        assert self.registration is not None
        t0 = time.perf_counter()
        try:
            faults.point("worker:mid-prepare")
            result = await self.materialize(target)
            faults.point("worker:after-materialize")
            if since is not None:
                result = combined(since, result)
            result.changed = to_reload(self.engine_sums, result)
            # Staged relative to the live weights: every tensor that differs from what the engine holds.
            left = max(0.0, self.prepare_timeout_s - (time.perf_counter() - t0))
            staging = self._engine.prepare_weights(self.local_dir, result.changed, result.version)
            try:
                await asyncio.wait_for(staging, left)
            except TimeoutError:
                raise PrepareTimeout(f"staging version {target} took over {self.prepare_timeout_s:g} s") from None
        except (PolicyError, OSError, RollfleetError) as exc:
            self.fail(target)
            self.failures.append(reason := reason_of(exc))
            log.warning("prepare failed; still serving the current version", error=str(exc))
            if self._metrics is not None:
                self._metrics.prepare_failures.inc()
            reason = f"prepare of version {target} failed: {reason}"
            await self.registration.write(state="degraded", preparing_version=None, degraded_reason=reason)
            return None
        return result

    async def materialize(self, target: int) -> MaterializeResult:
        """Materialize ``target`` into the engine's checkpoint directory, bounded; past the bound
        the thread goes on (``materializations``) and ``PrepareTimeout`` is raised."""
        if self._running is None:  # nothing to read: the version is all there is to activate
            return MaterializeResult(version=target, previous_version=self._served.version, changed=[])
        return await self._running.bounded(target, self.local_dir, self.prepare_timeout_s)
