"""Replica side: materialize chains, reseeds, locking, hooks, HF loadability, and SIGKILL mid-apply."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import policy_helpers
import pytest
import torch
from policy_helpers import Chain, Trainer, make_checkpoint, raw, read_local

from rollfleet.policy_store import materialize, read_marker
from rollfleet.policy_store.formats import CHECKSUM_FORMATS, DELTA_ENCODINGS
from rollfleet.policy_store.materialize import STAGING
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.runtime import faults
from rollfleet.schemas.errors import VersionNotFound

TWO = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.quant.weight"]


def publish_steps(tmp: Path, n: int, **kw: object) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """A store with versions 0..n; returns the store and the trainer weights per version."""
    chain = Chain(tmp, **kw)  # type: ignore[arg-type]
    for i in range(n):
        chain.step(only=TWO if i % 2 else None)
    return chain.store, chain.weights


@pytest.mark.parametrize("encoding", DELTA_ENCODINGS)
@pytest.mark.parametrize("checksum", CHECKSUM_FORMATS)
def test_each_version_is_reached_exactly_and_only_changed_tensors_are_reported(
    tmp_path: Path, encoding: str, checksum: str
) -> None:
    store, weights = publish_steps(tmp_path, 3, encoding=encoding, checksum=checksum, keyframe_every=0)
    local = tmp_path / "local"
    first = materialize(local, store, 0)
    assert first.reseeded and first.version == 0 and read_marker(local) == 0
    assert (local / "config.json").exists() and read_local(local) == raw(weights[0])
    for v in (1, 2, 3):
        res = materialize(local, store, v)
        assert (res.version, res.applied, res.reseeded, res.previous_version) == (v, [v], False, v - 1)
        assert read_local(local) == raw(weights[v]) and read_marker(local) == v
        assert res.wire_bytes > 0 and 0 < res.density <= 1
        if v == 2:  # the second step changed only two tensors
            assert sorted(res.changed) == sorted(TWO)
    again = materialize(local, store, 3)
    assert again.applied == [] and again.changed == []


def test_catch_up_over_several_versions_and_a_sharded_base(tmp_path: Path) -> None:
    store, weights = publish_steps(tmp_path, 5, sharded=True, keyframe_every=0)
    local = tmp_path / "local"
    materialize(local, store, 1)
    res = materialize(local, store, 5)
    assert res.applied == [2, 3, 4, 5] and not res.reseeded
    assert read_local(local) == raw(weights[5])


def test_broken_chain_and_going_back_reseed_from_a_full_version(tmp_path: Path) -> None:
    store, weights = publish_steps(tmp_path, 6, keyframe_every=3)
    local = tmp_path / "local"
    materialize(local, store, 1)
    shutil.rmtree(store / "weight_v000002")  # the chain from the marker is broken
    res = materialize(local, store, 5)
    assert res.reseeded and res.seeded_from == 3 and res.applied == [3, 4, 5]
    assert read_local(local) == raw(weights[5])
    back = materialize(local, store, 3)  # backwards: reseed from the full version 3
    assert back.reseeded and read_local(local) == raw(weights[3])
    with pytest.raises(VersionNotFound):
        materialize(local, store, 9)
    with pytest.raises(VersionNotFound):
        materialize(tmp_path / "other", store, 2)  # 2 is gone and no full version precedes a complete chain


def test_a_full_version_inside_a_chain_copies_only_differing_tensors(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base")
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", keyframe_every=2, keep_last=None)
    trainer = Trainer(base)
    pub.publish(trainer.weights())
    pub.publish(trainer.step())
    materialize(tmp_path / "local", tmp_path / "store", 1)
    w = trainer.step(only=TWO)
    assert pub.publish(w).kind == "full"
    res = materialize(tmp_path / "local", tmp_path / "store", 2)
    assert not res.reseeded and sorted(res.changed) == sorted(TWO)
    assert read_local(tmp_path / "local") == raw(w)


def test_concurrent_calls_are_serialized(tmp_path: Path) -> None:
    store, weights = publish_steps(tmp_path, 3, keyframe_every=0)
    local = tmp_path / "local"
    results, errors = [], []

    def run(v: int) -> None:
        try:
            results.append(materialize(local, store, v))
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(3,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(r.version == 3 for r in results)
    assert sum(bool(r.applied) for r in results) == 1  # one did the work, the others found it done
    assert read_local(local) == raw(weights[3])


def test_pre_read_hook_sees_the_store_and_every_version_read(tmp_path: Path) -> None:
    store, _ = publish_steps(tmp_path, 2, keyframe_every=0)
    policy_helpers.HOOK_CALLS.clear()
    materialize(tmp_path / "local", store, 2, pre_read_hook="policy_helpers:record_hook")
    seen = [name for name, _ in policy_helpers.HOOK_CALLS]
    assert seen == ["store", "weight_v000000", "weight_v000001", "weight_v000002"]


def test_the_local_checkpoint_loads_with_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base")
    pub.publish(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    pub.publish({k: v for k, v in model.state_dict().items() if k in pub.specs})
    materialize(tmp_path / "local", tmp_path / "store", 1)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "local", torch_dtype=torch.bfloat16)
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name


# -- a replica killed mid-apply ----------------------------------------------------------------

_CHILD = "import sys; from rollfleet.policy_store import materialize; materialize(sys.argv[1], sys.argv[2], 3)"


def _kill_at(point: str, local: Path, store: Path) -> None:
    env = {**os.environ, **faults.env("pause", point)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(local), str(store)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == f"PAUSED {point}", line
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)


@pytest.mark.parametrize("point", ["apply:mid-version", "apply:before-marker"])
def test_a_replica_killed_mid_apply_never_applies_xor_twice(tmp_path: Path, point: str) -> None:
    store, weights = publish_steps(tmp_path, 3, keyframe_every=0, encoding="xor")
    local = tmp_path / "local"
    materialize(local, store, 1)
    _kill_at(point, local, store)
    assert read_marker(local) is None  # applied in place, so the marker is gone until it is verified
    res = materialize(local, store, 3)
    assert res.reseeded and res.seeded_from == 0 and res.applied == [0, 1, 2, 3]
    assert read_local(local) == raw(weights[3])


def test_a_replica_killed_while_seeding_recovers(tmp_path: Path) -> None:
    store, weights = publish_steps(tmp_path, 3, keyframe_every=0)
    local = tmp_path / "local"
    _kill_at("seed:mid-copy", local, store)
    assert read_marker(local) is None
    res = materialize(local, store, 3)
    assert res.reseeded and read_local(local) == raw(weights[3])
    assert not (local / STAGING).exists()


def test_a_marker_without_its_checkpoint_files_reseeds(tmp_path: Path) -> None:
    store, weights = publish_steps(tmp_path, 2, keyframe_every=0)
    local = tmp_path / "local"
    materialize(local, store, 1)
    os.unlink(local / "model.safetensors")
    res = materialize(local, store, 2)
    assert res.reseeded and read_local(local) == raw(weights[2])


def _fake_reboot(local: Path) -> None:
    marker = local / "rollfleet-version.json"
    doc = json.loads(marker.read_text())
    doc["boot_id"] = "an-earlier-boot"
    marker.write_text(json.dumps(doc))


def test_after_a_reboot_the_marker_is_trusted_only_if_every_tensor_verifies(tmp_path: Path) -> None:
    store, weights = publish_steps(tmp_path, 3, keyframe_every=0)
    local = tmp_path / "local"
    materialize(local, store, 2)
    _fake_reboot(local)
    res = materialize(local, store, 3)  # the bytes survived: continue the chain
    assert not res.reseeded and res.applied == [3]
    materialize(local, store, 2)
    _fake_reboot(local)
    with open(local / "model.safetensors", "r+b") as f:  # a write the power cut lost
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff\xff")
    res = materialize(local, store, 3)
    assert res.reseeded and read_local(local) == raw(weights[3])


def test_durable_mode_fsyncs_and_is_trusted_after_a_reboot(tmp_path: Path) -> None:
    store, weights = publish_steps(tmp_path, 2, keyframe_every=0)
    local = tmp_path / "local"
    materialize(local, store, 1, durable=True)
    _fake_reboot(local)
    res = materialize(local, store, 2, durable=True)
    assert not res.reseeded and read_local(local) == raw(weights[2])


def _other_store(root: Path, steps: int) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """A store at ``root/store`` with versions 0..steps whose bytes differ from every Chain's."""
    base = make_checkpoint(root / "base", seed=7)
    store = root / "store"
    pub = PolicyPublisher(store, root / "base", keyframe_every=0, keep_last=None)
    trainer = Trainer(base, seed=8)
    weights = [trainer.weights()]
    pub.publish(weights[0])
    for _ in range(steps):
        weights.append(trainer.step())
        pub.publish(weights[-1])
    return store, weights


