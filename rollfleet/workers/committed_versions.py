"""Which versions below the newest a replica may fall back to: those the store holds whose record
in the policy bucket (``v.<N>``) says they were committed.

A directory alone is not a version: a publisher killed before its commit leaves a complete one
that the fleet must never serve (``following.fallback_versions``). Only the few versions asked
about are looked up, a record read per version, never the whole store.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rollfleet.broker.buckets import KVBucket
from rollfleet.broker.types import KeyValue
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.store import list_versions
from rollfleet.schemas import Names, VersionRecord, decode
from rollfleet.schemas.errors import PolicyError, RollfleetError
from rollfleet.workers.version_following import fallback_versions


async def is_committed(kv: KeyValue, names: Names, version: int) -> bool:
    """Whether ``v.<version>`` says the version was committed (unknown, unreadable: no)."""
    try:
        entry = await KVBucket(kv).get(names.version_key(version))
        return decode(entry.value or b"", VersionRecord, what="version record").committed
    except RollfleetError:  # (the broker's errors are ones)
        return False


async def older_committed(
    store: Path | Bucket, kv: KeyValue, names: Names, latest: int, log: Any, above: int = -1
) -> list[int]:
    """The versions below ``latest`` (and above ``above``) a replica may fall back to, newest
    first. Only those are looked up in the broker: a record read per version, so a serving
    replica asks of the few between its own version and the newest, not of the whole store."""
    try:
        if isinstance(store, Bucket):
            present = await asyncio.to_thread(store.versions)
        else:
            present = await asyncio.to_thread(list_versions, store)
    except (PolicyError, OSError) as exc:
        log.error("listing the store failed", error=str(exc))
        present = []
    committed = [v for v in present if above < v < latest and await is_committed(kv, names, v)]
    return fallback_versions(present, latest, committed)
