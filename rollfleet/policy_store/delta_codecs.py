"""Delta encodings: encode a tensor's change (trainer side) and apply it in place (replica side).

Every tensor is one zstd frame with its content size in the frame header:

- ``xor``: zstd(new XOR old) over the raw bytes. Applied exactly once, to the declared base.
- ``overwrite``: zstd(u32-le count, count u32-le byte positions, count new byte values). Idempotent.
- ``xor_sparse`` (SGLang's): zstd(u64-le count, count u64-le strictly increasing byte positions,
  count XOR byte values). Applied exactly once, like ``xor``.
- ``rf-sparse-xor`` (ours): element-level sparse XOR. zstd of a 16-byte header
  (``b"RFSX"``, u8 format 1, u8 itemsize, u16 0, u64 count), then the gaps between changed
  elements as four u32 byte planes, then the XOR values as ``itemsize`` byte planes. Low
  densities leave the high planes almost all zero, which zstd erases; see benchmarks.

Work is done in L2-sized chunks with numpy, zstd and the hashes, all of which release the GIL,
so a thread pool across tensors keeps every core busy. Applying never copies a whole large
tensor: ``xor`` streams the frame through a small buffer straight into the (mmap'd) target.
Each ``apply_*`` returns an undo callable so a failed version can be rolled back exactly.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import zstandard as zstd

from rollfleet.policy_store.formats import OVERWRITE, SPARSE_XOR, XOR, XOR_SPARSE, Hasher, check_encoding, new_hasher
from rollfleet.schemas.errors import CorruptArtifact, DecompressionBomb

CHUNK = 1 << 20  # fits L2 next to zstd's window, big enough that per-call overhead vanishes
_tls = threading.local()  # per-thread zstd contexts and scratch: creating them per tensor costs ~1 ms
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def executor(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool per size, so per-thread contexts survive between versions."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="rf-policy")
        return pool


def _compressor(level: int) -> zstd.ZstdCompressor:
    cache = _tls.__dict__.setdefault("cctx", {})
    if level not in cache:
        cache[level] = zstd.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]  # type: ignore[no-any-return]


def _decompressor() -> zstd.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstd.ZstdDecompressor()
    return d


def _chunk_buffer(which: str = "a") -> np.ndarray:
    key = f"buf_{which}"
    buf = getattr(_tls, key, None)
    if buf is None:
        buf = np.empty(CHUNK, np.uint8)
        setattr(_tls, key, buf)
    return buf


_SPARSE_MAGIC = b"RFSX"
_SPARSE_HEAD = struct.Struct("<4sBBHQ")
Undo = Callable[[], None]


@dataclass
class Encoded:
    frame: bytes | None  # None: the tensor did not change
    changed_bytes: int
    checksum: str  # of the complete new bytes


# -- limits ------------------------------------------------------------------------------------


def max_payload(encoding: str, nbytes: int, itemsize: int) -> int:
    """The most bytes a valid frame for a tensor of ``nbytes`` may decompress to."""
    if encoding == XOR:
        return nbytes
    if encoding == OVERWRITE:
        return 4 + 5 * nbytes
    if encoding == XOR_SPARSE:
        return 8 + 9 * nbytes
    if encoding == SPARSE_XOR:
        return _SPARSE_HEAD.size + (nbytes // max(itemsize, 1)) * (4 + itemsize)
    check_encoding(encoding)
    raise AssertionError("unreachable")


def check_frame_header(frame: object, cap: int, name: str) -> int:
    """Read the frame's declared content size (-1 if absent) and reject bombs before decoding."""
    try:
        size = zstd.frame_content_size(frame)  # type: ignore[arg-type]
    except zstd.ZstdError as exc:
        raise CorruptArtifact(f"{name}: not a zstd frame ({exc})") from None
    if size > cap:
        raise DecompressionBomb(f"{name}: frame declares {size} bytes, the tensor allows at most {cap}")
    return size


def _bounded_decompress(frame: object, cap: int, name: str) -> bytes:
    """Decompress a whole (small) payload, refusing to produce more than ``cap`` bytes."""
    check_frame_header(frame, cap, name)
    out = bytearray()
    try:
        reader = _decompressor().stream_reader(frame, read_across_frames=False)  # type: ignore[arg-type]
        while True:
            part = reader.read(min(CHUNK, cap + 1 - len(out)) or 1)
            if not part:
                break
            out += part
            if len(out) > cap:
                raise DecompressionBomb(f"{name}: frame decompresses past {cap} bytes")
    except zstd.ZstdError as exc:
        raise CorruptArtifact(f"{name}: corrupt zstd frame ({exc})") from None
    return bytes(out)


