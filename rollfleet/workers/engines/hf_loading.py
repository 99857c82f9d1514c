"""Loading the hf engine's model and tokenizer from a host-local checkpoint directory.

``load_model`` reads the checkpoint with transformers onto the engine's device and returns what
the engine needs to know of it (``LoadedModel``): the model, its forward's cache keyword, whether
its KV can be assembled from rows, the tensor names the checkpoint stores, vocabulary, context
length, end-of-sequence tokens and the tokenizer, if the directory has one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import torch

from rollfleet.workers.engines import _kvrows, _weights

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
try:
    TRANSFORMERS_VERSION = package_version("transformers")
except PackageNotFoundError:
    TRANSFORMERS_VERSION = ""


def device_kind(device: torch.device) -> str:
    """``cpu``, or ``cuda:`` and the device's name (kernels, and so bits, differ between models)."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_name(device)}"


def own_memory(model: Any) -> None:
    """Copy every CPU tensor out of the checkpoint's memory map.

    transformers maps safetensors files on CPU, so the live weights would alias the checkpoint
    files, and the replica's in-place materialization of the next version (while we serve)
    would change them outside any pause. Tied parameters are one object, so they stay tied.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None:
                    setattr(module, name, buf.clone())


@dataclass
class LoadedModel:
    model: Any
    cache_kw: str  # the forward's name for the KV cache
    rows: bool  # whether the model's cache can be assembled from rows
    stored: list[str]  # the tensor names the checkpoint stores
    vocab: int
    max_len: int  # the model's context, in tokens
    eos: frozenset[int]
    tokenizer: Any  # None: the directory has none (requests send token ids)


def load_model(
    checkpoint_dir: Path, device: torch.device, dtype: str | None, attn_implementation: str | None
) -> LoadedModel:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": dtype or "auto", "local_files_only": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), **kwargs)
    model.to(device).eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        own_memory(model)
    # transformers 5.x renamed the forward's ``past_key_values`` to ``cache``; accept both.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cfg = model.config
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(cfg, "eos_token_id", None)
    tokenizer = None
    if any((checkpoint_dir / f).exists() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True)
    return LoadedModel(
        model=model,
        cache_kw=cache_kw,
        rows=_kvrows.supported(model.config),
        stored=list(_weights.tensor_files(checkpoint_dir)),
        vocab=int(cfg.vocab_size),
        max_len=int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30),
        eos=frozenset([eos] if isinstance(eos, int) else (eos or [])),
        tokenizer=tokenizer,
    )
