"""Safetensors files and checkpoint layouts, read and written without loading tensor data.

We parse headers ourselves (8-byte little-endian length, JSON, data) so that a reader can
validate a foreign file strictly, locate every tensor by byte offset for in-place mmap
updates, and write shards from raw byte buffers of any dtype (numpy has no bfloat16).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from rollfleet.schemas.errors import CorruptArtifact, LayoutMismatch
from rollfleet.schemas.index import INDEX_FILE, check_name, json_object, parse_weight_map

# Every dtype the safetensors format defines, in bits per element. Encodings work on bytes, so a
# dtype only has to be sized here; sub-byte dtypes (F4, F6_*) pack elements and must end on a byte.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors reference limit
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorSpec:
    """What must agree between the base layout and every later version."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def bits(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.bits // 8

    @property
    def itemsize(self) -> int:
        """Bytes per element for element-wise encodings; sub-byte dtypes count as bytes."""
        return max(1, DTYPE_BITS[self.dtype] // 8)


@dataclass(frozen=True)
class TensorLocation:
    file: Path
    spec: TensorSpec
    offset: int  # absolute byte offset of the tensor's data in ``file``

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


@dataclass(frozen=True)
class ShardHeader:
    tensors: dict[str, tuple[TensorSpec, int, int]]  # name -> (spec, start, end) relative to data
    metadata: dict[str, str]
    data_start: int  # absolute offset of the data section
    file_size: int


def read_header(path: Path) -> ShardHeader:
    """Parse and validate a safetensors header; a truncated or inconsistent file is CorruptArtifact."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CorruptArtifact(f"{path.name}: truncated safetensors file ({size} bytes)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise CorruptArtifact(f"{path.name}: header length {hlen} does not fit a {size} byte file")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise CorruptArtifact(f"shard {path.name} is missing") from None
    doc = json_object(raw, f"{path.name}: safetensors header", MAX_HEADER_BYTES)
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptArtifact(f"{path.name}: __metadata__ must map strings to strings")
    data_start = 8 + hlen
    tensors: dict[str, tuple[TensorSpec, int, int]] = {}
    for name, entry in doc.items():
        check_name(name, f"tensor name in {path.name}")
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptArtifact(f"{path.name}: malformed entry for {name!r}") from None
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise CorruptArtifact(f"{path.name}: unknown dtype {dtype!r} for {name!r}")
        ints = (*shape, start, end)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints):
            raise CorruptArtifact(f"{path.name}: bad shape or offsets for {name!r}")
        spec = TensorSpec(dtype, shape)
        if spec.bits % 8:
            raise CorruptArtifact(f"{path.name}: {name!r} is {spec.bits} bits of {dtype}, not a whole number of bytes")
        if end - start != spec.nbytes:
            raise CorruptArtifact(f"{path.name}: {name!r} spans {end - start} bytes, its shape needs {spec.nbytes}")
        if data_start + end > size:
            raise CorruptArtifact(f"{path.name}: truncated: {name!r} ends past the end of the file")
        tensors[name] = (spec, start, end)
    return ShardHeader(tensors, meta, data_start, size)


def header_bytes(entries: Iterable[tuple[str, TensorSpec, int]], metadata: Mapping[str, str]) -> bytes:
    """A safetensors header for tensors laid out back to back, in the given order."""
    doc: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, spec, nbytes in entries:
        doc[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data section to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def write_shard(
    f: BinaryIO, tensors: Iterable[tuple[str, TensorSpec, object]], metadata: Mapping[str, str] | None = None
) -> int:
    """Write one safetensors file from (name, spec, bytes-like) triples; returns bytes written."""
    items = [(name, spec, memoryview(buf).cast("B")) for name, spec, buf in tensors]  # type: ignore[arg-type]
    head = header_bytes(((n, s, len(b)) for n, s, b in items), metadata or {})
    f.write(head)
    total = len(head)
    for _, _, buf in items:
        f.write(buf)
        total += len(buf)
    return total


def frame_spec(nbytes: int) -> TensorSpec:
    """Delta shards hold each changed tensor as a 1-D uint8 tensor (one zstd frame)."""
    return TensorSpec("U8", (nbytes,))


@dataclass(frozen=True)
class CheckpointLayout:
    """Where every tensor of an ordinary HF checkpoint directory lives."""

    root: Path
    tensors: dict[str, TensorLocation]
    files: tuple[str, ...]  # shard file names

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {name: loc.spec for name, loc in self.tensors.items()}

    @property
    def total_bytes(self) -> int:
        return sum(loc.nbytes for loc in self.tensors.values())

    @classmethod
    def read(cls, root: Path) -> CheckpointLayout:
        root = Path(root)
        index_path = root / INDEX_FILE
        if index_path.exists():
            weight_map = parse_weight_map(index_path.read_bytes())
            files = tuple(sorted(set(weight_map.values())))
            wanted: dict[str, set[str]] = {}
            for name, shard in weight_map.items():
                wanted.setdefault(shard, set()).add(name)
        else:  # a plain checkpoint without an index: its safetensors files are the checkpoint
            try:
                names = os.listdir(root)
            except (FileNotFoundError, NotADirectoryError):
                raise CorruptArtifact(f"{root}: no such checkpoint directory") from None
            files = tuple(sorted(n for n in names if n.endswith(".safetensors") and not n.startswith(".")))
            wanted = {}
            if not files:
                raise CorruptArtifact(f"{root}: no {INDEX_FILE} and no safetensors files")
        tensors: dict[str, TensorLocation] = {}
        for shard in files:
            header = read_header(root / shard)
            if shard in wanted and set(header.tensors) != wanted[shard]:
                raise CorruptArtifact(f"{root.name}/{shard}: tensors differ from the index weight_map")
            for name, (spec, start, _) in header.tensors.items():
                if name in tensors:
                    raise CorruptArtifact(f"{root.name}: tensor {name!r} appears in two shards")
                tensors[name] = TensorLocation(root / shard, spec, header.data_start + start)
        return cls(root, tensors, files)


# In-memory dtype names (numpy, torch) -> safetensors dtypes.
_NUMPY_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",  # ml_dtypes, when installed
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "float4_e2m1fn_x2": "F4",  # two values per element: safetensors counts 4-bit values
}
_PACKED = {"float4_e2m1fn_x2": 2}  # values per in-memory element, along the last dimension


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_spec(name: str, t: Any) -> TensorSpec:
    """dtype and shape of a torch tensor or numpy array, in safetensors terms (no data is read)."""
    if isinstance(t, np.ndarray):
        kind = t.dtype.name
    elif hasattr(t, "dtype") and hasattr(t, "shape") and type(t).__module__.startswith("torch"):
        kind = _torch_dtype_name(t)
    else:
        raise LayoutMismatch(f"{name!r}: expected a torch tensor or numpy array, got {type(t).__name__}")
    dtype = _NUMPY_DTYPES.get(kind)
    if dtype is None:
        raise LayoutMismatch(f"{name!r}: unsupported dtype {t.dtype}")
    shape = [int(d) for d in t.shape]
    if kind in _PACKED:
        shape = [*shape[:-1], (shape[-1] if shape else 1) * _PACKED[kind]]
    return TensorSpec(dtype, tuple(shape))


def raw_bytes(t: Any) -> np.ndarray:
    """A 1-D uint8 view (or CPU copy, for device tensors) of a tensor's bytes: a numpy array, a
    torch tensor on any device, or a bytes-like object."""
    if isinstance(t, bytes | bytearray | memoryview):
        return np.frombuffer(t, np.uint8)
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def check_layout(expected: Mapping[str, TensorSpec], got: Mapping[str, TensorSpec], what: str) -> None:
    """Names, dtypes and shapes must agree exactly; the message names the first differences."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise LayoutMismatch(f"{what}: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}")
    for name, spec in expected.items():
        if got[name] != spec:
            raise LayoutMismatch(f"{what}: {name!r} is {got[name]}, the base layout has {spec}")


def read_tensor_bytes(layout: CheckpointLayout) -> dict[str, np.ndarray]:
    """Every tensor's bytes of a checkpoint, read into memory (one uint8 array each)."""
    out: dict[str, np.ndarray] = {}
    for name, loc in layout.tensors.items():
        arr = np.empty(loc.nbytes, np.uint8)
        with open(loc.file, "rb") as f:
            f.seek(loc.offset)
            f.readinto(memoryview(arr))
        out[name] = arr
    return out


def raw_view(path: Path, loc: TensorLocation) -> np.ndarray:
    """Read-only memory map of one tensor's bytes."""
    return np.memmap(path, dtype=np.uint8, mode="r", offset=loc.offset, shape=(loc.nbytes,))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
