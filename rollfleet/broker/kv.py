"""The two KV buckets every side reads: the fleet registry and the policy version pointer.

One reader for each, and the one writer of the commit boundary (``advance_latest``).
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from rollfleet.runtime import faults
from rollfleet.schemas import Names, ReplicaStatus, VersionRecord, decode, encode
from rollfleet.schemas.errors import InvalidRequest, VersionConflict


async def read_latest(policy_kv: KeyValue) -> int | None:
    """The newest committed policy version (None before the first commit)."""
    try:
        entry = await policy_kv.get(Names.LATEST_KEY)
    except nats.js.errors.KeyNotFoundError:
        return None
    return int(entry.value or b"0")


_SNAPSHOT_QUIET_S = 0.05


async def read_replicas(fleet_kv: KeyValue, timeout: float = 10.0) -> dict[str, ReplicaStatus]:
    """Every registry entry (live or stale), by worker id; undecodable entries are skipped.

    One snapshot: a watcher delivers the newest value of every key and stops (one consumer
    created on the broker), instead of listing the keys and reading each one."""
    watcher = await fleet_kv.watch(Names.REPLICA_KEYS, ignore_deletes=True)
    replicas: dict[str, ReplicaStatus] = {}

    def take(entry: Any) -> None:
        if entry.value:
            with suppress(InvalidRequest):
                status = decode(entry.value, ReplicaStatus, what="replica status")
                replicas[status.worker_id] = status

    try:
        while (entry := await watcher.updates(timeout=timeout)) is not None:
            take(entry)
        # nats-py may say the initial values are over while some are still on their way (it sees
        # the consumer's pending count already 0 before its callback has taken them): what
        # arrives within a short quiet period belongs to the snapshot too.
        while True:
            try:
                entry = await watcher.updates(timeout=_SNAPSHOT_QUIET_S)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            if entry is not None:
                take(entry)
    finally:
        with suppress(Exception):
            await watcher.stop()
    return replicas


async def advance_latest(policy_kv: KeyValue, names: Names, record: VersionRecord) -> VersionRecord:
    """The commit boundary: create ``v.<N>`` (fails if another publisher got there first), then
    compare-and-set ``latest`` to N (fails if ``latest`` is already N or newer)."""
    try:
        revision = await policy_kv.create(names.version_key(record.version), encode(record))
    except nats.js.errors.KeyWrongLastSequenceError as exc:
        raise VersionConflict(f"version {record.version} was already committed by another publisher") from exc
    faults.point("commit:before-cas")
    await move_latest(policy_kv, names, record.version)
    return await mark_committed(policy_kv, names, record, revision)


async def mark_committed(policy_kv: KeyValue, names: Names, record: VersionRecord, revision: int) -> VersionRecord:
    """Say in ``v.<N>`` that ``latest`` reached N (after the compare-and-set); the record so
    marked. Lost (a publisher killed first), the version is only never a fallback: ``latest``
    itself says it is committed."""
    marked = msgspec.structs.replace(record, committed=True)
    try:
        await policy_kv.update(names.version_key(record.version), encode(marked), last=revision)
    except nats.js.errors.KeyWrongLastSequenceError:
        pass  # (marked already, by the same publisher finishing its commit)
    return marked


async def move_latest(policy_kv: KeyValue, names: Names, version: int) -> None:
    """Compare-and-set ``latest`` to ``version``; VersionConflict if it is already there or newer."""
    value = str(version).encode()
    for _ in range(50):  # retry only the race of two CAS attempts; a newer latest is a conflict
        try:
            entry = await policy_kv.get(names.LATEST_KEY)
        except nats.js.errors.KeyNotFoundError:
            try:
                await policy_kv.create(names.LATEST_KEY, value)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        current = int(entry.value or b"0")
        if current >= version:
            raise VersionConflict(f"latest is already {current}; cannot commit {version}")
        try:
            await policy_kv.update(names.LATEST_KEY, value, last=entry.revision)
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            await asyncio.sleep(0.01)
    raise VersionConflict(f"could not move latest to {version}: too much contention")
