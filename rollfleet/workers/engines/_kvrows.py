"""KV-cache rows for the hf engine: a batch cache assembled from per-sequence rows.

A batch cache is a transformers ``DynamicCache`` (per layer, keys and values of shape
``[rows, kv_heads, width, head_dim]``) with a ``[rows, width]`` mask: 1 where the column holds
the KV of one of the row's tokens, in order. Columns are only ever added to the right (decode)
or padded on the left (merging rows of another width), so a row's masked columns are its tokens'
KV in sequence order, whatever its padding; positions are explicit (a row's next position is the
sum of its mask), and keys already carry their rotary embedding, so padding never changes what
attention computes. Only full-attention layers (``DynamicLayer``) can be handled this way;
``supported`` says whether a model's cache is made of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [rows, heads, width, dim]


def supported(config: Any) -> bool:
    """Whether every layer of ``config``'s cache is a plain full-attention ``DynamicLayer``."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def tensors(cache: Any) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def build(kv: KV) -> DynamicCache:
    """A cache holding ``kv`` itself: the layers are made on empty slices (DynamicCache copies what it
    is given), then handed the tensors."""
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in kv])
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        layer.keys, layer.values = k, v
    return cache


def nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def select_rows(cache: Any, mask: torch.Tensor, rows: Sequence[int], *, compact: bool) -> tuple[Any, torch.Tensor]:
    """Keep ``rows`` (in that order, repeats allowed); with ``compact`` (full-attention layers only),
    drop the columns no row uses any more."""
    idx = torch.tensor(list(rows), dtype=torch.long, device=mask.device)
    cache.batch_select_indices(idx)
    mask = mask.index_select(0, idx)
    used = mask.any(dim=0)
    if compact and not bool(used.all()):
        cols = used.nonzero().squeeze(1)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(2, cols)
            layer.values = layer.values.index_select(2, cols)
        mask = mask.index_select(1, cols)
    return cache, mask


def row(cache: Any, mask: torch.Tensor, i: int) -> KV:
    """Row ``i``'s KV without padding, ``[1, heads, tokens, dim]`` per layer (a copy, not a view)."""
    cols = mask[i].nonzero().squeeze(1)
    return [(k[i : i + 1].index_select(2, cols), v[i : i + 1].index_select(2, cols)) for k, v in tensors(cache)]


def _pad_left(t: torch.Tensor, width: int, dim_from_end: int) -> torch.Tensor:
    short = width - t.shape[-dim_from_end]
    if short == 0:
        return t
    return F.pad(t, (0, 0) * (dim_from_end - 1) + (short, 0))


def merge(a: Any, mask_a: torch.Tensor, b: Any, mask_b: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """Rows of ``a`` then rows of ``b`` in one cache, the narrower side padded on the left."""
    width = max(mask_a.shape[1], mask_b.shape[1])
    kv = [
        (
            torch.cat([_pad_left(ka, width, 2), _pad_left(kb, width, 2)]),
            torch.cat([_pad_left(va, width, 2), _pad_left(vb, width, 2)]),
        )
        for (ka, va), (kb, vb) in zip(tensors(a), tensors(b), strict=True)
    ]
    return build(kv), torch.cat([_pad_left(mask_a, width, 1), _pad_left(mask_b, width, 1)])


def past(prefixes: Sequence[tuple[KV, int]], device: torch.device) -> tuple[Any, torch.Tensor]:
    """A cache whose row ``r`` holds the first ``n`` columns of ``prefixes[r] = (kv, n)``, right-aligned
    (an empty prefix is all padding). At least one prefix must be non-empty."""
    width = max(n for _, n in prefixes)
    template = next(kv for kv, n in prefixes if n)
    mask = torch.zeros((len(prefixes), width), dtype=torch.long, device=device)
    out: KV = []
    for layer, (k0, v0) in enumerate(template):
        keys = k0.new_zeros((len(prefixes), k0.shape[1], width, k0.shape[3]))
        values = v0.new_zeros((len(prefixes), v0.shape[1], width, v0.shape[3]))
        for r, (kv, n) in enumerate(prefixes):
            if n:
                keys[r, :, width - n :] = kv[layer][0][0, :, :n]
                values[r, :, width - n :] = kv[layer][1][0, :, :n]
        out.append((keys, values))
    for r, (_, n) in enumerate(prefixes):
        if n:
            mask[r, width - n :] = 1
    return build(out), mask
