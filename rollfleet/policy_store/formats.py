"""Registries of what a publication may declare: delta encodings, compression, checksums.

Anything not listed here is rejected with :class:`UnsupportedFormat` before a byte is applied.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import blake3
import xxhash

from rollfleet.policy_store.layout import raw_bytes
from rollfleet.schemas.errors import UnsupportedFormat

# Encodings miles and every SGLang puller understand; SGLang's newer byte-sparse XOR (its newest
# puller reads it, older ones and miles do not); then ours. Foreign readers reject unknown names,
# which is exactly what we want for "rf-sparse-xor".
XOR = "xor"
OVERWRITE = "overwrite"
XOR_SPARSE = "xor_sparse"
SPARSE_XOR = "rf-sparse-xor"
COMPATIBLE_ENCODINGS = (XOR, OVERWRITE)
DELTA_ENCODINGS = (XOR, OVERWRITE, XOR_SPARSE, SPARSE_XOR)

ZSTD = "zstd"
COMPRESSION_FORMATS = (ZSTD,)

DEFAULT_CHECKSUM = "xxh3-128"


class Hasher(Protocol):
    def update(self, data: object, /) -> object: ...
    def hexdigest(self) -> str: ...


class _Adler32:
    """zlib's adler32 behind the hashlib-style interface (hex is the 8-digit big-endian value)."""

    def __init__(self) -> None:
        self._value = 1

    def update(self, data: object, /) -> None:
        self._value = zlib.adler32(data, self._value)  # type: ignore[arg-type]

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


_CHECKSUMS = {
    "xxh3-128": xxhash.xxh3_128,
    "blake3": blake3.blake3,
    "adler32": _Adler32,
}
CHECKSUM_FORMATS = tuple(_CHECKSUMS)
_HEX_LEN = {"xxh3-128": 32, "blake3": 64, "adler32": 8}


def check_checksum_format(fmt: object) -> str:
    if fmt not in _CHECKSUMS:
        raise UnsupportedFormat(f"unknown checksum format {fmt!r}; known: {', '.join(CHECKSUM_FORMATS)}")
    return fmt  # type: ignore[return-value]


def check_encoding(encoding: object) -> str:
    if encoding not in DELTA_ENCODINGS:
        raise UnsupportedFormat(f"unknown delta encoding {encoding!r}; known: {', '.join(DELTA_ENCODINGS)}")
    return encoding  # type: ignore[return-value]


def check_compression(fmt: object) -> str:
    if fmt not in COMPRESSION_FORMATS:
        raise UnsupportedFormat(f"unknown compression format {fmt!r}; known: {', '.join(COMPRESSION_FORMATS)}")
    return fmt  # type: ignore[return-value]


def new_hasher(fmt: str = DEFAULT_CHECKSUM) -> Hasher:
    return _CHECKSUMS[check_checksum_format(fmt)]()


def valid_checksum(fmt: str, value: object) -> bool:
    """Whether ``value`` is a well-formed hex digest for ``fmt`` (case-insensitive)."""
    if not isinstance(value, str) or len(value) != _HEX_LEN[fmt]:
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return True


CHUNK = 4 << 20  # hashing in chunks keeps each GIL-free stretch long but bounded


def tensor_checksum(data: object, fmt: str = DEFAULT_CHECKSUM) -> str:
    """Hex checksum of a tensor's raw bytes: bytes, a numpy array, or a torch tensor (any device).

    This is the value published in each shard's ``__metadata__``; compare it with a live
    parameter to check that an engine holds exactly the trainer's bytes.
    """
    hasher = new_hasher(fmt)
    buf = memoryview(raw_bytes(data)).cast("B")
    for start in range(0, len(buf), CHUNK):
        hasher.update(buf[start : start + CHUNK])
    if len(buf) == 0:
        hasher.update(b"")
    return hasher.hexdigest()
