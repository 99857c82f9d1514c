"""What the vllm engine's tests share beyond ``harness.vllm`` (the cached vLLM
environment, the model, the server): the trainer-side view of weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

import harness.vllm as harness
from harness.vllm import (  # noqa: F401  (re-exported for the tests)
    BLOCK,
    LAUNCH_ARGS,
    MODEL,
    PYTHON,
    SERVER_ENV_CPU,
    VENV,
    Server,
    build_model,
    unavailable,
    write_version,
)
from rollfleet.models import load_model_tensors as load_tensors  # noqa: F401  (for the tests)
from rollfleet.workers.engines.vllm import EMPTY_SHA256


def perturb(tensors: dict[str, torch.Tensor], seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A clearly different version: every weight matrix moved by noise of ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v + torch.randn(v.shape, generator=gen) * scale if v.dim() == 2 else v.clone()) for k, v in tensors.items()
    }


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def expected_vllm_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """What vLLM's /weight_checker should say for the trainer's ``tensors``: its fused parameters
    (``qkv_proj`` = q, k, v stacked; ``gate_up_proj`` = gate, up) hashed as vLLM hashes them."""
    out = {name: sha256(t) for name, t in tensors.items()}
    for prefix in {n.rsplit(".self_attn.", 1)[0] for n in tensors if ".self_attn.q_proj." in n}:
        a, m = f"{prefix}.self_attn.", f"{prefix}.mlp."
        qkv = [tensors[a + p + "_proj.weight"] for p in "qkv"]
        out[a + "qkv_proj.weight"] = sha256(torch.cat(qkv))
        out[m + "gate_up_proj.weight"] = sha256(
            torch.cat([tensors[m + "gate_proj.weight"], tensors[m + "up_proj.weight"]])
        )
    return out


def comparable(live: dict[str, str]) -> dict[str, str]:
    """The parameters vLLM's checker can vouch for: on CPU, linear layers repacked for the GEMM
    kernels hash as empty."""
    return {name: digest for name, digest in live.items() if digest != EMPTY_SHA256}


def restarted(server: Server, model: Path) -> Server:
    """A vLLM server on the port ``server`` (stopped) had, launched on ``model``: an attached server
    that came back after a crash, at the same URL."""
    chosen = harness.free_port
    harness.free_port = lambda: server.port  # the harness picks a fresh port otherwise
    try:
        return Server(model, server.log)
    finally:
        harness.free_port = chosen
