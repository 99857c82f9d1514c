"""The store directory: which versions exist and what each one is, read from the files alone.

A version exists when ``<store>/weight_vNNNNNN/model.safetensors.index.json`` exists (the index is
written last and the directory appears by one rename, so this is the commit boundary). As in
SGLang's puller, a plain checkpoint directory is a full version too: one with an ordinary HF
index (no version metadata), or with no index at all (its safetensors files are the version).
Each version we write also carries ``rollfleet.json`` (its VersionRecord, plus per-tensor
checksums for full versions); it is optional, so foreign versions read just as well. Every file
is read through ``files`` (regular files inside the store only).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec

from rollfleet.policy_store.files import check_dir, check_file, read_file
from rollfleet.policy_store.layout import read_header
from rollfleet.schemas.errors import CorruptArtifact, PolicyError, VersionNotFound
from rollfleet.schemas.index import INDEX_FILE, MAX_INDEX_BYTES, IndexMetadata, PublicationIndex, json_object
from rollfleet.schemas.messages import VersionRecord

SIDECAR = "rollfleet.json"
MAX_SIDECAR_BYTES = 256 << 20  # per-tensor checksums of a few hundred thousand tensors
_DIR = re.compile(r"^weight_v([0-9]{6,12})$")
_SHARD_SUFFIX = ".safetensors"


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def version_path(store: Path, version: int) -> Path:
    return Path(store) / version_dir_name(version)


def dir_version(name: str) -> int | None:
    """The version a directory name stands for (``weight_v000007`` -> 7), else None."""
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


def list_versions(store: Path) -> list[int]:
    """Committed version numbers in ``store``, ascending (temporary and trash dirs are hidden)."""
    try:
        names = os.listdir(store)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        v = dir_version(name)
        if v is not None and _is_published(Path(store) / name):
            out.append(v)
    return sorted(out)


def _is_published(path: Path) -> bool:
    if (path / INDEX_FILE).is_file():
        return True
    try:
        return any(n.endswith(_SHARD_SUFFIX) and not n.startswith(".") for n in os.listdir(path))
    except (NotADirectoryError, FileNotFoundError):
        return False


def plain_shards(path: Path) -> list[str]:
    """The safetensors files of a directory without an index (hidden files aside), checked."""
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(_SHARD_SUFFIX) and not n.startswith("."))
    except FileNotFoundError:
        return []
    for name in names:
        check_file(Path(path) / name, Path(path).parent)
    return names


def read_index(path: Path) -> PublicationIndex:
    """A version directory's index: ours (or miles'), a plain HF index (a full version numbered by
    its directory), or, with no index file, one built from the safetensors headers."""
    path = Path(path)
    root = path.parent
    if not check_dir(path, root):
        raise VersionNotFound(f"{path.name} is not in {root}")
    number = dir_version(path.name)
    raw = read_file(path / INDEX_FILE, root, MAX_INDEX_BYTES)
    if raw is not None:
        return PublicationIndex.parse(raw, default_version=number)
    shards = plain_shards(path)
    if not shards or number is None:
        raise VersionNotFound(f"{path.name}: no {INDEX_FILE} and no safetensors files")
    weight_map: dict[str, str] = {}
    for shard in shards:
        for name in read_header(path / shard).tensors:
            if name in weight_map:
                raise CorruptArtifact(f"{path.name}: tensor {name!r} appears in two shards")
            weight_map[name] = shard
    return PublicationIndex(IndexMetadata(version=number), weight_map)


def read_sidecar(path: Path) -> dict[str, Any]:
    """Our sidecar, or {} when absent (foreign version) or unreadable."""
    try:
        return read_sidecar_strict(path) or {}
    except (OSError, PolicyError):
        return {}


def read_sidecar_strict(path: Path) -> dict[str, Any] | None:
    """Our sidecar; None when absent; CorruptArtifact when present but unreadable."""
    raw = read_file(Path(path) / SIDECAR, Path(path).parent, MAX_SIDECAR_BYTES)
    return None if raw is None else json_object(raw, f"{Path(path).name}/{SIDECAR}", MAX_SIDECAR_BYTES)


def record_from_index(path: Path, index: PublicationIndex, sidecar: dict[str, Any] | None = None) -> VersionRecord:
    """A VersionRecord: identity from the index (authoritative), statistics from the sidecar."""
    meta = index.metadata
    kind = "delta" if meta.is_delta else ("base" if meta.version == 0 else "full")
    stats: dict[str, Any] = {}
    side = (sidecar or {}).get("record")
    if isinstance(side, dict) and side.get("version") == meta.version:
        try:
            rec = msgspec.convert(side, VersionRecord)
            stats = {
                k: getattr(rec, k)
                for k in ("changed_bytes", "total_bytes", "density", "wire_bytes", "seconds", "created_at", "publisher")
            }
        except msgspec.ValidationError:
            stats = {}
    if not stats.get("wire_bytes"):
        stats["wire_bytes"] = _shard_bytes(path, index)
    return VersionRecord(
        version=meta.version,
        kind=kind,
        base_version=meta.base_version,
        encoding=meta.delta_encoding,
        checksum_format=meta.checksum_format,
        path=Path(path).name,
        **stats,
    )


def _shard_bytes(path: Path, index: PublicationIndex) -> int:
    total = 0
    for shard in index.shards:
        try:
            total += (Path(path) / shard).stat().st_size
        except OSError:
            pass
    return total


def read_record(store: Path, version: int) -> VersionRecord:
    """The VersionRecord of one committed version, from its directory alone."""
    path = version_path(store, version)
    index = read_index(path)
    if index.metadata.version != version:
        raise CorruptArtifact(f"{path.name}: index says version {index.metadata.version}")
    return record_from_index(path, index, read_sidecar(path))


def list_records(store: Path) -> list[VersionRecord]:
    """Every committed version's record, ascending; unreadable versions are skipped."""
    out = []
    for v in list_versions(store):
        try:
            out.append(read_record(store, v))
        except PolicyError:  # a hostile or corrupt foreign version is not listed as usable
            continue
    return out
