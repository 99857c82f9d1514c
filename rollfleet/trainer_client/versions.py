"""Committing policy versions to the policy KV: the one commit boundary every replica follows.

Vocabulary: a version is *written* (its directory appears atomically in the store, by
``policy_store.writer``), then *committed* (``broker.kv.advance_latest``: create ``v.<N>``,
compare-and-set ``latest``), then *announced* on ``versions.published``. Publishing is all three.

A client that commits (``VersionCommits``, behind ``RolloutClient.commit_version`` and its
siblings) declares the version's job consumers before replicas hear of it, and tells its own
fleet view at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollfleet.broker.buckets import open_bucket
from rollfleet.broker.kv import advance_latest, mark_committed, move_latest, read_latest
from rollfleet.broker.types import JetStreamContext
from rollfleet.policy_store import verify_version_dir
from rollfleet.policy_store.store import version_dir_name
from rollfleet.runtime import faults
from rollfleet.schemas import Names, VersionPublished, VersionRecord, decode, encode
from rollfleet.schemas.errors import CorruptArtifact, HostileName, VersionConflict
from rollfleet.trainer_client.fleet import FleetView


async def commit_version(js: JetStreamContext, names: Names, record: VersionRecord) -> VersionRecord:
    """Make a written version visible to the fleet: the KV commit, then the announcement; the
    record as committed."""
    record = await advance_latest(await js.key_value(names.policy_bucket), names, record)
    faults.point("commit:before-announce")
    await js.publish(names.versions_published, encode(VersionPublished(record=record)))
    return record


async def commit_or_finish(js: JetStreamContext, names: Names, record: VersionRecord) -> bool:
    """Commit ``record``, or finish a commit of the same version by the same publisher that was
    interrupted (``v.<N>`` created, ``latest`` not yet moved, nothing announced). False when it
    was already complete; VersionConflict when another publisher holds N."""
    try:
        await commit_version(js, names, record)
        return True
    except VersionConflict:
        bucket = await open_bucket(js, names.policy_bucket)
        entry = await bucket.read(names.version_key(record.version))
        if entry is None:
            raise VersionConflict(f"latest is already past version {record.version}") from None
        kv = bucket.kv
        held = decode(entry.value or b"", VersionRecord, what="version record")
        if (held.publisher, held.path) != (record.publisher, record.path):
            raise
        latest = await read_latest(kv)
        if latest is not None and latest >= record.version:
            return False
        await move_latest(kv, names, record.version)
        held = await mark_committed(kv, names, held, entry.revision)
        await js.publish(names.versions_published, encode(VersionPublished(record=held)))
        return True


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
    return await commit_version(js, names, record)


class VersionCommits:
    """A client's commits of policy versions (``RolloutClient.publish_policy``, ``commit_version``,
    ``adopt_version``)."""

    def __init__(
        self, js: JetStreamContext, names: Names, fleet: FleetView, declare: Callable[[int], Awaitable[None]]
    ) -> None:
        self.js, self.names, self.fleet = js, names, fleet
        self._declare = declare  # a version's job consumers

    async def publish(self, publisher: Any, named_tensors: Any) -> VersionRecord:
        """Write the next version with a ``PolicyPublisher`` (in a thread) and commit it."""
        record = await asyncio.to_thread(publisher.publish, named_tensors)
        return await self.commit(record)

    async def commit(self, record: VersionRecord) -> VersionRecord:
        """Make a written version visible to the fleet (create ``v.<N>``, CAS ``latest``, announce)."""
        await self._declare(record.version)  # before replicas hear of it
        record = await commit_version(self.js, self.names, record)
        self.fleet.note_committed(record.version)
        return record

    async def adopt(self, store_dir: str | Path, version_dir: str | Path) -> VersionRecord:
        """Verify and commit a version directory written by another publisher, without re-encoding."""
        record = await adopt_version(self.js, self.names, Path(store_dir), Path(version_dir))
        self.fleet.note_committed(record.version)
        await self._declare(record.version)  # (adopt verifies, then commits)
        return record
