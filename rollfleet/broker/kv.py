"""Reading the fleet registry and the policy version pointer: one way, for every reader."""

from __future__ import annotations

from contextlib import suppress

import nats.js.errors
from nats.js.kv import KeyValue

from rollfleet.schemas import Names, ReplicaStatus, decode
from rollfleet.schemas.errors import InvalidRequest


async def read_latest(policy_kv: KeyValue) -> int | None:
    """The newest committed policy version (None before the first commit)."""
    try:
        entry = await policy_kv.get(Names.LATEST_KEY)
    except nats.js.errors.KeyNotFoundError:
        return None
    return int(entry.value or b"0")


async def read_replicas(fleet_kv: KeyValue) -> dict[str, ReplicaStatus]:
    """Every registry entry (live or stale), by worker id; undecodable entries are skipped."""
    try:
        keys = await fleet_kv.keys()
    except nats.js.errors.NoKeysError:
        return {}
    replicas: dict[str, ReplicaStatus] = {}
    for key in keys:
        with suppress(nats.js.errors.KeyNotFoundError, InvalidRequest):
            entry = await fleet_kv.get(key)
            if entry.value:
                status = decode(entry.value, ReplicaStatus, what="replica status")
                replicas[status.worker_id] = status
    return replicas