# -- encode ------------------------------------------------------------------------------------


def encode(
    encoding: str,
    new: np.ndarray,
    old: np.ndarray,
    itemsize: int,
    checksum_format: str,
    level: int = 1,
    update_old: bool = True,
) -> Encoded:
    """Encode ``new`` against ``old`` (both 1-D uint8 of equal size); optionally copy new into old."""
    check_encoding(encoding)
    if encoding == XOR:
        return _encode_xor(new, old, checksum_format, level, update_old)
    return _encode_positions(encoding, new, old, itemsize, checksum_format, level, update_old)


def absorb(new: np.ndarray, old: np.ndarray, checksum_format: str) -> Encoded:
    """Copy ``new`` into ``old`` and count changed bytes, without encoding (for full versions)."""
    hasher = new_hasher(checksum_format)
    changed = sum(c for _, c in _xor_chunks(new, old, hasher, update_old=True))
    if new.size == 0:
        hasher.update(b"")
    return Encoded(None, changed, hasher.hexdigest())


def _xor_chunks(
    new: np.ndarray, old: np.ndarray, hasher: Hasher, *, update_old: bool
) -> Iterator[tuple[np.ndarray, int]]:
    """Chunk by chunk (L2-sized): each chunk's XOR against ``old`` (a view of one scratch buffer,
    valid until the next chunk) and its count of changed bytes; ``new`` hashed on the way, and
    ``old`` advanced to it where asked."""
    n = new.size
    scratch = _chunk_buffer()
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        x = scratch[: e - s]
        np.bitwise_xor(new[s:e], old[s:e], out=x)
        c = int(np.count_nonzero(x))
        hasher.update(new[s:e])
        if c and update_old:
            old[s:e] = new[s:e]
        yield x, c


def _encode_xor(new: np.ndarray, old: np.ndarray, fmt: str, level: int, update_old: bool) -> Encoded:
    """XOR, count, stream into one zstd frame, hash, advance the state."""
    n = new.size
    hasher = new_hasher(fmt)
    if n == 0:
        hasher.update(b"")
        return Encoded(None, 0, hasher.hexdigest())
    cobj = _compressor(level).compressobj(size=n)
    parts: list[bytes] = []
    changed = 0
    for x, c in _xor_chunks(new, old, hasher, update_old=update_old):
        changed += c
        parts.append(cobj.compress(x))
    parts.append(cobj.flush())
    return Encoded(b"".join(parts) if changed else None, changed, hasher.hexdigest())


