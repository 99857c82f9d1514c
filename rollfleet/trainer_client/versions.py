"""Committing policy versions to the policy KV: the one commit boundary every replica follows.

A version is committed by creating ``v.<N>`` (fails if another publisher got there first),
then compare-and-set of ``latest`` (fails if ``latest`` moved meanwhile), then announcing it
on ``versions.published``. Files are already complete and atomically visible by then.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.js.errors
from nats.js import JetStreamContext

from rollfleet.policy_store import verify_version_dir
from rollfleet.policy_store.store import version_dir_name
from rollfleet.schemas import Names, VersionPublished, VersionRecord, encode
from rollfleet.schemas.errors import CorruptArtifact, HostileName, VersionConflict


async def commit_version(js: JetStreamContext, names: Names, record: VersionRecord) -> None:
    kv = await js.key_value(names.policy_bucket)
    try:
        await kv.create(names.version_key(record.version), encode(record))
    except nats.js.errors.KeyWrongLastSequenceError as exc:
        raise VersionConflict(f"version {record.version} was already committed by another publisher") from exc
    value = str(record.version).encode()
    for _ in range(50):  # retry only the race of two CAS attempts; a newer latest is a conflict
        try:
            entry = await kv.get(names.LATEST_KEY)
        except nats.js.errors.KeyNotFoundError:
            try:
                await kv.create(names.LATEST_KEY, value)
                break
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        current = int(entry.value or b"0")
        if current >= record.version:
            raise VersionConflict(f"latest is already {current}; cannot commit {record.version}")
        try:
            await kv.update(names.LATEST_KEY, value, last=entry.revision)
            break
        except nats.js.errors.KeyWrongLastSequenceError:
            await asyncio.sleep(0.01)
    else:
        raise VersionConflict(f"could not move latest to {record.version}: too much contention")
    await js.publish(names.versions_published, encode(VersionPublished(record=record)))


async def adopt_version(js: JetStreamContext, names: Names, store_dir: Path, source: Path) -> VersionRecord:
    """Verify a complete ``weight_vNNNNNN/`` written by another publisher and commit it as is.

    ``source`` must already lie in ``store_dir`` (e.g. handed over by miles' post-write hook).
    """
    store_dir, source = Path(store_dir).resolve(), Path(source).resolve()
    if source.parent != store_dir:
        raise HostileName(f"{source} is not a version directory directly inside the store {store_dir}")
    record = await asyncio.to_thread(verify_version_dir, source)
    if source.name != version_dir_name(record.version):
        raise CorruptArtifact(
            f"{source.name} holds version {record.version}; expected {version_dir_name(record.version)}"
        )
    await commit_version(js, names, record)
    return record
