"""The store is read by workers running as other users (containers, other hosts): version 0,
recorded from the trainer's base checkpoint, must be as readable as every other version."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from policy_helpers import Trainer, make_checkpoint

from rollfleet.policy_store import materialize
from rollfleet.trainer_client import PolicyPublisher

SHARD = "model.safetensors"


def test_a_private_base_file_is_copied_readable_and_left_as_it_was(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base")
    src = tmp_path / "base" / SHARD
    os.chmod(src, 0o600)  # what safetensors' save_file writes
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", keyframe_every=0, keep_last=None)
    pub.publish(Trainer(base).weights())
    stored = tmp_path / "store" / "weight_v000000" / SHARD
    assert stat.S_IMODE(os.stat(src).st_mode) == 0o600, "the trainer's checkpoint was changed"
    assert not os.path.samefile(src, stored)
    assert os.stat(stored).st_mode & stat.S_IROTH, "version 0 is unreadable for a worker of another user"
    assert stored.read_bytes() == src.read_bytes()
    assert materialize(tmp_path / "local", tmp_path / "store", 0).version == 0


def test_a_world_readable_base_file_is_still_linked(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base")
    src = tmp_path / "base" / SHARD
    os.chmod(src, 0o644)
    pub = PolicyPublisher(tmp_path / "store", tmp_path / "base", keyframe_every=0, keep_last=None)
    pub.publish(Trainer(base).weights())
    assert os.path.samefile(src, tmp_path / "store" / "weight_v000000" / SHARD)  # no copy of the weights