def _encode_positions(
    encoding: str, new: np.ndarray, old: np.ndarray, itemsize: int, fmt: str, level: int, update_old: bool
) -> Encoded:
    """overwrite, xor_sparse and rf-sparse-xor: find changed positions chunk by chunk, then code them."""
    n = new.size
    unit = itemsize if encoding == SPARSE_XOR else 1
    elem = np.dtype(f"<u{unit}") if unit in (1, 2, 4, 8) else None
    if elem is None:
        raise CorruptArtifact(f"itemsize {itemsize} is not supported by {encoding}")
    if encoding != XOR_SPARSE and n // unit >= 1 << 32:
        raise CorruptArtifact(f"{encoding} positions are u32; a tensor of {n} bytes is too large")
    hasher = new_hasher(fmt)
    positions: list[np.ndarray] = []
    values: list[np.ndarray] = []
    changed = 0
    step = CHUNK - CHUNK % unit
    scratch = _chunk_buffer()
    for s in range(0, n, step):
        e = min(n, s + step)
        x = scratch[: e - s]
        np.bitwise_xor(new[s:e], old[s:e], out=x)
        changed += int(np.count_nonzero(x))
        xe = x.view(elem)
        idx = np.flatnonzero(xe != 0)  # nonzero() on a bool mask is ~5x faster than on integers
        if idx.size:
            if encoding == OVERWRITE:
                values.append(new[s:e][idx])
            else:
                values.append(xe[idx])
            positions.append(idx + s // unit)
            if update_old:
                old[s:e] = new[s:e]
        hasher.update(new[s:e])
    if n == 0:
        hasher.update(b"")
    if not changed:
        return Encoded(None, 0, hasher.hexdigest())
    pos = np.concatenate(positions)
    vals = np.concatenate(values)
    if encoding == OVERWRITE:
        payload = b"".join((struct.pack("<I", pos.size), pos.astype("<u4").tobytes(), vals.tobytes()))
    elif encoding == XOR_SPARSE:
        payload = b"".join((struct.pack("<Q", pos.size), pos.astype("<u8").tobytes(), vals.tobytes()))
    else:
        gaps = np.diff(pos, prepend=-1) - 1
        payload = b"".join(
            (
                _SPARSE_HEAD.pack(_SPARSE_MAGIC, 1, unit, 0, pos.size),
                _planes(gaps.astype("<u4")),
                _planes(vals.astype(elem, copy=False)),
            )
        )
    frame = _compressor(level).compress(payload)
    return Encoded(frame, changed, hasher.hexdigest())


def _planes(a: np.ndarray) -> bytes:
    """Byte-plane split: all low bytes, then all next bytes, ... (high planes are mostly zero)."""
    k = a.dtype.itemsize
    return np.ascontiguousarray(a.view(np.uint8).reshape(a.size, k).T).tobytes()


def _unplanes(raw: memoryview, count: int, dtype: np.dtype) -> np.ndarray:
    k = dtype.itemsize
    planes = np.frombuffer(raw, np.uint8, count * k).reshape(k, count)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(count)


# -- apply -------------------------------------------------------------------------------------


def apply(encoding: str, dst: np.ndarray, frame: object, itemsize: int, hasher: Hasher, name: str) -> Undo:
    """Apply one frame to ``dst`` (1-D writable uint8, usually an mmap slice) in place.

    Feeds ``hasher`` the final bytes. Returns a callable that restores the previous bytes.
    Raises CorruptArtifact / DecompressionBomb (with whatever was applied already undone).
    """
    check_encoding(encoding)
    if encoding == XOR:
        return _apply_xor(dst, frame, hasher, name)
    cap = max_payload(encoding, dst.size, itemsize)
    payload = memoryview(_bounded_decompress(frame, cap, name))
    if encoding == OVERWRITE:
        return _apply_overwrite(dst, payload, hasher, name)
    if encoding == XOR_SPARSE:
        return _apply_xor_sparse(dst, payload, hasher, name)
    return _apply_sparse(dst, payload, itemsize, hasher, name)


def _xor_stream(dst: np.ndarray, frame: object, limit: int, hasher: Hasher | None, name: str, done: list[int]) -> None:
    """XOR the frame's first ``limit`` decompressed bytes into ``dst``; progress kept in ``done[0]``.

    Without a hasher this is an undo, which may run on another thread or after an abandoned
    reader: it gets its own context and buffer.
    """
    dctx = _decompressor() if hasher is not None else zstd.ZstdDecompressor()
    reader = dctx.stream_reader(frame, read_across_frames=False)  # type: ignore[arg-type]
    buf = _chunk_buffer("d") if hasher is not None else np.empty(CHUNK, np.uint8)
    try:
        while done[0] < limit:
            want = min(CHUNK, limit - done[0])
            k = reader.readinto(buf[:want])
            if not k:
                raise CorruptArtifact(f"{name}: xor frame holds {done[0]} bytes, the tensor has {dst.size}")
            seg = dst[done[0] : done[0] + k]
            np.bitwise_xor(seg, buf[:k], out=seg)
            if hasher is not None:
                hasher.update(seg)
            done[0] += k
        if hasher is not None and reader.read(1):
            raise DecompressionBomb(f"{name}: xor frame decompresses past the tensor's {dst.size} bytes")
    except zstd.ZstdError as exc:
        raise CorruptArtifact(f"{name}: corrupt zstd frame ({exc})") from None


def _apply_xor(dst: np.ndarray, frame: object, hasher: Hasher, name: str) -> Undo:
    n = dst.size
    size = check_frame_header(frame, n, name)
    if 0 <= size < n:
        raise CorruptArtifact(f"{name}: xor frame declares {size} bytes, the tensor has {n}")
    done = [0]

    def undo() -> None:
        _xor_stream(dst, frame, done[0], None, name, [0])  # XOR is its own inverse

    try:
        _xor_stream(dst, frame, n, hasher, name, done)
    except BaseException:
        undo()
        raise
    if n == 0:
        hasher.update(b"")
    return undo


def _hash_all(dst: np.ndarray, hasher: Hasher) -> None:
    for s in range(0, dst.size, CHUNK):
        hasher.update(dst[s : s + CHUNK])
    if dst.size == 0:
        hasher.update(b"")


def _apply_overwrite(dst: np.ndarray, payload: memoryview, hasher: Hasher, name: str) -> Undo:
    if len(payload) < 4:
        raise CorruptArtifact(f"{name}: overwrite payload too short")
    (count,) = struct.unpack_from("<I", payload)
    if len(payload) != 4 + 5 * count:
        raise CorruptArtifact(f"{name}: overwrite payload is {len(payload)} bytes, count {count} needs {4 + 5 * count}")
    pos = np.frombuffer(payload, "<u4", count, 4)
    vals = np.frombuffer(payload, np.uint8, count, 4 + 4 * count)
    if count and int(pos.max()) >= dst.size:
        raise CorruptArtifact(f"{name}: overwrite position {int(pos.max())} is out of range for {dst.size} bytes")
    old = dst[pos]
    dst[pos] = vals
    _hash_all(dst, hasher)

    def undo() -> None:
        dst[pos[::-1]] = old[::-1]  # reversed, so a repeated position ends at its original byte

    return undo


def _apply_xor_sparse(dst: np.ndarray, payload: memoryview, hasher: Hasher, name: str) -> Undo:
    if len(payload) < 8:
        raise CorruptArtifact(f"{name}: {XOR_SPARSE} payload too short")
    (count,) = struct.unpack_from("<Q", payload)
    if count > dst.size or len(payload) != 8 + 9 * count:
        raise CorruptArtifact(
            f"{name}: {XOR_SPARSE} payload is {len(payload)} bytes, count {count} needs {8 + 9 * count}"
        )
    pos = np.frombuffer(payload, "<u8", count, 8)
    vals = np.frombuffer(payload, np.uint8, count, 8 + 8 * count)
    if count and (int(pos[-1]) >= dst.size or bool(np.any(pos[1:] <= pos[:-1]))):
        raise CorruptArtifact(f"{name}: {XOR_SPARSE} positions are not increasing within {dst.size} bytes")
    _scatter_xor(dst, pos, vals)
    _hash_all(dst, hasher)
    return lambda: _scatter_xor(dst, pos, vals)  # XOR is its own inverse


def _apply_sparse(dst: np.ndarray, payload: memoryview, itemsize: int, hasher: Hasher, name: str) -> Undo:
    if len(payload) < _SPARSE_HEAD.size:
        raise CorruptArtifact(f"{name}: {SPARSE_XOR} payload too short")
    magic, fmt, unit, _, count = _SPARSE_HEAD.unpack_from(payload)
    if magic != _SPARSE_MAGIC or fmt != 1:
        raise CorruptArtifact(f"{name}: not an {SPARSE_XOR} v1 payload")
    if unit != itemsize or unit not in (1, 2, 4, 8) or dst.size % unit:
        raise CorruptArtifact(f"{name}: {SPARSE_XOR} element size {unit} does not match the tensor's {itemsize}")
    nelem = dst.size // unit
    if count > nelem or len(payload) != _SPARSE_HEAD.size + count * (4 + unit):
        raise CorruptArtifact(f"{name}: {SPARSE_XOR} payload size does not match its count {count}")
    elem = np.dtype(f"<u{unit}")
    body = payload[_SPARSE_HEAD.size :]
    gaps = _unplanes(body, count, np.dtype("<u4"))
    vals = _unplanes(body[4 * count :], count, elem)
    pos = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if count and pos[-1] >= nelem:
        raise CorruptArtifact(f"{name}: {SPARSE_XOR} position {int(pos[-1])} is out of range for {nelem} elements")
    view = dst.view(elem)
    _scatter_xor(view, pos, vals)
    _hash_all(dst, hasher)
    return lambda: _scatter_xor(view, pos, vals)


def _scatter_xor(view: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    # Positions are strictly increasing, so no element is hit twice. Fancy indexing holds the
    # GIL, so go in slices to let the engine's threads run in between.
    step = 1 << 18
    for s in range(0, pos.size, step):
        p = pos[s : s + step]
        view[p] ^= vals[s : s + step]
