"""Replica side: open a version directory and check its structure before touching anything.

:func:`open_version` performs every check that needs no local state: the index parses and
its names are safe, formats are known, every shard is present and untruncated, shard tensors
equal the weight_map, delta tensors are 1-D uint8 frames with a well-formed checksum.
:func:`check_delta_against` then checks it against the local layout (names exist, frame
headers within the tensor's size). :func:`verify_version_dir` adds a full decode of every
frame and is how a version written by another publisher (e.g. miles) is adopted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard as zstd

from rollfleet.policy_store import delta_codecs as codecs
from rollfleet.policy_store.files import check_file
from rollfleet.policy_store.formats import (
    XOR,
    check_checksum_format,
    check_compression,
    check_encoding,
    valid_checksum,
)
from rollfleet.policy_store.layout import CheckpointLayout, TensorSpec, read_header
from rollfleet.policy_store.store import SIDECAR, read_index, read_sidecar, read_sidecar_strict, record_from_index
from rollfleet.schemas.errors import CorruptArtifact, DecompressionBomb, LayoutMismatch
from rollfleet.schemas.index import PublicationIndex
from rollfleet.schemas.messages import VersionRecord


@dataclass(frozen=True)
class Frame:
    shard: Path
    offset: int  # absolute offset of the frame in the shard
    length: int
    checksum: str
    data: np.ndarray  # the whole shard, memory-mapped read-only (shared by its frames)

    def view(self) -> np.ndarray:
        return self.data[self.offset : self.offset + self.length]


@dataclass
class OpenVersion:
    path: Path
    index: PublicationIndex
    frames: dict[str, Frame] = field(default_factory=dict)  # delta versions
    layout: CheckpointLayout | None = None  # full versions
    checksums: dict[str, str] = field(default_factory=dict)  # full versions, when known

    @property
    def version(self) -> int:
        return self.index.metadata.version

    @property
    def is_delta(self) -> bool:
        return self.index.metadata.is_delta

    @property
    def wire_bytes(self) -> int:
        return sum((self.path / s).stat().st_size for s in self.index.shards)

    def record(self) -> VersionRecord:
        return record_from_index(self.path, self.index, read_sidecar(self.path))


def open_version(path: Path, expected_version: int | None = None) -> OpenVersion:
    path = Path(path)
    index = read_index(path)
    meta = index.metadata
    if expected_version is not None and meta.version != expected_version:
        raise CorruptArtifact(f"{path.name}: index says version {meta.version}, expected {expected_version}")
    for name in (*index.shards, SIDECAR):  # before any read: no FIFO, device or symlink out of the store
        if not check_file(path / name, path.parent) and name != SIDECAR:
            raise CorruptArtifact(f"{path.name}: shard {name} is missing")
    if not meta.is_delta:
        return _open_full(path, index)
    check_encoding(meta.delta_encoding)
    check_compression(meta.compression_format)
    fmt = check_checksum_format(meta.checksum_format)
    ov = OpenVersion(path, index)
    wanted: dict[str, set[str]] = {}
    for name, shard in index.weight_map.items():
        wanted.setdefault(shard, set()).add(name)
    for shard, names in wanted.items():
        header = read_header(path / shard)
        data = np.memmap(path / shard, dtype=np.uint8, mode="r")
        if set(header.tensors) != names:
            extra = sorted(set(header.tensors) - names)[:5]
            missing = sorted(names - set(header.tensors))[:5]
            raise CorruptArtifact(
                f"{path.name}/{shard}: tensors differ from the index (extra {extra}, missing {missing})"
            )
        for name, (spec, start, end) in header.tensors.items():
            if spec.dtype != "U8" or len(spec.shape) != 1:
                raise CorruptArtifact(f"{path.name}: delta tensor {name!r} is {spec}, not a 1-D uint8 frame")
            checksum = header.metadata.get(name)
            if not valid_checksum(fmt, checksum):
                raise CorruptArtifact(f"{path.name}: {name!r} has no valid {fmt} checksum in __metadata__")
            offset = header.data_start + start
            ov.frames[name] = Frame(path / shard, offset, end - start, checksum.lower(), data)  # type: ignore[union-attr]
    return ov


def _open_full(path: Path, index: PublicationIndex) -> OpenVersion:
    layout = CheckpointLayout.read(path)
    if set(layout.tensors) != set(index.weight_map):
        raise CorruptArtifact(f"{path.name}: shard tensors differ from the index weight_map")
    declared = index.metadata.checksum_format
    if declared is None:
        return OpenVersion(path, index, layout=layout)  # a plain checkpoint: verified by structure, as SGLang does
    # A declared checksum format is a promise: checksums that cannot be read refuse the version.
    fmt = check_checksum_format(declared)
    side = read_sidecar_strict(path) or {}
    sums = side.get("checksums")
    if not isinstance(sums, dict):
        raise CorruptArtifact(f"{path.name} declares {fmt} checksums, but {SIDECAR} holds none")
    if set(sums) != set(layout.tensors):
        missing = sorted(set(layout.tensors) - set(sums))[:5]
        raise CorruptArtifact(f"{path.name}: {SIDECAR} checksums do not cover its tensors (missing {missing})")
    if not all(valid_checksum(fmt, v) for v in sums.values()):
        raise CorruptArtifact(f"{path.name}: malformed {fmt} checksums in {SIDECAR}")
    return OpenVersion(path, index, layout=layout, checksums={k: v.lower() for k, v in sums.items()})


def check_delta_against(ov: OpenVersion, specs: Mapping[str, TensorSpec]) -> None:
    """Every changed tensor exists locally, and no frame header declares more than it may hold."""
    enc = ov.index.metadata.delta_encoding or XOR
    unknown = sorted(set(ov.frames) - set(specs))
    if unknown:
        raise LayoutMismatch(f"{ov.path.name}: tensors not in the local layout: {unknown[:5]}")
    for name, frame in ov.frames.items():
        spec = specs[name]
        cap = codecs.max_payload(enc, spec.nbytes, spec.itemsize)
        if frame.length == 0:
            raise CorruptArtifact(f"{ov.path.name}: {name!r} has an empty frame")
        head = frame.view()[: min(frame.length, 32)].tobytes()
        try:
            codecs.check_frame_header(head, cap, name)
        except CorruptArtifact:
            raise
        except zstd.ZstdError as exc:  # pragma: no cover - check_frame_header maps these
            raise CorruptArtifact(str(exc)) from None


def verify_version_dir(path: Path, specs: Mapping[str, TensorSpec] | None = None) -> VersionRecord:
    """Structurally verify a complete version directory, ours or foreign, and return its record.

    Checks the index, names, formats, shards and frames; decodes every frame within its size
    limit (from ``specs``, the base layout, when given; else the size the frame declares, which
    must then be present). Checksums of final states need the base bytes, so they are checked
    when the version is applied. Raises a typed PolicyError on the first problem.
    """
    ov = open_version(Path(path))
    if not ov.is_delta:
        if specs is not None and ov.layout is not None:
            from rollfleet.policy_store.layout import check_layout

            check_layout(specs, ov.layout.specs, ov.path.name)
        return ov.record()
    enc = ov.index.metadata.delta_encoding or XOR
    if specs is not None:
        check_delta_against(ov, specs)
    for name, frame in ov.frames.items():
        data = frame.view()
        if specs is not None:
            cap = codecs.max_payload(enc, specs[name].nbytes, specs[name].itemsize)
        else:
            declared = codecs.check_frame_header(data[:32].tobytes(), 1 << 62, name)
            if declared < 0:
                raise CorruptArtifact(f"{name}: frame does not declare its size and no layout was given")
            cap = declared
        _decode_within(data, cap, name, exact=cap if enc == XOR and specs is not None else None)
    return ov.record()


def _decode_within(frame: np.ndarray, cap: int, name: str, exact: int | None) -> None:
    reader = zstd.ZstdDecompressor().stream_reader(frame, read_across_frames=False)
    total = 0
    try:
        while True:
            part = reader.read(codecs.CHUNK)
            if not part:
                break
            total += len(part)
            if total > cap:
                raise DecompressionBomb(f"{name}: frame decompresses past {cap} bytes")
    except zstd.ZstdError as exc:
        raise CorruptArtifact(f"{name}: corrupt zstd frame ({exc})") from None
    if exact is not None and total != exact:
        raise CorruptArtifact(f"{name}: xor frame holds {total} bytes, the tensor has {exact}")
