"""The publication format: index model, checksums, encodings, and interop with foreign readers/writers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import zstandard as zstd
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_helpers import Trainer, forge_version, make_checkpoint, raw, read_local
from safetensors import safe_open

from rollfleet.policy_store import delta_codecs as codecs
from rollfleet.policy_store import materialize, read_record, tensor_checksum, verify_version_dir
from rollfleet.policy_store.formats import CHECKSUM_FORMATS, DELTA_ENCODINGS, new_hasher
from rollfleet.policy_store.layout import CheckpointLayout
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.schemas.errors import CorruptArtifact, HostileName
from rollfleet.schemas.index import PublicationIndex

# -- index model -------------------------------------------------------------------------------


def test_index_round_trip_keeps_zero_padded_versions() -> None:
    doc = {
        "metadata": {
            "version": "000007",
            "base_version": "000006",
            "delta_encoding": "xor",
            "compression_format": "zstd",
            "checksum_format": "xxh3-128",
            "total_size": 12,
        },
        "weight_map": {"model.a.weight": "model-00000-of-00001.safetensors"},
    }
    index = PublicationIndex.parse(json.dumps(doc))
    assert index.metadata.version == 7 and index.metadata.base_version == 6 and index.metadata.is_delta
    back = json.loads(index.to_bytes())
    assert back["metadata"]["version"] == "000007" and back["metadata"]["base_version"] == "000006"
    assert back["metadata"]["total_size"] == 12  # unknown keys are kept


@pytest.mark.parametrize(
    "wmap",
    [
        {"a/b": "s.safetensors"},
        {"..": "s.safetensors"},
        {"a": "../s.safetensors"},
        {"a": "/etc/passwd"},
        {"a": "sub\\s.safetensors"},
        {"a\x00b": "s.safetensors"},
    ],
)
def test_index_rejects_hostile_names(wmap: dict[str, str]) -> None:
    with pytest.raises(HostileName):
        PublicationIndex.parse(json.dumps({"metadata": {"version": "000001"}, "weight_map": wmap}))


@pytest.mark.parametrize(
    "doc",
    [
        b"not json",
        b"[]",
        json.dumps({"metadata": {}, "weight_map": {}}).encode(),
        json.dumps({"metadata": {"version": "x1"}, "weight_map": {}}).encode(),
        json.dumps({"metadata": {"version": "000002", "delta_encoding": "xor"}, "weight_map": {}}).encode(),
        json.dumps({"metadata": {"version": "000001"}, "weight_map": {"a": 3}}).encode(),
    ],
)
def test_index_rejects_malformed_documents(doc: bytes) -> None:
    with pytest.raises(CorruptArtifact):
        PublicationIndex.parse(doc)


# -- checksums ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", CHECKSUM_FORMATS)
def test_tensor_checksum_agrees_across_input_kinds(fmt: str) -> None:
    t = torch.randn(300, 7).to(torch.bfloat16)
    b = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert tensor_checksum(t, fmt) == tensor_checksum(b, fmt) == tensor_checksum(np.frombuffer(b, np.uint8), fmt)
    big = np.random.default_rng(0).integers(0, 255, 9 << 20, dtype=np.uint8)  # crosses chunk boundaries
    h = new_hasher(fmt)
    h.update(big)
    assert tensor_checksum(big, fmt) == h.hexdigest()


def test_xxh3_checksum_is_the_standard_hexdigest() -> None:
    assert tensor_checksum(b"abc") == xxhash.xxh3_128_hexdigest(b"abc")


# -- encodings ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    encoding=st.sampled_from(DELTA_ENCODINGS),
    itemsize=st.sampled_from([1, 2, 4]),
    n=st.integers(0, 3000),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_encode_then_apply_reaches_new_bytes_and_undo_restores(
    encoding: str, itemsize: int, n: int, density: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    new = old.copy()
    mask = rng.random(n * itemsize) < density
    new[mask] ^= rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)
    state = old.copy()
    enc = codecs.encode(encoding, new, state, itemsize, "xxh3-128")
    assert np.array_equal(state, new)  # the publisher's comparison state moved forward
    assert enc.changed_bytes == int(mask.sum())
    if enc.frame is None:
        assert not mask.any()
        return
    dst = old.copy()
    hasher = new_hasher("xxh3-128")
    undo = codecs.apply(encoding, dst, enc.frame, itemsize, hasher, "t")
    assert np.array_equal(dst, new)
    assert hasher.hexdigest() == enc.checksum == tensor_checksum(new)
    undo()
    assert np.array_equal(dst, old)


# -- interop -----------------------------------------------------------------------------------


def test_our_delta_is_readable_by_a_plain_miles_style_reader(tmp_path: Path) -> None:
    """Read a published xor delta with nothing but safetensors, zstandard and xxhash."""
    base = make_checkpoint(tmp_path / "base")
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", keyframe_every=0, keep_last=None)
    trainer = Trainer(base)
    pub.publish(trainer.weights())
    new = trainer.step()
    rec = pub.publish(new)
    vdir = tmp_path / "store" / rec.path
    index = json.loads((vdir / "model.safetensors.index.json").read_text())
    meta = index["metadata"]
    assert (meta["version"], meta["base_version"], meta["delta_encoding"]) == ("000001", "000000", "xor")
    assert (meta["compression_format"], meta["checksum_format"]) == ("zstd", "xxh3-128")
    old_raw, new_raw = raw(base), raw(new)
    for name, shard in index["weight_map"].items():
        with safe_open(str(vdir / shard), framework="numpy") as f:
            frame = f.get_tensor(name)
            checksum = f.metadata()[name]
        assert frame.dtype == np.uint8 and frame.ndim == 1
        delta = zstd.ZstdDecompressor().decompress(frame.tobytes())
        out = bytes(np.bitwise_xor(np.frombuffer(old_raw[name], np.uint8), np.frombuffer(delta, np.uint8)))
        assert out == new_raw[name]
        assert xxhash.xxh3_128_hexdigest(out) == checksum


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_a_foreign_delta_is_adopted_and_applied(tmp_path: Path, encoding: str) -> None:
    """A version written by hand from the spec (as miles would) verifies, lists and applies."""
    base = make_checkpoint(tmp_path / "base")
    store = tmp_path / "store"
    PolicyPublisher(store, tmp_path / "base").publish(base)  # version 0
    name = "model.layers.0.mlp.up_proj.weight"
    old = np.frombuffer(raw(base)[name], np.uint8)
    new = old.copy()
    new[::97] ^= 0x5A
    if encoding == "xor":
        payload = np.bitwise_xor(old, new).tobytes()
    else:
        pos = np.flatnonzero(old != new).astype("<u4")
        payload = len(pos).to_bytes(4, "little") + pos.tobytes() + new[pos].tobytes()
    frame = zstd.ZstdCompressor(level=3).compress(payload)
    meta = {
        "version": "000001",
        "base_version": "000000",
        "delta_encoding": encoding,
        "compression_format": "zstd",
        "checksum_format": "adler32",
    }
    forge_version(store, 1, meta, {name: frame}, {name: tensor_checksum(new, "adler32")})
    rec = verify_version_dir(store / "weight_v000001", CheckpointLayout.read(tmp_path / "base").specs)
    assert (rec.version, rec.kind, rec.base_version, rec.encoding) == (1, "delta", 0, encoding)
    assert read_record(store, 1) == rec
    result = materialize(tmp_path / "local", store, 1)
    assert result.version == 1
    assert read_local(tmp_path / "local")[name] == new.tobytes()


def test_our_own_encoding_is_declared_so_foreign_readers_can_refuse_it(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base")
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", encoding="rf-sparse-xor")
    trainer = Trainer(base)
    pub.publish(trainer.weights())
    rec = pub.publish(trainer.step())
    meta = json.loads((tmp_path / "store" / rec.path / "model.safetensors.index.json").read_text())["metadata"]
    assert meta["delta_encoding"] == "rf-sparse-xor"
    assert meta["delta_encoding"] not in ("xor", "overwrite")
