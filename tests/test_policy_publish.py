"""Trainer side: PolicyPublisher versions, layout checks, keyframes, retention, hooks, crash safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from policy_helpers import Trainer, make_checkpoint, raw, read_local

from rollfleet.policy_store import list_records, list_versions, materialize, read_record
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.policy_store.retention import plan_retention
from rollfleet.runtime import faults
from rollfleet.schemas.errors import LayoutMismatch, UnsupportedFormat


@pytest.fixture
def base(tmp_path: Path) -> dict[str, torch.Tensor]:
    return make_checkpoint(tmp_path / "base")


def test_first_publish_records_the_base_and_versions_are_monotonic(tmp_path: Path, base: dict) -> None:
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", keyframe_every=0, keep_last=None)
    trainer = Trainer(base)
    rec0 = pub.publish(trainer.weights())
    assert (rec0.version, rec0.kind, rec0.path) == (0, "base", "weight_v000000")
    assert list_versions(tmp_path / "store") == [0]
    recs = [pub.publish(trainer.step()) for _ in range(3)]
    assert [r.version for r in recs] == [1, 2, 3]
    assert all(r.kind == "delta" and r.base_version == r.version - 1 for r in recs)
    r = recs[-1]
    assert r.encoding == "xor" and r.checksum_format == "xxh3-128"
    assert r.total_bytes == sum(map(len, raw(base).values()))
    assert 0 < r.changed_bytes < r.total_bytes and r.density == pytest.approx(r.changed_bytes / r.total_bytes)
    assert r.wire_bytes > 0 and r.seconds > 0 and pub.latest_version == 3
    assert read_record(tmp_path / "store", 3) == r  # the record is recoverable from the directory alone


def test_accepts_numpy_and_pairs_and_only_changed_tensors_are_written(tmp_path: Path, base: dict) -> None:
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", keep_last=None)
    trainer = Trainer(base)
    pub.publish(list(trainer.weights().items()))
    w = trainer.step(only=["model.layers.0.mlp.up_proj.weight"])
    pairs = [(n, t.numpy() if t.dtype != torch.bfloat16 else t) for n, t in w.items()]
    rec = pub.publish(iter(pairs))
    index = json.loads((tmp_path / "store" / rec.path / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == ["model.layers.0.mlp.up_proj.weight"]
    empty = pub.publish(w)  # nothing changed: an empty delta is still a version
    assert empty.changed_bytes == 0 and empty.kind == "delta"
    index = json.loads((tmp_path / "store" / empty.path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {}


@pytest.mark.parametrize("change", ["missing", "extra", "dtype", "shape"])
def test_layout_mismatch_is_refused_before_anything_is_written(tmp_path: Path, base: dict, change: str) -> None:
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base")
    trainer = Trainer(base)
    pub.publish(trainer.weights())
    w = trainer.step()
    name = "model.layers.0.mlp.up_proj.weight"
    if change == "missing":
        del w[name]
    elif change == "extra":
        w["model.extra.weight"] = torch.zeros(3)
    elif change == "dtype":
        w[name] = w[name].to(torch.float16)
    else:
        w[name] = w[name].reshape(256, 128)
    before = sorted(os.listdir(tmp_path / "store"))
    with pytest.raises(LayoutMismatch):
        pub.publish(w)
    assert sorted(os.listdir(tmp_path / "store")) == before and pub.latest_version == 0
    assert pub.publish(trainer.weights()).version == 1  # and the publisher is still usable


def test_unknown_formats_are_refused_at_construction(tmp_path: Path, base: dict) -> None:
    with pytest.raises(UnsupportedFormat):
        PolicyPublisher(tmp_path / "store", tmp_path / "base", encoding="bsdiff")
    with pytest.raises(UnsupportedFormat):
        PolicyPublisher(tmp_path / "store", tmp_path / "base", checksum="md5")


def test_keyframes_are_ordinary_checkpoints_and_retention_keeps_what_catch_up_needs(tmp_path: Path, base: dict) -> None:
    from transformers.modeling_utils import load_state_dict

    store = tmp_path / "store"
    pub = PolicyPublisher(store, tmp_path / "base", keyframe_every=3, keep_last=2, max_shard_bytes=1 << 20)
    trainer = Trainer(base)
    pub.publish(trainer.weights())
    weights = {}
    for _ in range(7):
        w = trainer.step()
        weights[pub.publish(w).version] = w
    kinds = {r.version: r.kind for r in list_records(store)}
    # newest full (6), everything after it (7), the last 2 (6, 7); version 0 is kept as the base
    assert kinds == {0: "base", 6: "full", 7: "delta"}
    full = store / "weight_v000006"
    assert (full / "config.json").exists() and (full / "tokenizer.json").exists()
    assert len(list(full.glob("*.safetensors"))) > 1  # sharded by max_shard_bytes, with an HF index
    index = json.loads((full / "model.safetensors.index.json").read_text())
    assert "delta_encoding" not in index["metadata"]
    loaded = {}
    for shard in set(index["weight_map"].values()):
        loaded.update(load_state_dict(str(full / shard)))
    assert raw(loaded) == raw(weights[6])
    result = materialize(tmp_path / "local", store, 7)
    assert result.reseeded and result.seeded_from == 6 and read_local(tmp_path / "local") == raw(weights[7])


def test_retention_plan_keeps_an_anchor_below_the_window() -> None:
    kinds = {0: True, **dict.fromkeys(range(1, 10), False), 10: True, 11: False, 12: False}
    assert plan_retention(kinds, keep_last=2) == {0, 10, 11, 12}
    assert plan_retention(kinds, keep_last=5) == {0, *range(1, 13)}  # 8 is reachable only from 0
    kinds[5] = True
    assert plan_retention(kinds, keep_last=5) == {0, *range(5, 13)}


def test_post_write_hook_runs_after_each_publication(tmp_path: Path, base: dict) -> None:
    import policy_helpers

    policy_helpers.HOOK_CALLS.clear()
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", post_write_hook="policy_helpers:record_hook")
    trainer = Trainer(base)
    pub.publish(trainer.weights())
    pub.publish(trainer.step())
    assert policy_helpers.HOOK_CALLS == [("weight_v000000", 0), ("weight_v000001", 1)]


def test_a_new_publisher_resumes_from_the_store(tmp_path: Path, base: dict) -> None:
    store = tmp_path / "store"
    trainer = Trainer(base)
    first = PolicyPublisher(store, tmp_path / "base", encoding="overwrite")
    first.publish(trainer.weights())
    first.publish(trainer.step())
    again = PolicyPublisher(store, tmp_path / "base", encoding="overwrite")
    assert again.latest_version == 1
    rec = again.publish(trainer.step())
    assert rec.version == 2 and rec.base_version == 1
    materialize(tmp_path / "local", store, 2)
    assert read_local(tmp_path / "local") == raw(trainer.weights())


def test_numpy_only_tensors(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    (tmp_path / "base").mkdir()
    arrays = {"a.weight": np.arange(1000, dtype=np.float32), "b.weight": np.ones((3, 5), np.int8)}
    save_file(arrays, str(tmp_path / "base" / "model.safetensors"), metadata={"format": "pt"})
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", checksum="blake3")
    pub.publish(arrays)
    arrays["a.weight"] = arrays["a.weight"] + 1
    assert pub.publish(arrays).changed_bytes > 0
    materialize(tmp_path / "local", tmp_path / "store", 1)
    assert read_local(tmp_path / "local")["a.weight"] == arrays["a.weight"].tobytes()


# -- crash safety ------------------------------------------------------------------------------

_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from policy_helpers import Trainer
from safetensors.torch import load_file
from rollfleet.policy_store.publisher import PolicyPublisher
pub = PolicyPublisher({store!r}, {base!r}, keyframe_every={k}, keep_last=None, max_shard_bytes=1 << 20)
base = load_file({base!r} + "/model.safetensors")
trainer = Trainer(base)
pub.publish(trainer.weights())
pub.publish(trainer.step())
print("DONE", flush=True)
"""


