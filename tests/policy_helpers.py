"""Small real checkpoints and simulated RL steps for the policy store tests."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollfleet.policy_store.layout import CheckpointLayout


def make_checkpoint(root: Path, seed: int = 0, sharded: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint with bf16, fp32 and int8 tensors, one of a few MB; returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(1536, 1024, generator=g).to(torch.bfloat16),  # 3 MiB
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 256, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(256),
        "model.layers.0.quant.weight": torch.randint(-128, 127, (333,), generator=g, dtype=torch.int8),
        "lm_head.bias": torch.zeros(7, dtype=torch.bfloat16),
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "test", "hidden_size": 256}))
    (root / "tokenizer.json").write_text("{}")
    if sharded:
        names = sorted(tensors)
        half = {n: tensors[n] for n in names[:3]}, {n: tensors[n] for n in names[3:]}
        weight_map = {}
        for i, part in enumerate(half):
            fname = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file(part, str(root / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        )
    else:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return tensors


class Trainer:
    """fp32 master weights, a small update per step, cast to the published dtype (like an RL step)."""

    def __init__(self, tensors: dict[str, torch.Tensor], seed: int = 1, scale: float = 3e-3) -> None:
        self.dtypes = {n: t.dtype for n, t in tensors.items()}
        self.master = {n: t.float().clone() for n, t in tensors.items()}
        self.g = torch.Generator().manual_seed(seed)
        self.scale = scale

    def step(self, only: list[str] | None = None) -> dict[str, torch.Tensor]:
        for name, m in self.master.items():
            if self.dtypes[name] == torch.int8:
                if only is None or name in only:
                    m[torch.randint(0, m.numel(), (3,), generator=self.g)] += 1
                    m.clamp_(-128, 127)
                continue
            if only is None or name in only:
                m.add_(torch.randn(m.shape, generator=self.g) * self.scale * (m.abs() + 1e-2))
        return self.weights()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: m.to(self.dtypes[n], copy=True) for n, m in self.master.items()}


def read_local(root: Path) -> dict[str, bytes]:
    """Raw bytes of every tensor in a checkpoint directory."""
    layout = CheckpointLayout.read(root)
    out = {}
    for name, loc in layout.tensors.items():
        with open(loc.file, "rb") as f:
            f.seek(loc.offset)
            out[name] = f.read(loc.nbytes)
    return out


def raw(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


def forge_version(
    store: Path,
    version: int,
    meta: dict[str, object],
    frames: dict[str, bytes],
    checksums: dict[str, str],
    weight_map: dict[str, str] | None = None,
    shard: str = "model-00000-of-00001.safetensors",
) -> Path:
    """Write a version directory by hand, the way a foreign (or hostile) publisher might."""
    import numpy as np
    from safetensors.numpy import save_file as save_np

    path = store / f"weight_v{version:06d}"
    path.mkdir(parents=True)
    arrays = {n: np.frombuffer(f, np.uint8).copy() for n, f in frames.items()}
    save_np(arrays, str(path / shard), metadata=dict(checksums))
    wmap = weight_map if weight_map is not None else dict.fromkeys(frames, shard)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": meta, "weight_map": wmap}))
    return path


HOOK_CALLS: list[tuple[str, object]] = []


def record_hook(path: Path, record: object = None) -> None:
    """An importable storage hook (``policy_helpers:record_hook``) that logs its calls."""
    HOOK_CALLS.append((Path(path).name, getattr(record, "version", None)))


def stuck_read_hook(path: Path, *args: object) -> None:
    """A pre-read hook (``policy_helpers:stuck_read_hook``) that hangs on every version after 0,
    like a read from a wedged mount."""
    name = Path(path).name
    if name.startswith("weight_v") and name != "weight_v000000":
        threading.Event().wait()


class Chain:
    """A base checkpoint under ``tmp/base``, a publisher into ``tmp/store`` that has recorded it as
    version 0, and a trainer whose ``step()`` makes (and by default publishes) the next weights."""

    def __init__(self, tmp: Path, sharded: bool = False, **publisher: object) -> None:
        from rollfleet.policy_store.publisher import PolicyPublisher

        self.base = make_checkpoint(tmp / "base", sharded=sharded)
        self.store = tmp / "store"
        publisher.setdefault("keep_last", None)
        self.pub = PolicyPublisher(self.store, tmp / "base", **publisher)  # type: ignore[arg-type]
        self.trainer = Trainer(self.base)
        self.weights = [self.trainer.weights()]
        self.pub.publish(self.weights[0])

    def step(self, only: list[str] | None = None, publish: bool = True) -> dict[str, torch.Tensor]:
        self.weights.append(self.trainer.step(only))
        if publish:
            self.pub.publish(self.weights[-1])
        return self.weights[-1]


def kill_at_pause(code: str, point: str) -> None:
    """Run ``python -c code`` with the fault ``pause:<point>`` and SIGKILL it once it pauses there."""
    import os
    import signal
    import subprocess
    import sys

    from rollfleet.runtime import faults

    env = {**os.environ, **faults.env("pause", point)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        assert line == f"PAUSED {point}", f"the child did not reach {point}: {line!r}"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
