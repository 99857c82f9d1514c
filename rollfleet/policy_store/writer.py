"""Trainer side: write one version directory atomically.

Commit protocol: every file goes into ``<store>/.tmp-weight_vNNNNNN-<pid>-<rand>/`` and is
fsynced; the index is written last; the temporary directory is fsynced and renamed to
``weight_vNNNNNN`` (one atomic step, refused if the name exists); then the store directory is
fsynced. A writer killed at any point leaves at most a hidden ``.tmp-*`` directory, which
readers never list and :func:`clean_temporaries` removes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from rollfleet.policy_store.layout import SINGLE_FILE, TensorSpec, frame_spec, fsync_dir, write_shard
from rollfleet.policy_store.store import SIDECAR, version_dir_name
from rollfleet.runtime import faults
from rollfleet.schemas.errors import VersionConflict
from rollfleet.schemas.index import INDEX_FILE, IndexMetadata, PublicationIndex, check_name
from rollfleet.schemas.messages import VersionRecord

DEFAULT_SHARD_BYTES = 2 << 30
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_file(path: Path, fill: Callable[[object], object]) -> int:
    """Create ``path``, let ``fill`` write to it, fsync; returns the file size."""
    with open(path, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _split(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Greedy, order-preserving grouping of tensors into shards of at most ``max_bytes``."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if groups[-1] and used + size > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def write_version_dir(store: Path, version: int, fill: Callable[[Path], None]) -> Path:
    """Run ``fill(tmp_dir)`` (which must write the index last) and publish the result atomically."""
    store = Path(store)
    final = store / version_dir_name(version)
    if final.exists():
        raise VersionConflict(f"{final.name} already exists in {store}")
    tmp = store / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        fsync_dir(tmp)
        faults.point("publish:before-rename")
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise VersionConflict(f"{final.name} was committed by another publisher") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    faults.point("publish:after-rename")
    fsync_dir(store)
    return final


def _write_index_and_sidecar(tmp: Path, index: PublicationIndex, sidecar: dict[str, object]) -> None:
    write_file(tmp / SIDECAR, lambda f: f.write(json.dumps(sidecar).encode()))  # type: ignore[attr-defined]
    write_file(tmp / INDEX_FILE, lambda f: f.write(index.to_bytes()))  # type: ignore[attr-defined]


def write_delta(
    store: Path,
    meta: IndexMetadata,
    frames: Mapping[str, bytes],
    checksums: Mapping[str, str],
    record: Callable[[int], VersionRecord],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[Path, VersionRecord]:
    """Write a delta version; ``record(wire_bytes)`` builds the record kept in the sidecar and returned."""
    names = sorted(frames)
    groups = _split([(n, len(frames[n])) for n in names], max_shard_bytes) if names else [[]]
    wire = 0
    written: list[VersionRecord] = []

    def fill(tmp: Path) -> None:
        nonlocal wire
        weight_map: dict[str, str] = {}
        for i, group in enumerate(groups):
            shard = shard_name(i, len(groups))
            tensors = [(n, frame_spec(len(frames[n])), frames[n]) for n in group]
            meta_map = {n: checksums[n] for n in group}
            wire += write_file(tmp / shard, lambda f, t=tensors, m=meta_map: write_shard(f, t, m))  # type: ignore[misc]
            weight_map.update(dict.fromkeys(group, shard))
            faults.point("publish:after-shard")
        index = PublicationIndex(meta, weight_map)
        _write_index_and_sidecar(tmp, index, {"record": _record_json(_once(written, record, wire))})

    return write_version_dir(store, meta.version, fill), written[-1]


def write_full(
    store: Path,
    meta: IndexMetadata,
    specs: Mapping[str, TensorSpec],
    tensor_bytes: Callable[[str], object],
    checksums: Mapping[str, str],
    record: Callable[[int], VersionRecord],
    aux_dir: Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[Path, VersionRecord]:
    """Write a full version: an ordinary HF checkpoint directory (plus our sidecar).

    ``aux_dir``'s non-weight files (config.json, tokenizer files, ...) are copied alongside.
    """
    names = list(specs)
    groups = _split([(n, specs[n].nbytes) for n in names], max_shard_bytes)
    wire = 0
    written: list[VersionRecord] = []

    def fill(tmp: Path) -> None:
        nonlocal wire
        if aux_dir is not None:
            copy_aux_files(aux_dir, tmp)
        weight_map: dict[str, str] = {}
        for i, group in enumerate(groups):
            shard = SINGLE_FILE if len(groups) == 1 else shard_name(i, len(groups))
            tensors = [(n, specs[n], tensor_bytes(n)) for n in group]
            wire += write_file(tmp / shard, lambda f, t=tensors: write_shard(f, t, {"format": "pt"}))  # type: ignore[misc]
            weight_map.update(dict.fromkeys(group, shard))
            faults.point("publish:after-shard")
        sidecar = {"record": _record_json(_once(written, record, wire)), "checksums": dict(checksums)}
        _write_index_and_sidecar(tmp, PublicationIndex(meta, weight_map), sidecar)

    return write_version_dir(store, meta.version, fill), written[-1]


def link_full(
    store: Path,
    meta: IndexMetadata,
    source: Path,
    weight_map: Mapping[str, str],
    checksums: Mapping[str, str],
    record: Callable[[int], VersionRecord],
    provenance: Mapping[str, object] | None = None,
) -> tuple[Path, VersionRecord]:
    """Publish files that already exist as a version by hard-linking them (copies if not possible).

    A full version (an existing HF checkpoint) brings its config and tokenizer files along; a
    delta (one written by another publisher, under its own number) only its shards, with the
    index rewritten to ``meta``. ``provenance`` is kept in the sidecar.
    """
    wire = 0
    written: list[VersionRecord] = []

    def fill(tmp: Path) -> None:
        nonlocal wire
        if not meta.is_delta:
            copy_aux_files(source, tmp)
        for shard in sorted(set(weight_map.values())):
            wire += _link_or_copy(Path(source) / shard, tmp / shard)
        sidecar: dict[str, object] = {"record": _record_json(_once(written, record, wire))}
        if checksums:
            sidecar["checksums"] = dict(checksums)
        if provenance:
            sidecar["provenance"] = dict(provenance)
        _write_index_and_sidecar(tmp, PublicationIndex(meta, dict(weight_map)), sidecar)

    return write_version_dir(store, meta.version, fill), written[-1]


def _link_or_copy(src: Path, dst: Path) -> int:
    # Workers may read the store as other users (containers, other hosts). A file only its
    # owner may read (safetensors writes 0600) is copied: the copy gets the publisher's usual
    # mode, like every other file of the store, and the checkpoint's own mode is left alone.
    if os.stat(src).st_mode & stat.S_IROTH:
        try:
            os.link(src, dst)
            return dst.stat().st_size
        except OSError:
            pass
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return dst.stat().st_size


def copy_aux_files(src: Path, dst: Path) -> None:
    """Copy a checkpoint's small non-weight files (config, tokenizer, generation config)."""
    for entry in os.scandir(src):
        name = entry.name
        if not entry.is_file(follow_symlinks=False) or name.startswith("."):
            continue
        if name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name in (INDEX_FILE, SIDECAR):
            continue
        check_name(name, "checkpoint file name")
        shutil.copyfile(entry.path, dst / name)
        with open(dst / name, "rb+") as f:
            os.fsync(f.fileno())


def _once(written: list[VersionRecord], record: Callable[[int], VersionRecord], wire: int) -> VersionRecord:
    written.append(record(wire))
    return written[-1]


def _record_json(record: VersionRecord) -> dict[str, object]:
    import msgspec

    return msgspec.to_builtins(record)  # type: ignore[no-any-return]


def clean_temporaries(store: Path, older_than_s: float = 0.0) -> list[str]:
    """Remove leftovers of killed writers (``.tmp-*``) and interrupted deletions (``.trash-*``)."""
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(store))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and entry.is_dir(follow_symlinks=False):
            if now - entry.stat(follow_symlinks=False).st_mtime >= older_than_s:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
    return removed
