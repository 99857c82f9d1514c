"""The store directory: which versions exist and what each one is, read from the files alone.

A version exists when ``<store>/weight_vNNNNNN/model.safetensors.index.json`` exists (the index is
written last and the directory appears by one rename, so this is the commit boundary).
Each version we write also carries ``rollfleet.json`` (its VersionRecord, plus per-tensor
checksums for full versions); it is optional, so foreign versions read just as well.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from rollfleet.schemas.errors import CorruptArtifact, PolicyError, VersionNotFound
from rollfleet.schemas.index import INDEX_FILE, PublicationIndex
from rollfleet.schemas.messages import VersionRecord

SIDECAR = "rollfleet.json"
_DIR = re.compile(r"^weight_v([0-9]{6,12})$")


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def version_path(store: Path, version: int) -> Path:
    return Path(store) / version_dir_name(version)


def list_versions(store: Path) -> list[int]:
    """Committed version numbers in ``store``, ascending (temporary and trash dirs are hidden)."""
    try:
        names = os.listdir(store)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _DIR.match(name)
        if m and (Path(store) / name / INDEX_FILE).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def read_index(path: Path) -> PublicationIndex:
    try:
        raw = (Path(path) / INDEX_FILE).read_bytes()
    except FileNotFoundError:
        raise VersionNotFound(f"{Path(path).name}: no {INDEX_FILE}") from None
    return PublicationIndex.parse(raw)


def read_sidecar(path: Path) -> dict[str, Any]:
    """Our sidecar, or {} when absent (foreign version) or unreadable."""
    try:
        doc = json.loads((Path(path) / SIDECAR).read_bytes())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


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
