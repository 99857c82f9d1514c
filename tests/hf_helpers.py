"""Helpers for the hf engine's tests: publishing changed tensors into a checkpoint, and waiting for steps."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollfleet.workers.engines.hf import HFEngine

CHANGED = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]


def publish(ckpt: Path, tensors: dict[str, torch.Tensor], shard: str = "model-v1.safetensors") -> None:
    """Write changed tensors as a new shard and point the index at it (what a materializer leaves)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(ckpt / shard), metadata={"format": "pt"})
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: shard for name in tensors})
    index_path.write_text(json.dumps(index))


def perturbed(engine: HFEngine, names: list[str], density: float = 0.05, seed: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        t = engine.live_tensor(name).clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(density * flat.numel()))]
        flat[idx] += torch.randn(idx.numel(), generator=gen) * 0.5
        out[name] = t
    return out


async def wait_steps(engine: HFEngine, n: int, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while engine.steps < n:  # noqa: ASYNC110 - polling a counter the engine owns
            await asyncio.sleep(0.001)
