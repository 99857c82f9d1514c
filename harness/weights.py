"""A small model-free checkpoint and a deterministic trainer, for policy scenarios without torch.

``tensors_at(v)`` is a pure function of the version, so a restarted trainer (or a test) agrees
with what was published; ``expected_digest(v)`` is what a replica at ``v`` must hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TENSORS = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "lm_head.weight": (256, 64),
}


def base_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shape).astype(np.float32) for n, shape in TENSORS.items()}


def tensors_at(version: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The trainer's weights at ``version``: a deterministic function, so a restarted trainer agrees."""
    out = base_tensors(seed)
    for v in range(1, version + 1):
        rng = np.random.default_rng(1000 * seed + v)
        for t in out.values():
            flat = t.reshape(-1)
            idx = rng.integers(0, flat.size, max(1, flat.size // 50))
            flat[idx] += rng.standard_normal(idx.size).astype(np.float32) * 0.01
    return out


def write_base_checkpoint(path: Path, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "reliability-test"}))
    save_file(base_tensors(seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def expected_digest(version: int, seed: int = 0, fmt: str = "xxh3-128") -> str:
    """weights_digest of the trainer's tensors at ``version`` (what a converged replica holds)."""
    from rollfleet.policy_store import tensor_checksum
    from rollfleet.policy_store.digest import weights_digest

    return weights_digest({n: tensor_checksum(t, fmt) for n, t in tensors_at(version, seed).items()})


def local_digest(local_dir: Path, fmt: str = "xxh3-128") -> str:
    """weights_digest of the bytes in a replica's host-local checkpoint."""
    from rollfleet.policy_store import CheckpointLayout, tensor_checksum
    from rollfleet.policy_store.digest import weights_digest

    layout = CheckpointLayout.read(local_dir)
    sums = {}
    for name, loc in layout.tensors.items():
        with open(loc.file, "rb") as f:
            f.seek(loc.offset)
            sums[name] = tensor_checksum(np.frombuffer(f.read(loc.nbytes), np.uint8), fmt)
    return weights_digest(sums)
