"""PolicyPublisher: what a training loop calls after each optimizer step to publish a policy version.

Synchronous and file-only: ``publish()`` compares the trainer's tensors with the previously
published bytes (kept on the CPU), writes ``weight_vNNNNNN/`` holding only what changed, and
returns the VersionRecord. A caller that also commits records elsewhere (the policy KV) wraps
it: ``latest_version``, ``store_dir`` and ``state`` are public, and a failed publication leaves
nothing visible.

Version 0 is the base checkpoint. The first ``publish()`` on an empty store records it as
``weight_v000000`` (hard links to the base files, copies when linking is impossible, plus
per-tensor checksums) and publishes no delta; a replica then needs nothing but the store.
On a store that already holds versions, the first call rebuilds the comparison state by
materializing the newest version, and publishes the next one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from rollfleet.policy_store import delta_codecs as codecs
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.formats import (
    COMPRESSION_FORMATS,
    DEFAULT_CHECKSUM,
    XOR,
    check_checksum_format,
    check_encoding,
    tensor_checksum,
)
from rollfleet.policy_store.hooks import Hook, resolve_hook
from rollfleet.policy_store.layout import (
    CheckpointLayout,
    TensorSpec,
    check_layout,
    raw_bytes,
    read_tensor_bytes,
    tensor_spec,
)
from rollfleet.policy_store.materialize import DEFAULT_WORKERS, checkpoint_checksums, materialize
from rollfleet.policy_store.remote import apply_bucket_retention, fetch_chain, open_store, store_label
from rollfleet.policy_store.retention import apply_retention
from rollfleet.policy_store.store import list_versions, version_dir_name
from rollfleet.policy_store.writer import DEFAULT_SHARD_BYTES, clean_temporaries, link_full, write_delta, write_full
from rollfleet.schemas.errors import LayoutMismatch, VersionConflict
from rollfleet.schemas.index import IndexMetadata, check_name
from rollfleet.schemas.messages import VersionRecord


class PolicyPublisher:
    """Publish policy versions into ``store_dir`` as miles-compatible disk deltas.

    encoding: "xor" (default; compatible), "overwrite" (compatible, idempotent) or
    "rf-sparse-xor" (ours; smaller, rejected by foreign readers). keyframe_every=K writes a full
    version every K versions (0: never). keep_last=R bounds what retention keeps (None: keep all).
    post_write_hook runs as ``hook(version_dir, record)`` after each commit.

    ``store_dir`` may be an object store URL (``s3://bucket/prefix``, ``gs://``, ``az://``):
    versions are then staged in ``staging_dir`` (default: a temporary directory) and uploaded
    before ``publish`` returns; ``store_options`` go to the object store (e.g. ``endpoint``).
    Credentials come from the environment only.
    """

    def __init__(
        self,
        store_dir: Path | str,
        base_checkpoint_dir: Path | str,
        encoding: str = XOR,
        checksum: str = DEFAULT_CHECKSUM,
        keyframe_every: int = 50,
        keep_last: int | None = 8,
        *,
        compression_level: int = 1,
        workers: int = DEFAULT_WORKERS,
        post_write_hook: str | Hook | None = None,
        publisher: str = "",
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        staging_dir: Path | str | None = None,
        store_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.encoding = check_encoding(encoding)
        self.checksum_format = check_checksum_format(checksum)
        self.compression_format = COMPRESSION_FORMATS[0]
        self.keyframe_every = max(0, int(keyframe_every))
        self.keep_last = keep_last
        self.level = compression_level
        self.workers = max(1, workers)
        self.post_write_hook = resolve_hook(post_write_hook)
        self.publisher = publisher or f"{os.uname().nodename}:{os.getpid()}"
        self.max_shard_bytes = max_shard_bytes
        store = open_store(store_dir, **dict(store_options or {}))
        # An object store is written through a local staging store: each version directory is
        # written there as on disk, then uploaded (index last) before publish() returns.
        self.bucket: Bucket | None = store if isinstance(store, Bucket) else None
        self._own_staging = self.bucket is not None and staging_dir is None
        if self.bucket is None:
            self.store_dir = Path(store)  # type: ignore[arg-type]
        elif staging_dir is None:
            self.store_dir = Path(tempfile.mkdtemp(prefix="rollfleet-publish-"))
        else:
            self.store_dir = Path(staging_dir)
        self.store = store_label(store)  # where replicas follow it from (a directory or a URL)
        self.base_dir = Path(base_checkpoint_dir)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        clean_temporaries(self.store_dir)
        self._base = CheckpointLayout.read(self.base_dir)
        self.specs: dict[str, TensorSpec] = self._base.specs
        self.total_bytes = self._base.total_bytes
        existing = self._listed()
        if self.bucket is not None:  # staged versions the bucket lacks were never published
            for v in list_versions(self.store_dir):
                if not existing or v > existing[-1]:
                    shutil.rmtree(self.store_dir / version_dir_name(v), ignore_errors=True)
        self.latest_version: int | None = existing[-1] if existing else None
        self._state: dict[str, np.ndarray] | None = None  # bytes of latest_version, per tensor
        self._checksums: dict[str, str] = {}
        self._lock = threading.Lock()

    # -- what a wrapper may read ------------------------------------------------------------

    @property
    def state(self) -> Mapping[str, np.ndarray]:
        """The bytes of the latest published version (read-only views); empty before the first call."""
        if self._state is None:
            return MappingProxyType({})
        views = {}
        for name, arr in self._state.items():
            v = arr.view()
            v.flags.writeable = False
            views[name] = v
        return MappingProxyType(views)

    @property
    def checksums(self) -> Mapping[str, str]:
        return MappingProxyType(self._checksums)

    # -- publish ------------------------------------------------------------------------------

    def publish(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> VersionRecord:
        """Publish the next version from (HF name, tensor) pairs; see the module docstring."""
        with self._lock:
            items = self._validate(named_tensors)
            if self._state is None:
                if self.latest_version is None:
                    return self._record_base()
                self._resume()
            try:
                return self._publish(items)
            except BaseException:
                self._state = None  # the comparison state may be half-updated: rebuild it from the store
                self.latest_version = (self._listed() or [None])[-1]
                raise

    def _listed(self) -> list[int]:
        return self.bucket.versions() if self.bucket is not None else list_versions(self.store_dir)

    def record_base(self) -> VersionRecord:
        """Record the base checkpoint as version 0 without passing its tensors (what the first
        ``publish`` call does, minus reading every tensor into memory first)."""
        with self._lock:
            if self.latest_version is not None:
                raise VersionConflict(f"{self.store_dir} already holds version {self.latest_version}")
            return self._record_base()

    def _validate(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        got: dict[str, TensorSpec] = {}
        for name, t in items:
            check_name(name, "tensor name")
            if name in got:
                raise LayoutMismatch(f"tensor {name!r} given twice")
            got[name] = tensor_spec(name, t)
        check_layout(self.specs, got, "published tensors vs. the base checkpoint")
        return sorted(items, key=lambda it: -self.specs[it[0]].nbytes)

    def _load_base(self) -> None:
        """Snapshot the base checkpoint's bytes (what every replica seeds from) and checksum them."""
        self._state = read_tensor_bytes(self._base)
        self._checksums = self._hash_all(self._state)

    def _hash_all(self, state: Mapping[str, np.ndarray]) -> dict[str, str]:
        pool = codecs.executor(self.workers)
        return dict(pool.map(lambda n: (n, tensor_checksum(state[n], self.checksum_format)), list(state)))

    def _record_base(self) -> VersionRecord:
        t0 = time.perf_counter()
        self._load_base()
        try:
            return self._link_base(t0)
        except BaseException:
            self._state = None
            raise

    def _link_base(self, t0: float) -> VersionRecord:
        meta = IndexMetadata(version=0, checksum_format=self.checksum_format)
        weight_map = {n: loc.file.name for n, loc in self._base.tensors.items()}
        rec = lambda wire: self._record(0, "base", None, None, self.total_bytes, wire, t0)  # noqa: E731
        path, record = link_full(self.store_dir, meta, self.base_dir, weight_map, self._checksums, rec)
        return self._after_commit(path, record)

    def _resume(self) -> None:
        """Rebuild the comparison state from the newest committed version."""
        assert self.latest_version is not None
        if self.bucket is not None:
            fetch_chain(self.bucket, self.store_dir, None, self.latest_version)
        with tempfile.TemporaryDirectory(dir=self.store_dir, prefix=".tmp-resume-") as tmp:
            materialize(tmp, self.store_dir, self.latest_version, workers=self.workers)
            layout = CheckpointLayout.read(Path(tmp))
            check_layout(self.specs, layout.specs, f"{version_dir_name(self.latest_version)} vs. the base")
            self._state = read_tensor_bytes(layout)
        self._checksums = self._hash_all(self._state)

    def _publish(self, items: list[tuple[str, Any]]) -> VersionRecord:
        t0 = time.perf_counter()
        assert self._state is not None and self.latest_version is not None
        state = self._state
        version = self.latest_version + 1
        full = self.keyframe_every > 0 and version % self.keyframe_every == 0

        def one(item: tuple[str, Any]) -> tuple[str, codecs.Encoded]:
            name, t = item
            new = raw_bytes(t)
            spec = self.specs[name]
            if full:
                return name, codecs.absorb(new, state[name], self.checksum_format)
            enc = codecs.encode(self.encoding, new, state[name], spec.itemsize, self.checksum_format, self.level)
            return name, enc

        if self.workers > 1 and len(items) > 1:
            encoded = dict(codecs.executor(self.workers).map(one, items))
        else:
            encoded = dict(map(one, items))
        changed = sum(e.changed_bytes for e in encoded.values())
        for name, e in encoded.items():
            if e.changed_bytes:
                self._checksums[name] = e.checksum
        base = self.latest_version
        if full:
            meta = IndexMetadata(version=version, base_version=base, checksum_format=self.checksum_format)
            rec = lambda wire: self._record(version, "full", base, None, changed, wire, t0)  # noqa: E731
            path, record = write_full(
                self.store_dir,
                meta,
                self.specs,
                state.__getitem__,
                self._checksums,
                rec,
                aux_dir=self.base_dir,
                max_shard_bytes=self.max_shard_bytes,
            )
        else:
            meta = IndexMetadata(
                version=version,
                base_version=base,
                delta_encoding=self.encoding,
                compression_format=self.compression_format,
                checksum_format=self.checksum_format,
            )
            frames = {n: e.frame for n, e in encoded.items() if e.frame is not None}
            sums = {n: encoded[n].checksum for n in frames}
            rec = lambda wire: self._record(version, "delta", base, self.encoding, changed, wire, t0)  # noqa: E731
            path, record = write_delta(self.store_dir, meta, frames, sums, rec, self.max_shard_bytes)
        return self._after_commit(path, record)

    def _after_commit(self, path: Path, record: VersionRecord) -> VersionRecord:
        if self.bucket is not None:
            try:
                self.bucket.upload(path)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)  # staged only: the version was not published
                raise
        self.latest_version = record.version
        if self.post_write_hook is not None:
            self.post_write_hook(path, record)
        if self.keep_last is not None:
            apply_retention(self.store_dir, self.keep_last)
            if self.bucket is not None:
                apply_bucket_retention(self.bucket, self.keep_last)
        return record

    def _record(
        self, version: int, kind: str, base: int | None, encoding: str | None, changed: int, wire: int, t0: float
    ) -> VersionRecord:
        return VersionRecord(
            version=version,
            kind=kind,  # type: ignore[arg-type]
            base_version=base,
            encoding=encoding,
            checksum_format=self.checksum_format,
            path=version_dir_name(version),
            changed_bytes=changed,
            total_bytes=self.total_bytes,
            density=changed / self.total_bytes if self.total_bytes else 0.0,
            wire_bytes=wire,
            seconds=time.perf_counter() - t0,
            created_at=time.time(),
            publisher=self.publisher,
        )

    def close(self) -> None:
        """Drop the CPU copy of the weights (and the staging store this publisher made for a bucket)."""
        self._state = None
        if self._own_staging:
            shutil.rmtree(self.store_dir, ignore_errors=True)


