"""Build small (or large, randomly initialised) causal LMs from a config on the spot.

No downloads: a preset names a Qwen3- or Llama-shaped config, weights are drawn from a
seeded generator, and the result is an ordinary Hugging Face checkpoint directory
(``config.json``, ``generation_config.json``, safetensors shards + index). Token ids are
the interface, so no tokenizer is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# Shapes only; every preset is a plain dict of config fields so callers can tweak them.
PRESETS: dict[str, dict[str, Any]] = {
    # ~254 K params: tests and the demo.
    "tiny": dict(
        arch="qwen3",
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    # ~0.10 B params (activation-pause benchmark on CPU).
    "0.1b": dict(
        arch="qwen3",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # ~0.47 B params.
    "0.5b": dict(
        arch="qwen3",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # Qwen3-4B's published shape (~4.02 B params), for the GPU activation benchmark.
    "qwen3-4b": dict(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
PRESETS["llama-tiny"] = {**PRESETS["tiny"], "arch": "llama"}  # the same shapes, another family

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Default special ids: small enough for every preset's vocabulary.
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0


def model_config(preset: str = "tiny", **overrides: Any):  # -> transformers.PretrainedConfig
    """The transformers config for ``preset`` (field ``overrides`` win)."""
    from transformers import LlamaConfig, Qwen3Config

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    fields = {**PRESETS[preset], **overrides}
    arch = fields.pop("arch")
    rope_theta = fields.pop("rope_theta", 10_000.0)
    fields.setdefault("bos_token_id", BOS_ID)
    fields.setdefault("eos_token_id", EOS_ID)
    fields.setdefault("pad_token_id", PAD_ID)
    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    config = cls(**fields)
    # transformers 5 keeps rope settings in rope_parameters; older versions in rope_theta.
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters["rope_theta"] = rope_theta
    else:
        config.rope_theta = rope_theta
    return config


def param_count(preset: str = "tiny") -> int:
    """Number of stored parameters (tied embeddings counted once)."""
    return sum(t.numel() for t in _layout(model_config(preset)).values())


def _layout(config) -> dict[str, torch.Size]:
    """Names and shapes of the tensors a checkpoint of ``config`` stores, without allocating."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # stored once, under the embedding's name
    return shapes


def _init_tensor(name: str, shape: torch.Size, std: float, gen: torch.Generator, device: str) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)  # RMSNorm gains start at one, as in training
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    return torch.randn(shape, generator=gen, device=device) * std


def build_model_dir(
    path: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    *,
    init_device: str = "cpu",
    max_shard_bytes: int = 2 * 1024**3,
    **overrides: Any,
) -> Path:
    """Write a randomly initialised ``preset`` model as an HF checkpoint dir at ``path``.

    Deterministic for a given (preset, seed, dtype, init_device). ``init_device="cuda"``
    draws the random numbers on the GPU, much faster for the 4B shape.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}")
    torch_dtype = _DTYPES[dtype]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(preset, **overrides)
    config.dtype = dtype
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    gen = torch.Generator(device=init_device).manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, shape in _layout(config).items():
        t = _init_tensor(name, shape, std, gen, init_device).to(torch_dtype).cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += nbytes

    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    config.save_pretrained(out)
    _write_generation_config(out, config)
    return out


def _write_generation_config(out: Path, config) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
    ).save_pretrained(out)


def load_model_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors files, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors
