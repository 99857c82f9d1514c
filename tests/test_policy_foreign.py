"""Accept what SGLang's puller accepts, refuse what is truly bad.

- every safetensors dtype, sized by bits and applied by bytes (F8_E8M0, F4, F6_*, C64, ...);
- a full version that is a plain checkpoint: no index, or an HF index without our metadata;
- a full version that declares a checksum format must have readable checksums (issue 11, item 6);
- store files must be regular files inside the store: no FIFO, device or symlink out (item 10).

Foreign versions are written by hand or with the safetensors library, the way SGLang's own test
fixtures and a plain ``save_pretrained`` write them, never with rollfleet's writer.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard as zstd
from policy_helpers import Chain, Trainer, make_checkpoint, raw, read_local
from safetensors import safe_open
from safetensors.torch import save_file

from rollfleet.policy_store import materialize, read_marker, tensor_checksum, verify_version_dir
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.schemas.errors import ChecksumMismatch, CorruptArtifact, HostileName, PolicyError

INDEX = "model.safetensors.index.json"

# The safetensors format's dtypes and their bits per element, from its specification.
SPEC_BITS = {
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


Raw = dict[str, tuple[str, list[int], bytes]]  # name -> (safetensors dtype, shape, bytes)


def write_safetensors(path: Path, tensors: Raw, metadata: dict | None = None) -> None:
    """A minimal safetensors writer for any dtype (bytes as given), like SGLang's test fixture."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, _, data in tensors.values():
            f.write(data)


def forge_delta(store: Path, version: int, old: dict[str, bytes], new: dict[str, bytes], encoding: str) -> None:
    """A delta written the way miles and SGLang's fixtures write one (adler32 checksums)."""
    vdir = store / f"weight_v{version:06d}"
    vdir.mkdir()
    frames: Raw = {}
    sums = {}
    for name in new:
        a, b = np.frombuffer(old[name], np.uint8), np.frombuffer(new[name], np.uint8)
        if encoding == "xor":
            payload = (a ^ b).tobytes()
        elif encoding == "xor_sparse":  # SGLang's newest fixture: u64 count, u64 positions, XOR bytes
            pos = np.flatnonzero(a != b).astype("<u8")
            payload = struct.pack("<Q", pos.size) + pos.tobytes() + (a ^ b)[pos].tobytes()
        else:
            pos = np.flatnonzero(a != b).astype("<u4")
            payload = struct.pack("<I", pos.size) + pos.tobytes() + b[pos].tobytes()
        frame = zstd.ZstdCompressor().compress(payload)
        frames[name] = ("U8", [len(frame)], frame)
        sums[name] = f"{zlib.adler32(new[name], 1):08x}"
    shard = "model-00000-of-00001.safetensors"
    write_safetensors(vdir / shard, frames, metadata=sums)
    meta = {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": encoding}
    meta |= {"compression_format": "zstd", "checksum_format": "adler32"}
    (vdir / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": dict.fromkeys(frames, shard)}))


def every_dtype(rng: np.random.Generator) -> Raw:
    out = {}
    for dtype, bits in SPEC_BITS.items():
        shape = [6, 8]  # 48 elements: whole bytes for 4- and 6-bit dtypes too
        out[f"model.{dtype.lower()}.weight"] = (dtype, shape, rng.integers(0, 256, 48 * bits // 8, np.uint8).tobytes())
    return out


@pytest.mark.parametrize("encoding", ["xor", "overwrite", "xor_sparse"])
def test_every_safetensors_dtype_is_published_and_applied_by_bytes(tmp_path: Path, encoding: str) -> None:
    rng = np.random.default_rng(0)
    base = tmp_path / "base"
    base.mkdir()
    tensors = every_dtype(rng)
    write_safetensors(base / "model.safetensors", tensors)
    with safe_open(str(base / "model.safetensors"), framework="np") as f:  # the reference reader agrees
        assert set(f.keys()) == set(tensors)
    store = tmp_path / "store"
    PolicyPublisher(store, base).record_base()
    states = [{n: data for n, (_, _, data) in tensors.items()}]
    for v in (1, 2):
        new = {}
        for name, data in states[-1].items():
            b = bytearray(data)
            for i in rng.choice(len(b), size=3, replace=False):
                b[i] ^= 0x5A
            new[name] = bytes(b)
        forge_delta(store, v, states[-1], new, encoding)
        states.append(new)
    local = tmp_path / "local"
    assert materialize(local, store, 2).applied == [0, 1, 2]
    assert read_local(local) == states[2]
    fresh = tmp_path / "fresh"
    materialize(fresh, store, 1)
    assert read_local(fresh) == states[1]


def test_modern_in_memory_dtypes_publish_exact_bytes(tmp_path: Path) -> None:
    """What a trainer holds in memory (MXFP8 scales, packed FP4, complex) publishes by bytes."""
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (4, 6), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2)
    tensors = {
        "scales": torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu),
        "packed": packed,
        "rotary": torch.randn(8, dtype=torch.complex64, generator=g),
        "fnuz": torch.randn(12, generator=g).to(torch.float8_e4m3fnuz),
        "dense": torch.randn(32, generator=g).to(torch.bfloat16),
    }
    (tmp_path / "base").mkdir()
    save_file(tensors, str(tmp_path / "base" / "model.safetensors"))  # the reference writer
    store = tmp_path / "store"
    pub = PolicyPublisher(store, tmp_path / "base", keyframe_every=0)
    pub.publish(tensors)
    new = {n: t.clone() for n, t in tensors.items()}
    for t in new.values():
        t.view(torch.uint8).view(-1)[:2] ^= 0x11
    pub.publish(new)
    local = tmp_path / "local"
    materialize(local, store, 1)
    assert read_local(local) == raw(new)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "I4", "shape": [4], "data_offsets": [0, 2]},  # not a safetensors dtype
        {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]},  # 12 bits: not a whole number of bytes
        {"dtype": "F6_E2M3", "shape": [2], "data_offsets": [0, 2]},
        {"dtype": "C64", "shape": [2], "data_offsets": [0, 8]},  # 16 bytes needed
    ],
)
def test_a_truly_corrupt_dtype_entry_is_still_refused(tmp_path: Path, entry: dict) -> None:
    base = tmp_path / "base"
    make_checkpoint(base)
    store = tmp_path / "store"
    PolicyPublisher(store, base).record_base()
    bad = store / "weight_v000001"
    bad.mkdir()
    encoded = json.dumps({"t": entry}).encode()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * 16)
    local = tmp_path / "local"
    materialize(local, store, 0)
    with pytest.raises(CorruptArtifact):
        materialize(local, store, 1)
    assert read_marker(local) == 0