@pytest.mark.parametrize(
    ("point", "keyframe"),
    [
        ("publish:after-shard", 0),
        ("publish:before-rename", 0),
        ("publish:after-shard", 1),  # a full version, half written
        ("publish:after-rename", 0),
    ],
)
def test_a_killed_publisher_leaves_no_partial_version(tmp_path: Path, base: dict, point: str, keyframe: int) -> None:
    store = tmp_path / "store"
    PolicyPublisher(store, tmp_path / "base").publish(base)  # version 0 exists before the child starts
    code = _CHILD.format(tests=str(Path(__file__).parent), store=str(store), base=str(tmp_path / "base"), k=keyframe)
    env = {**os.environ, **faults.env("pause", point)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == f"PAUSED {point}", line
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    versions = list_versions(store)
    if point == "publish:after-rename":
        assert versions == [0, 1]  # the rename is the commit: it is complete, or absent
        assert read_record(store, 1).kind == "delta"
    else:
        assert versions == [0]
        assert any(n.startswith(".tmp-") for n in os.listdir(store))  # hidden, and cleaned up next time
    nxt = PolicyPublisher(store, tmp_path / "base")
    assert not any(n.startswith(".tmp-") for n in os.listdir(store))
    trainer = Trainer(base, seed=7)
    rec = nxt.publish(trainer.step())
    assert rec.version == versions[-1] + 1
    materialize(tmp_path / "local", store, rec.version)
    assert read_local(tmp_path / "local") == raw(trainer.weights())


def test_two_publishers_cannot_commit_the_same_version(tmp_path: Path, base: dict) -> None:
    from rollfleet.schemas.errors import VersionConflict

    store = tmp_path / "store"
    trainer = Trainer(base)
    a = PolicyPublisher(store, tmp_path / "base")
    a.publish(trainer.weights())
    b = PolicyPublisher(store, tmp_path / "base")
    b.publish(trainer.step())  # b resumes from version 0 and commits 1
    with pytest.raises(VersionConflict) as info:
        a.publish(trainer.step())  # a still believes 0 is the latest
    assert info.value.retryable
    assert list_versions(store) == [0, 1]
    rec = a.publish(trainer.weights())  # a rebuilt its state from the store and moves on
    assert rec.version == 2 and rec.base_version == 1
    materialize(tmp_path / "local", store, 2)
    assert read_local(tmp_path / "local") == raw(trainer.weights())
