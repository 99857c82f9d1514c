"""Every bad publication fails with a typed error and leaves the local checkpoint at its last good version."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zstandard as zstd
from policy_helpers import Trainer, forge_version, make_checkpoint, raw, read_local
from safetensors import safe_open
from safetensors.numpy import save_file

from rollfleet.policy_store import materialize, read_marker, tensor_checksum
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.schemas.errors import (
    ChecksumMismatch,
    CorruptArtifact,
    DecompressionBomb,
    HostileName,
    LayoutMismatch,
    LineageMismatch,
    PolicyError,
    UnsupportedFormat,
)

INDEX = "model.safetensors.index.json"
SHARD = "model-00000-of-00001.safetensors"
BIG = "model.embed_tokens.weight"
SMALL = "model.layers.0.mlp.up_proj.weight"


class Setup:
    """Versions 0, 1 (applied locally) and a good version 2, ready to be damaged."""

    def __init__(self, tmp: Path, encoding: str = "xor") -> None:
        base = make_checkpoint(tmp / "base")
        self.store, self.local = tmp / "store", tmp / "local"
        pub = PolicyPublisher(self.store, tmp / "base", encoding=encoding, keyframe_every=0, keep_last=None)
        trainer = Trainer(base)
        pub.publish(trainer.weights())
        self.v1 = trainer.step()
        pub.publish(self.v1)
        materialize(self.local, self.store, 1)
        self.v2 = trainer.step()
        pub.publish(self.v2)
        self.v2dir = self.store / "weight_v000002"

    def index(self) -> dict:
        return json.loads((self.v2dir / INDEX).read_text())

    def write_index(self, doc: dict) -> None:
        (self.v2dir / INDEX).write_text(json.dumps(doc))

    def edit_meta(self, **changes: object) -> None:
        doc = self.index()
        doc["metadata"].update(changes)
        self.write_index(doc)

    def rewrite_shard(self, fn: Callable[[dict[str, np.ndarray], dict[str, str]], None]) -> None:
        path = self.v2dir / SHARD
        with safe_open(str(path), framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = dict(f.metadata())
        fn(tensors, meta)
        os.unlink(path)
        save_file(tensors, str(path), metadata=meta)

    def replace_v2(self, frames: dict[str, bytes], encoding: str = "xor", **meta: str) -> None:
        shutil.rmtree(self.v2dir)
        sums = {n: tensor_checksum(raw(self.v2).get(n, b"")) for n in frames}
        doc = {"version": "000002", "base_version": "000001", "delta_encoding": encoding}
        doc |= {"compression_format": "zstd", "checksum_format": "xxh3-128"} | meta
        forge_version(self.store, 2, doc, frames, sums)

    def fails_closed(self, error: type[PolicyError]) -> PolicyError:
        with pytest.raises(error) as info:
            materialize(self.local, self.store, 2)
        assert read_marker(self.local) == 1
        assert read_local(self.local) == raw(self.v1)  # not a byte changed
        return info.value


@pytest.fixture
def s(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def test_checksum_mismatch(s: Setup) -> None:
    # the smallest tensor fails last, so the bigger ones were already applied and must be undone
    s.rewrite_shard(lambda t, m: m.update({SMALL: "0" * 32}))
    s.fails_closed(ChecksumMismatch)


def test_checksum_mismatch_in_an_overwrite_delta(tmp_path: Path) -> None:
    s = Setup(tmp_path, encoding="overwrite")
    s.rewrite_shard(lambda t, m: m.update({BIG: "f" * 32}))
    s.fails_closed(ChecksumMismatch)


def test_base_version_not_equal_to_the_marker(s: Setup) -> None:
    s.edit_meta(base_version="000000")
    s.fails_closed(LineageMismatch)


def test_missing_shard(s: Setup) -> None:
    os.unlink(s.v2dir / SHARD)
    s.fails_closed(CorruptArtifact)


def test_truncated_shard(s: Setup) -> None:
    path = s.v2dir / SHARD
    os.truncate(path, path.stat().st_size - 100)
    s.fails_closed(CorruptArtifact)


def test_index_names_a_tensor_the_shard_lacks(s: Setup) -> None:
    doc = s.index()
    doc["weight_map"]["model.layers.9.ghost.weight"] = SHARD
    s.write_index(doc)
    s.fails_closed(CorruptArtifact)


def test_shard_holds_a_tensor_the_index_lacks(s: Setup) -> None:
    doc = s.index()
    del doc["weight_map"][SMALL]
    s.write_index(doc)
    s.fails_closed(CorruptArtifact)


def test_delta_names_a_tensor_missing_from_the_local_layout(s: Setup) -> None:
    s.replace_v2({"model.layers.7.unknown.weight": zstd.ZstdCompressor().compress(b"\x01" * 16)})
    s.fails_closed(LayoutMismatch)


@pytest.mark.parametrize(
    "meta",
    [{"delta_encoding": "bsdiff"}, {"compression_format": "lz4"}, {"checksum_format": "md5"}],
)
def test_unknown_format(s: Setup, meta: dict[str, str]) -> None:
    s.edit_meta(**meta)
    s.fails_closed(UnsupportedFormat)


@pytest.mark.parametrize(
    "where",
    ["weight_map key", "shard with dots", "absolute shard", "backslash shard"],
)
def test_hostile_names_in_the_index(s: Setup, where: str) -> None:
    doc = s.index()
    wmap = doc["weight_map"]
    if where == "weight_map key":
        wmap["../../escape"] = SHARD
    elif where == "shard with dots":
        wmap[SMALL] = "../weight_v000001/" + SHARD
    elif where == "absolute shard":
        wmap[SMALL] = "/etc/passwd"
    else:
        wmap[SMALL] = "..\\x.safetensors"
    s.write_index(doc)
    s.fails_closed(HostileName)


def test_hostile_tensor_name_inside_the_shard(s: Setup) -> None:
    s.rewrite_shard(lambda t, m: t.update({"a/../../b": np.zeros(4, np.uint8)}))
    s.fails_closed(HostileName)


def test_decompression_bomb_declared_in_the_frame_header(s: Setup) -> None:
    nbytes = len(raw(s.v1)[SMALL])
    s.replace_v2({SMALL: zstd.ZstdCompressor().compress(b"\0" * (nbytes * 64))})
    err = s.fails_closed(DecompressionBomb)
    assert isinstance(err, CorruptArtifact)


def test_decompression_bomb_without_a_declared_size(s: Setup) -> None:
    nbytes = len(raw(s.v1)[SMALL])
    cobj = zstd.ZstdCompressor(write_content_size=False).compressobj()
    frame = cobj.compress(b"\0" * (nbytes * 64)) + cobj.flush()
    assert zstd.frame_content_size(frame) == -1
    s.replace_v2({SMALL: frame})
    s.fails_closed(DecompressionBomb)


def test_decompression_bomb_in_an_overwrite_frame(s: Setup) -> None:
    nbytes = len(raw(s.v1)[SMALL])
    s.replace_v2({SMALL: zstd.ZstdCompressor().compress(b"\0" * (4 + 5 * nbytes + 1))}, encoding="overwrite")
    s.fails_closed(DecompressionBomb)


def test_overwrite_position_out_of_range(s: Setup) -> None:
    nbytes = len(raw(s.v1)[SMALL])
    pos = np.array([0, 5, nbytes], "<u4")  # the last one is one past the end
    payload = (3).to_bytes(4, "little") + pos.tobytes() + bytes([1, 2, 3])
    s.replace_v2({SMALL: zstd.ZstdCompressor().compress(payload)}, encoding="overwrite")
    s.fails_closed(CorruptArtifact)


def test_corrupt_frame_bytes(s: Setup) -> None:
    def damage(t: dict[str, np.ndarray], m: dict[str, str]) -> None:
        t[SMALL] = t[SMALL].copy()
        t[SMALL][len(t[SMALL]) // 2 :] ^= 0xA5

    s.rewrite_shard(damage)
    s.fails_closed(CorruptArtifact)


def test_a_good_version_still_applies_after_failures(s: Setup) -> None:
    s.edit_meta(checksum_format="md5")
    s.fails_closed(UnsupportedFormat)
    s.edit_meta(checksum_format="xxh3-128")
    assert materialize(s.local, s.store, 2).version == 2
    assert read_local(s.local) == raw(s.v2)
