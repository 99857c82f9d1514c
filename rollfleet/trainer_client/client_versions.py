"""A client's policy versions: publishing the next one, committing one written elsewhere, and
waiting for the fleet to serve one. One of ``RolloutClient``'s parts, by what it offers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollfleet.schemas import ReplicaStatus, VersionRecord
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.versions import VersionCommits


class ClientVersions:
    fleet: FleetView
    versions: VersionCommits

    @property
    def latest_version(self) -> int | None:
        return self.fleet.latest_version

    async def publish_policy(self, publisher: Any, named_tensors: Any) -> VersionRecord:
        """Write the next version with a ``PolicyPublisher`` (in a thread) and commit it.

        The first call records the base checkpoint as version 0 and commits that.
        """
        return await self.versions.publish(publisher, named_tensors)

    async def commit_version(self, record: VersionRecord) -> VersionRecord:
        """Make a written version visible to the fleet (create ``v.<N>``, CAS ``latest``, announce)."""
        return await self.versions.commit(record)

    async def adopt_version(self, store_dir: str | Path, version_dir: str | Path) -> VersionRecord:
        """Verify and commit a version directory written by another publisher, without re-encoding."""
        return await self.versions.adopt(store_dir, version_dir)

    async def wait_for_version(
        self, version: int, *, replicas: int | None = None, fraction: float | None = None, timeout: float = 120.0
    ) -> list[ReplicaStatus]:
        """Wait until ``replicas`` (or ``fraction``, default all live) replicas serve ``version``+."""
        return await self.fleet.wait_for_version(version, replicas=replicas, fraction=fraction, timeout=timeout)