# -- plain checkpoints as full versions ---------------------------------------------------------


def write_plain(path: Path, tensors: dict[str, torch.Tensor], kind: str) -> None:
    """A full version as a user or SGLang writes one: safetensors files, an HF index or none."""
    path.mkdir()
    names = sorted(tensors)
    if kind == "single file, no index":
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    halves = names[:3], names[3:]
    weight_map = {}
    for i, part in enumerate(halves):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    if kind == "plain HF index":
        doc = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (path / INDEX).write_text(json.dumps(doc))


@pytest.mark.parametrize("kind", ["single file, no index", "shards, no index", "plain HF index"])
def test_a_plain_checkpoint_is_a_full_version(tmp_path: Path, kind: str) -> None:
    chain = Chain(tmp_path, keyframe_every=0)
    store, trainer = chain.store, chain.trainer
    chain.step()
    local = tmp_path / "local"
    materialize(local, store, 1)
    v2 = chain.step(publish=False)
    write_plain(store / "weight_v000002", v2, kind)
    record = verify_version_dir(store / "weight_v000002")
    assert (record.version, record.kind, record.encoding) == (2, "full", None)
    # Met inside a chain: applied from the marker.
    assert materialize(local, store, 2).applied == [2]
    assert read_local(local) == raw(v2) and read_marker(local) == 2
    # A publisher resumes from it, and a new replica seeds from it.
    v3 = trainer.step()
    assert PolicyPublisher(store, tmp_path / "base", keyframe_every=0).publish(v3).base_version == 2
    fresh = tmp_path / "fresh"
    result = materialize(fresh, store, 3)
    assert (result.seeded_from, result.applied) == (2, [2, 3])
    assert read_local(fresh) == raw(v3)


# -- item 6: a declared checksum format is a promise -----------------------------------------------


def flip_a_data_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))


def _truncate(side: Path) -> None:
    side.write_bytes(side.read_bytes()[:40])


def _drop_checksums(side: Path) -> None:
    doc = json.loads(side.read_text())
    del doc["checksums"]
    side.write_text(json.dumps(doc))


def _drop_one(side: Path) -> None:
    doc = json.loads(side.read_text())
    doc["checksums"].popitem()
    side.write_text(json.dumps(doc))


