"""Activating a prepared version on the engine: pause, load, resume; and, with ``verify_live``,
the live weights checked against the checkpoint's bytes.

The pause returns at the engine's next step boundary, so the stall is the load alone. A check
that finds live weights differing from the checkpoint reloads every tensor once; a replica never
serves mixed weights silently: a mismatch that persists is for the caller to degrade on.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from rollfleet.broker.types import JetStreamContext
from rollfleet.policy_store import CheckpointLayout, MaterializeResult
from rollfleet.policy_store.digest import weights_digest
from rollfleet.policy_store.materialize import checkpoint_checksums
from rollfleet.runtime import faults
from rollfleet.schemas import Names, VersionActivated, encode
from rollfleet.workers.engines import Engine


async def swap_weights(engine: Engine, local_dir: Path, result: MaterializeResult) -> tuple[float, float]:
    """Pause the engine, load the prepared version, resume: (the pause, the wait for it). A load
    that fails raises, the engine resumed."""
    t1 = time.perf_counter()
    faults.point("worker:mid-activation")
    await engine.pause()  # returns at the next step boundary; generation runs until then
    t2 = time.perf_counter()
    try:
        await engine.load_weights(local_dir, result.changed, result.version)
    finally:
        await engine.resume()
    return time.perf_counter() - t2, t2 - t1  # (the stall: no step runs between pause and resume)


async def live_mismatch(
    engine: Engine, local_dir: Path, result: MaterializeResult, live: dict[str, str], log: Any
) -> list[str]:
    """The tensors whose live weights still differ from the checkpoint's bytes after every tensor
    was reloaded once (none reloaded where they matched); empty when they match (``live`` is then
    updated in place)."""
    want = xxh3_sums(local_dir, result.checksums)
    if want is None:
        return []  # (no checkpoint to compare with: a model-free engine)
    wrong = sorted(n for n in want if live.get(n) != want[n])
    if not wrong:
        return []
    log.error("live weights differ from the checkpoint; reloading them all", tensors=wrong[:8], count=len(wrong))
    await engine.pause()
    try:
        await engine.load_weights(local_dir, list(want), result.version)
    finally:
        await engine.resume()
    live.clear()
    live.update(await asyncio.to_thread(engine.live_checksums) or {})
    return sorted(n for n in want if live.get(n) != want[n])


def xxh3_sums(local_dir: Path, sums: dict[str, str]) -> dict[str, str] | None:
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


async def announce_start(js: JetStreamContext, names: Names, engine: Engine, worker_id: str, version: int) -> None:
    """With ``verify_live``: the version a replica starts serving, with a digest of its live weights,
    announced like an activation (``at_start``), so every answer it gives is covered by one."""
    live = await asyncio.to_thread(engine.live_checksums)
    if live is None:
        return
    announcement = VersionActivated(
        worker_id=worker_id,
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
        await js.publish(names.versions_activated, encode(announcement))
