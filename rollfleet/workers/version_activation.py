"""Activating a prepared version: drain, swap, announce.

Exact jobs of the version served are no longer taken from the moment an activation starts;
those running may finish (bounded), so that every exact job runs entirely at its version or not
at all. A long drain may have let newer versions be committed: the activation goes straight to
the newest (once) rather than activate one already superseded. Then the engine pauses at a step
boundary, swaps the changed tensors in and resumes (``weight_swap``), and only then is the
version advertised (registry + ``versions.activated``) and its job subjects pulled. With
``verify_live`` the live weights are hashed after each activation and compared with the
checkpoint: a mismatch reloads every tensor, and one that persists degrades the replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from rollfleet.broker.types import JetStreamContext
from rollfleet.policy_store import MaterializeResult
from rollfleet.policy_store.digest import content_digest, weights_digest
from rollfleet.runtime import faults
from rollfleet.schemas import Names, VersionActivated, encode
from rollfleet.schemas.errors import RollfleetError
from rollfleet.workers.engines import Engine
from rollfleet.workers.registry import Registration
from rollfleet.workers.served_version import ServedVersion
from rollfleet.workers.version_failures import reason_of
from rollfleet.workers.version_prepare import VersionPreparer
from rollfleet.workers.weight_swap import live_mismatch, swap_weights
from rollfleet.workers.worker_metrics import WorkerMetrics


class VersionActivation:
    """Moving the engine and the replica's advertised version to a newer one."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        engine: Engine,
        served: ServedVersion,
        preparer: VersionPreparer,
        *,
        worker_id: str,
        on_activated: Callable[[], None],
        drain_exact: Callable[[int, float], Awaitable[tuple[float, int]]] | None,
        exact_drain_s: float,
        metrics: WorkerMetrics | None,
        verify_live: bool,
        wake: asyncio.Event,
        read_latest: Callable[[], Awaitable[int | None]],
        stopping: Callable[[], bool],
        log: Any,
    ) -> None:
        self._js, self._names, self._engine, self._served = js, names, engine, served
        self._preparer = preparer
        self._worker_id = worker_id
        self._on_activated = on_activated  # wakes the worker's pull loop for the new subjects
        self._drain_exact = drain_exact  # waits for (then hands back) exact jobs of the old version
        self._exact_drain_s = exact_drain_s
        self._metrics = metrics
        self._verify_live = verify_live
        self._wake = wake  # the follow loop's: a notice during a drain is looked at at once
        self._read_latest = read_latest
        self._stopping = stopping
        self.log = log
        self.registration: Registration | None = None
        self.activations: list[VersionActivated] = []  # what each activation cost, as announced

    async def update_to(self, target: int) -> VersionActivated | None:
        assert self.registration is not None
        previous = self._served.version
        log = self.log.bind(version=target, previous_version=previous)
        if self._preparer.store is not None:  # (without a store there is nothing to prepare: activate at once)
            await self.registration.write(state="preparing", preparing_version=target)
        t0 = time.perf_counter()
        result = await self._preparer.prepare(target, log)
        if result is None:
            return None
        prepare_s = time.perf_counter() - t0
        faults.point("worker:before-activation")
        # From here exact jobs for `previous` are no longer taken; those running may finish
        # (bounded), so that every exact job runs entirely at its version or not at all.
        self._served.activating = result.version
        await self.registration.write(state="activating")  # clients: no more exact jobs for `previous` here
        drained = 0.0, 0
        faults.point("worker:mid-drain")
        if self._drain_exact is not None:
            drained = await self._drain_watching(previous, result.version)
        t_more = time.perf_counter()
        newer = await self._newer_after_drain(result, log)
        if newer is None:
            self._served.activating = None  # degraded (said by the preparer); keep serving `previous`
            return None
        if newer is not result:
            result = newer
            self._served.activating = result.version
            prepare_s += time.perf_counter() - t_more
            log = log.bind(version=result.version)
        if self._stopping():  # (a stop whose cancel was lost: never activate on a draining replica)
            self._served.activating = None
            return None
        paused = await self._swap(result, target, log)
        if paused is None:
            return None
        return await self._activated(result, previous, prepare_s, paused, drained, log)

    async def _activated(
        self,
        result: MaterializeResult,
        previous: int,
        prepare_s: float,
        paused: tuple[float, float],
        drained: tuple[float, int],
        log: Any,
    ) -> VersionActivated | None:
        """The engine serves ``result``: record what the activation cost, then announce it."""
        (pause_s, pause_wait_s), (drain_s, handed_back) = paused, drained
        if result.checksums:
            self._preparer.engine_sums = dict(result.checksums)
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
        if self._metrics is not None:
            self._metrics.observe_activation(activation)
        # What failed at or below the version now served is moot; a newer one's retry stands.
        self._preparer.failed.served(result.version)
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

    async def _drain_watching(self, previous: int, target: int) -> tuple[float, int]:
        """Drain exact jobs of ``previous``; meanwhile advertise a newer commit as the version being
        prepared, so clients do not fail fast on a fleet that is about to serve it."""
        assert self._drain_exact is not None and self.registration is not None
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
                await self.registration.write(preparing_version=latest)
        self._wake.set()  # let the follow loop look at `latest` again afterwards
        return drain.result()

    async def _newer_after_drain(self, result: MaterializeResult, log: Any) -> MaterializeResult | None:
        """A long drain may have let newer versions be committed: go straight to the newest (once),
        rather than activate a version already superseded. ``result`` itself where there is none
        newer to go to (or the newest failed here lately: ``result`` is then the version below it,
        served meanwhile); None where preparing the newest failed."""
        newest = await self._read_latest()
        if newest is None or newest <= result.version or self._preparer.failed.cooling(newest, time.monotonic()):
            return result
        return await self._preparer.prepare(newest, log.bind(version=newest), since=result)

    async def _swap(self, result: MaterializeResult, target: int, log: Any) -> tuple[float, float] | None:
        """Pause the engine, load the prepared version, resume: (the pause, the wait for it), or
        None where the load failed (the replica is degraded and says why)."""
        assert self.registration is not None
        try:
            return await swap_weights(self._engine, self._preparer.local_dir, result)
        except (RollfleetError, OSError) as exc:
            self._served.activating = None
            self._preparer.engine_sums = None  # a load that failed midway: what the engine holds is not known
            self._preparer.fail(target)
            self._preparer.failures.append(reason := reason_of(exc))
            log.warning("activation failed; still serving the current version", error=str(exc))
            await self.registration.write(
                state="degraded", preparing_version=None, degraded_reason=f"activation of {target} failed: {reason}"
            )
            return None

    async def _announce(self, activation: VersionActivated, result: MaterializeResult, log: Any) -> bool:
        """Announce, then serve: the registry entry and the announcement say the new version
        before the worker takes a single job for it. False where the live weights are not the
        checkpoint's (``--verify-live``; the replica is degraded and says why)."""
        assert self.registration is not None
        if self._verify_live:
            # After resume, off the pause: hashing every live tensor is not free.
            live = await asyncio.to_thread(self._engine.live_checksums)
            if live is not None and not await self._live_matches(live, result, log):
                return False
            activation.weights_digest = weights_digest(live) if live is not None else None
        await self.registration.write(
            state="ready", active_version=result.version, preparing_version=None, degraded_reason=None
        )
        with suppress(Exception):
            await self._js.publish(self._names.versions_activated, encode(activation))
        self._served.version, self._served.activating = result.version, None
        self._on_activated()
        return True

    async def _live_matches(self, live: dict[str, str], result: MaterializeResult, log: Any) -> bool:
        """The live weights hash to the checkpoint's bytes (after a full reload, where they did
        not at first: ``weight_swap.live_mismatch``); a mismatch that persists degrades the
        replica (it never serves mixed weights silently). True when they match."""
        still = await live_mismatch(self._engine, self._preparer.local_dir, result, live, log)
        if not still:
            return True
        assert self.registration is not None
        self._preparer.engine_sums = None
        reason = f"live weights differ from version {result.version} after a full reload: {still[:4]}"
        await self.registration.write(state="degraded", degraded_reason=reason)
        log.error("live weights still differ after a full reload; degraded", tensors=still[:8])
        return False