@pytest.mark.parametrize("held", [1, 0])
def test_a_local_dir_reused_with_another_store_ends_with_that_stores_bytes(tmp_path: Path, held: int) -> None:
    a, _ = publish_steps(tmp_path / "a", 1, keyframe_every=0)
    b, b_weights = _other_store(tmp_path / "b", 1)
    local = tmp_path / "local"
    materialize(local, a, held)  # store A's version `held` (a marker for 1 equals the target below)
    res = materialize(local, b, 1)
    assert res.reseeded and res.version == 1 and read_marker(local) == 1
    assert read_local(local) == raw(b_weights[1])  # B's version 1, not A's
    assert materialize(local, b, 1).applied == []  # and from now on it is B's: nothing to redo


def test_a_store_recreated_by_another_run_is_not_taken_for_the_old_one(tmp_path: Path) -> None:
    store, _ = publish_steps(tmp_path / "run1", 1, keyframe_every=0)
    local = tmp_path / "local"
    materialize(local, store, 1)
    shutil.rmtree(store)  # the next run publishes into the same directory
    again, weights = _other_store(tmp_path / "run2", 1)
    shutil.move(again, store)
    res = materialize(local, store, 1)
    assert res.reseeded and read_local(local) == raw(weights[1])


def test_marker_matches_only_this_stores_version() -> None:
    from rollfleet.policy_store.materialize import marker_matches, store_identity

    sums = {"a": "xxh3-128:01", "b": "xxh3-128:02"}
    here = store_identity("/stores/a")
    assert marker_matches(here, sums, "/stores/a", {"a": "xxh3-128:01"})  # a delta that changed `a`
    assert marker_matches(here, sums, "/stores/a", None)  # the version was retired: the store decides
    assert not marker_matches(here, sums, "/stores/a", {"a": "xxh3-128:ff"})  # other bytes under that number
    assert not marker_matches(here, sums, "/stores/b", {"a": "xxh3-128:01"})  # another store
    assert not marker_matches(None, sums, "/stores/a", None)  # a marker that does not say its store
    assert "stores" not in here  # a digest: an address may carry secrets