def _malform(side: Path) -> None:
    doc = json.loads(side.read_text())
    doc["checksums"] = dict.fromkeys(doc["checksums"], "not-hex")
    side.write_text(json.dumps(doc))


DAMAGE: dict[str, tuple[Callable[[Path], None], type[PolicyError]]] = {
    "sidecar intact": (lambda side: None, ChecksumMismatch),
    "sidecar deleted": (os.unlink, CorruptArtifact),
    "sidecar truncated": (_truncate, CorruptArtifact),
    "checksums removed": (_drop_checksums, CorruptArtifact),
    "one checksum missing": (_drop_one, CorruptArtifact),
    "checksums malformed": (_malform, CorruptArtifact),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_flipped_byte_in_a_keyframe_is_refused_whatever_happened_to_its_checksums(
    tmp_path: Path, damage: str
) -> None:
    chain = Chain(tmp_path, keyframe_every=2)
    store, v1 = chain.store, chain.step()
    chain.step()
    keyframe = store / "weight_v000002"
    meta = json.loads((keyframe / INDEX).read_text())["metadata"]
    assert meta["checksum_format"] == "xxh3-128" and "delta_encoding" not in meta  # a keyframe
    flip_a_data_byte(keyframe / "model.safetensors")
    fn, error = DAMAGE[damage]
    fn(keyframe / "rollfleet.json")
    local = tmp_path / "local"
    materialize(local, store, 1)
    with pytest.raises(error):  # met inside the chain
        materialize(local, store, 2)
    assert read_marker(local) == 1 and read_local(local) == raw(v1)
    fresh = tmp_path / "fresh"
    with pytest.raises(error):  # or seeded from directly
        materialize(fresh, store, 2)
    assert read_marker(fresh) is None


def test_a_foreign_full_version_without_checksums_is_accepted_by_structure(tmp_path: Path) -> None:
    """As in SGLang: a plain checkpoint declares no checksums, so its bytes are taken as they are."""
    base = make_checkpoint(tmp_path / "base")
    store = tmp_path / "store"
    trainer = Trainer(base)
    PolicyPublisher(store, tmp_path / "base").publish(trainer.weights())
    v1 = trainer.step()
    write_plain(store / "weight_v000001", v1, "single file, no index")
    flip_a_data_byte(store / "weight_v000001" / "model.safetensors")
    with safe_open(str(store / "weight_v000001" / "model.safetensors"), framework="pt") as f:
        on_disk = raw({n: f.get_tensor(n) for n in f.keys()})
    assert sum(on_disk[n] != b for n, b in raw(v1).items()) == 1
    local = tmp_path / "local"
    materialize(local, store, 1)
    assert read_local(local) == on_disk and read_marker(local) == 1


# -- item 10: hostile files ---------------------------------------------------------------------


class Store:
    """Versions 0 and 1 (applied locally), and a good delta version 2 to be replaced by something hostile."""

    def __init__(self, tmp: Path) -> None:
        chain = Chain(tmp, keyframe_every=0)
        self.tmp = tmp
        self.store, self.local = chain.store, tmp / "local"
        self.v1 = chain.step()
        materialize(self.local, self.store, 1)
        self.v2 = chain.step()
        self.v2dir = self.store / "weight_v000002"
        self.shard = self.v2dir / "model-00000-of-00001.safetensors"

    def materialize_bounded(self, target: int = 2, timeout: float = 15.0) -> BaseException | None:
        """materialize() on a thread; a hang fails the test instead of hanging the suite."""
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                materialize(self.local, self.store, target)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            for fifo in self.store.rglob("*"):  # release a reader blocked on a FIFO
                if stat.S_ISFIFO(os.lstat(fifo).st_mode):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail(f"materialize hung for {timeout} s")
        return outcome[0]


def _fifo_shard(s: Store) -> None:
    os.unlink(s.shard)
    os.mkfifo(s.shard)


def _fifo_index(s: Store) -> None:
    os.unlink(s.v2dir / INDEX)
    os.mkfifo(s.v2dir / INDEX)


def _fifo_sidecar(s: Store) -> None:
    os.unlink(s.v2dir / "rollfleet.json")
    os.mkfifo(s.v2dir / "rollfleet.json")


def _device_shard(s: Store) -> None:
    os.unlink(s.shard)
    try:
        os.mknod(s.shard, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("creating a device node needs privileges")


def _symlink_shard_out(s: Store) -> None:
    outside = s.tmp / "outside.safetensors"
    shutil.copyfile(s.shard, outside)  # a perfectly valid shard, just not in the store
    os.unlink(s.shard)
    os.symlink(outside, s.shard)


def _symlink_dir_out(s: Store) -> None:
    outside = s.tmp / "elsewhere" / "weight_v000002"
    shutil.copytree(s.v2dir, outside)
    shutil.rmtree(s.v2dir)
    os.symlink(outside, s.v2dir)


def _symlink_to_dev_zero(s: Store) -> None:
    os.unlink(s.shard)
    os.symlink("/dev/zero", s.shard)


HOSTILE: dict[str, tuple[Callable[[Store], None], type[PolicyError]]] = {
    "FIFO as a shard": (_fifo_shard, CorruptArtifact),
    "FIFO as the index": (_fifo_index, CorruptArtifact),
    "FIFO as the sidecar": (_fifo_sidecar, CorruptArtifact),
    "device as a shard": (_device_shard, CorruptArtifact),
    "symlink to a valid shard outside the store": (_symlink_shard_out, HostileName),
    "version dir symlinked outside the store": (_symlink_dir_out, HostileName),
    "symlink to /dev/zero": (_symlink_to_dev_zero, HostileName),
}


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_anything_but_a_regular_file_inside_the_store_is_refused_without_hanging(tmp_path: Path, hostile: str) -> None:
    s = Store(tmp_path)
    make, error = HOSTILE[hostile]
    make(s)
    exc = s.materialize_bounded()
    assert isinstance(exc, error), exc
    assert read_marker(s.local) == 1 and read_local(s.local) == raw(s.v1)
    with pytest.raises(error):
        verify_version_dir(s.v2dir)


def test_a_symlink_within_the_store_is_followed(tmp_path: Path) -> None:
    s = Store(tmp_path)
    blobs = s.store / "blobs"
    blobs.mkdir()
    shutil.move(s.shard, blobs / "v2.safetensors")
    os.symlink(Path("..") / "blobs" / "v2.safetensors", s.shard)
    assert s.materialize_bounded() is None
    assert read_local(s.local) == raw(s.v2)


def test_checksum_of_a_plain_version_is_what_the_replica_computes(tmp_path: Path) -> None:
    """A plain full version carries no checksums; the marker records the ones computed locally."""
    base = make_checkpoint(tmp_path / "base")
    store = tmp_path / "store"
    PolicyPublisher(store, tmp_path / "base").record_base()
    v1 = Trainer(base).step()
    write_plain(store / "weight_v000001", v1, "shards, no index")
    local = tmp_path / "local"
    materialize(local, store, 1)
    marker = json.loads((local / "rollfleet-version.json").read_text())
    assert marker["checksums"] == {n: f"xxh3-128:{tensor_checksum(t)}" for n, t in v1.items()}


@pytest.mark.parametrize(
    "payload",
    [
        struct.pack("<Q", 2) + struct.pack("<2Q", 5, 5) + b"\x01\x01",  # a position twice
        struct.pack("<Q", 2) + struct.pack("<2Q", 9, 3) + b"\x01\x01",  # decreasing
        struct.pack("<Q", 1) + struct.pack("<Q", 1 << 40) + b"\x01",  # out of range
        struct.pack("<Q", 3) + struct.pack("<Q", 1) + b"\x01",  # shorter than its count
    ],
)
def test_a_malformed_xor_sparse_frame_is_corrupt(tmp_path: Path, payload: bytes) -> None:
    base = make_checkpoint(tmp_path / "base")
    store = tmp_path / "store"
    PolicyPublisher(store, tmp_path / "base").record_base()
    name = "model.layers.0.quant.weight"
    vdir = store / "weight_v000001"
    vdir.mkdir()
    frame = zstd.ZstdCompressor().compress(payload)
    shard = "model-00000-of-00001.safetensors"
    write_safetensors(vdir / shard, {name: ("U8", [len(frame)], frame)}, {name: "0" * 32})
    meta = {"version": "000001", "base_version": "000000", "delta_encoding": "xor_sparse"}
    meta |= {"compression_format": "zstd", "checksum_format": "xxh3-128"}
    (vdir / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": {name: shard}}))
    local = tmp_path / "local"
    materialize(local, store, 0)
    with pytest.raises(CorruptArtifact):
        materialize(local, store, 1)
    assert read_marker(local) == 0 and read_local(local) == raw(base)
