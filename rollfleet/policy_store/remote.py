"""Following a policy store that lives in an object store: plan from the bucket, download, materialize.

A replica plans its catch-up exactly as from a store directory (``plan_chain``: the delta chain
after its marker, or the newest full version at or below the target and the deltas after it for a
late joiner or a lost marker), reading only the indexes of the versions it walks. It downloads
just those versions into a cache directory (an ordinary store directory, resumable, see
``bucket``), materializes from it with every tensor verified, and then drops what it no longer
needs. A download or verification failure is a typed error that leaves the host-local checkpoint
at its last good version, so the replica keeps serving; a download that failed to apply, for any
reason, is forgotten, so the next try reads the bucket again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from rollfleet.policy_store.bucket import PARTIAL_PREFIX, Bucket, check_store
from rollfleet.policy_store.hooks import Hook
from rollfleet.policy_store.materialize import (
    DEFAULT_WORKERS,
    MaterializeResult,
    host_lock,
    materialize,
    plan_chain,
    read_marker,
)
from rollfleet.policy_store.retention import plan_retention
from rollfleet.policy_store.store import dir_version, list_versions, version_dir_name
from rollfleet.schemas.errors import PolicyError, VersionNotFound
from rollfleet.schemas.index import INDEX_FILE

CACHE_DIR = ".rollfleet-store"  # inside the host-local checkpoint unless told otherwise


def open_store(store: str | os.PathLike[str] | Bucket, **bucket_options: object) -> Path | Bucket:
    """A store directory or a ``Bucket``; an address rollfleet cannot serve raises ``UnsupportedStore``."""
    if isinstance(store, Bucket):
        return store
    checked = check_store(store)
    return checked if isinstance(checked, Path) else Bucket(checked, **bucket_options)  # type: ignore[arg-type]


def store_label(store: Path | Bucket | None) -> str | None:
    """How logs and status name a store (a URL carries no credentials: they live in the environment)."""
    if store is None:
        return None
    return store.url if isinstance(store, Bucket) else str(store)


def fetch_chain(
    bucket: Bucket,
    cache_dir: Path,
    marker: int | None,
    target: int,
    on_chunk: Callable[[int], None] | None = None,
) -> tuple[list[int], int, int]:
    """Download what reaching ``target`` from ``marker`` needs into ``cache_dir``.

    Returns (versions downloaded or already cached, bytes fetched now, bytes kept from an interrupted
    earlier attempt)."""
    listing = bucket.objects()
    published = sorted(v for v, files in listing.items() if INDEX_FILE in files)
    seed, chain = plan_chain(published, marker, target, bucket.is_full, bucket.url)
    needed = ([seed] if seed is not None else []) + chain
    fetched = resumed = 0
    for v in needed:
        _, stats = bucket.download(v, cache_dir, on_chunk, listing)
        fetched += stats.fetched
        resumed += stats.resumed
    return needed, fetched, resumed


def materialize_from(
    store: Path | Bucket,
    local_dir: Path | str,
    target: int,
    *,
    cache_dir: Path | str | None = None,
    pre_read_hook: str | Hook | None = None,
    workers: int = DEFAULT_WORKERS,
    durable: bool = False,
    on_chunk: Callable[[int], None] | None = None,
) -> MaterializeResult:
    """``materialize`` from a store directory or a bucket (downloading what the chain needs first)."""
    if not isinstance(store, Bucket):
        return materialize(local_dir, store, target, pre_read_hook=pre_read_hook, workers=workers, durable=durable)
    local = Path(local_dir)
    cache = Path(cache_dir) if cache_dir is not None else local / CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True)
    with host_lock(cache):
        marker = read_marker(local)
        for attempt in (marker, None):  # None: the marker was not trusted (a reboot): seed afresh
            needed, fetched, resumed = fetch_chain(store, cache, attempt, target, on_chunk)
            try:
                # The bucket, not the cache, is the store the local checkpoint's marker names.
                result = materialize(local, cache, target, workers=workers, durable=durable, store_id=store.url)
            except VersionNotFound:
                if attempt is None:
                    raise
                continue
            except BaseException:
                # Whatever refused it (a hostile name, a layout, a disk error), a download that
                # failed is not trusted on the next try: the bucket may have been repaired since.
                _forget(cache, needed)
                raise
            result.fetched_bytes, result.resumed_bytes = fetched, resumed
            _prune(cache, below=target + 1)
            return result
    raise VersionNotFound(f"version {target} could not be planned from {store.url}")  # pragma: no cover


def _forget(cache: Path, versions: list[int]) -> None:
    for v in versions:
        shutil.rmtree(cache / version_dir_name(v), ignore_errors=True)


def _prune(cache: Path, below: int) -> None:
    """Drop cached versions (and abandoned partial downloads) the local checkpoint has moved past."""
    for entry in os.scandir(cache):
        name = entry.name.removeprefix(PARTIAL_PREFIX)
        v = dir_version(name)
        if v is not None and v < below and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
    for v in list_versions(cache):
        if v < below:
            shutil.rmtree(cache / version_dir_name(v), ignore_errors=True)


def apply_bucket_retention(bucket: Bucket, keep_last: int) -> list[int]:
    """Retention on a bucket, as ``apply_retention`` on a directory: the same plan, then deletes
    (index first). Index-less leftovers of an upload that died, below the newest published version,
    are garbage and go too (an upload in progress is always above it)."""
    objects = bucket.objects()
    published = sorted(v for v, files in objects.items() if INDEX_FILE in files)
    kinds: dict[int, bool] = {}
    for v in published:
        try:
            kinds[v] = bucket.is_full(v)
        except PolicyError:
            kinds[v] = False  # unreadable: never an anchor
    keep = plan_retention(kinds, keep_last)
    newest = published[-1] if published else -1
    doomed = [v for v in published if v not in keep]
    doomed += [v for v in objects if v not in kinds and v < newest]
    deleted = []
    for v in sorted(doomed):
        if bucket.delete(v):
            deleted.append(v)
    return deleted
