"""The broker's store lost or rolled back, and streams or buckets deleted (the adversary's
``broker_rollback``, ``broker_wipe`` and ``delete_stream`` events).

- ``broker_rollback``: a single node losing its last writes, as a power loss does to a store
  written without fsync per message. A crash-consistent copy of the broker's store directory is
  taken ``lag_s`` seconds before the kill (SIGSTOP the broker, copy, SIGCONT: the copy is what a
  disk holds at one instant), then the broker is SIGKILLed and restarted on that copy ``down_s``
  later. Everything the broker stored after the copy is gone: jobs, answers, acks, claims, KV
  writes (a ``latest`` that goes back), consumer positions.
- ``broker_wipe``: SIGKILL, restart on an empty store (the disk replaced): every stream, consumer
  and bucket of the namespace is gone, and must be declared again by the processes that use them.
- ``delete_stream``: one of the namespace's streams or KV buckets deleted through the JetStream
  API while jobs flow (an operator's mistake, a cleanup script).

Each is recorded in ``Timeline.stores_lost`` (``kind``, ``lost_from``: the wall-clock time from
which writes were lost, ``at``: when the loss happened, ``back``, ``target``), which the oracle
reads to exempt exactly what the lost store took.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

# What ``delete_stream`` may delete: the namespace's jobs and results streams, its claims,
# policy and registry buckets (``Names`` attribute -> whether it is a KV bucket).
DELETE_TARGETS = {
    "jobs": ("jobs_stream", False),
    "results": ("results_stream", False),
    "claims": ("claims_bucket", True),
    "policy": ("policy_bucket", True),
    "registry": ("fleet_bucket", True),
}


def snapshot_store(machine: Any, dest: Path) -> float:
    """A crash-consistent copy of the broker's store directory (frozen while it is copied);
    returns the wall-clock time of the copy (writes after it are what a rollback loses)."""
    broker = machine.broker
    assert broker is not None and broker.proc is not None
    proc, t0 = broker.proc, time.time()
    machine.freezes.stop(proc)
    try:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(broker.store_dir, dest, symlinks=True)
    finally:
        machine.freezes.cont(proc)
        machine.timeline.broker_paused.append([t0, time.time()])
    return t0


async def restart_on(machine: Any, source: Path | None, down_s: float) -> tuple[float, float]:
    """SIGKILL the broker and restart it ``down_s`` later on ``source``'s copy of its store (None:
    an empty store); returns (killed, back) wall-clock times, recorded as an outage."""
    broker = machine.broker
    assert broker is not None
    t0 = time.time()
    broker.kill()  # SIGKILL: no flush, no goodbye
    store = Path(broker.store_dir)
    await asyncio.to_thread(_replace_store, store, source)
    await asyncio.sleep(down_s)
    broker.start()  # (from the event loop's thread, as restart_broker does)
    back = time.time()
    machine.timeline.broker_down.append([t0, back])
    return t0, back


def _replace_store(store: Path, source: Path | None) -> None:
    shutil.rmtree(store, ignore_errors=True)
    if source is None:
        store.mkdir(parents=True)
    else:
        shutil.copytree(source, store, symlinks=True)


async def broker_rollback(adv: Any, p: dict[str, Any]) -> bool:
    m = adv.machine
    if m.broker is None or not m.broker.alive():
        return False
    snap = adv.workdir / f"nats-snapshot-{len(m.timeline.stores_lost)}"
    taken = await asyncio.to_thread(snapshot_store, m, snap)
    adv.say("broker store copied", lag_s=p["lag_s"])
    await asyncio.sleep(p["lag_s"])
    if m.broker is None or not m.broker.alive():  # (another event has it down: the copy is moot)
        adv.say("broker rollback skipped", reason="broker not running at the kill")
        return False
    adv.say("broker SIGKILL, restart on the copy", down_s=p["down_s"])
    killed, back = await restart_on(m, snap, p["down_s"])
    m.timeline.stores_lost.append({"kind": "rollback", "lost_from": taken, "at": killed, "back": back})
    adv.say("broker back on the older store", lost_s=round(killed - taken, 2))
    return True


async def broker_wipe(adv: Any, p: dict[str, Any]) -> bool:
    m = adv.machine
    if m.broker is None or not m.broker.alive():
        return False
    adv.say("broker SIGKILL, restart on an empty store", down_s=p["down_s"])
    killed, back = await restart_on(m, None, p["down_s"])
    # Everything ever stored is lost: lost_from is the start of the run.
    m.timeline.stores_lost.append({"kind": "wipe", "lost_from": 0.0, "at": killed, "back": back})
    adv.say("broker back on an empty store")
    return True


async def delete_stream(adv: Any, p: dict[str, Any]) -> bool:
    attr, is_bucket = DELETE_TARGETS[p["which"]]
    name = getattr(adv.names, attr)
    js = adv.tap.nc.jetstream(timeout=5)
    try:
        if is_bucket:
            await js.delete_key_value(name)
        else:
            await js.delete_stream(name)
    except Exception as exc:
        adv.say("stream deletion failed", target=name, error=repr(exc)[:160])
        return False
    # (Lost: what the stream held when the deletion took effect, which is when the call returned,
    # not when it was made: a node paused meanwhile held it up 0.93 s, and the claims written
    # then were lost with it; campaign 10, seed 41.)
    done = time.time()
    adv.machine.timeline.stores_lost.append(
        {"kind": "delete_stream", "target": p["which"], "name": name, "lost_from": 0.0, "at": done, "back": done}
    )
    adv.say("stream deleted", target=p["which"], name=name)
    return True