def publish_checkpoint(
    store_dir: Path | str,
    version: int,
    checkpoint_dir: Path | str,
    *,
    checksum: str = DEFAULT_CHECKSUM,
    publisher: str = "",
    workers: int = DEFAULT_WORKERS,
    provenance: Mapping[str, object] | None = None,
) -> VersionRecord:
    """Write an existing HF checkpoint as full version ``version`` of ``store_dir`` (the root of a
    new lineage: no base). Its files are hard-linked (copied across filesystems) with its config
    and tokenizer files, and every tensor's checksum is hashed from the files, never loaded whole."""
    t0 = time.perf_counter()
    fmt = check_checksum_format(checksum)
    layout = CheckpointLayout.read(Path(checkpoint_dir))
    sums = checkpoint_checksums(layout, fmt, max(1, workers))
    meta = IndexMetadata(version=version, checksum_format=fmt)
    weight_map = {n: loc.file.name for n, loc in layout.tensors.items()}
    total = layout.total_bytes

    def record(wire: int) -> VersionRecord:
        return VersionRecord(
            version=version,
            kind="base" if version == 0 else "full",
            checksum_format=fmt,
            path=version_dir_name(version),
            changed_bytes=total,
            total_bytes=total,
            density=1.0 if total else 0.0,
            wire_bytes=wire,
            seconds=time.perf_counter() - t0,
            created_at=time.time(),
            publisher=publisher or f"{os.uname().nodename}:{os.getpid()}",
        )

    Path(store_dir).mkdir(parents=True, exist_ok=True)
    return link_full(Path(store_dir), meta, Path(checkpoint_dir), weight_map, sums, record, provenance)[1]


__all__ = ["PolicyPublisher", "publish_checkpoint"]
