"""The adversary's trainer weights: a pure function of (base checkpoint, seed, version).

Each version changes a few whole tensors only (one to three, chosen by the version's own
random stream), so consecutive deltas touch different tensors: what a replica must reload
depends on what it actually holds, which is where a marker that ran ahead of the engine shows
(issue 19, item 1). The oracle computes the digest a replica at version ``v`` must announce
from these tensors alone, never from the store or from a replica.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np


def load_base(base_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors checkpoint directory, as numpy arrays."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(base_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise FileNotFoundError(f"no safetensors files in {base_dir}")
    return out


def changed_at(names: list[str], version: int, seed: int) -> list[str]:
    """The tensors version ``version`` changes (none for the base, version 0)."""
    if version <= 0:
        return []
    rng = np.random.default_rng([seed, version, 7])
    k = int(rng.integers(1, min(3, len(names)) + 1))
    return sorted(rng.choice(sorted(names), size=k, replace=False).tolist())


class TrainerWeights:
    """``at(v)``: the trainer's tensors at version ``v``; ``digest(v)``: their weights digest."""

    def __init__(self, base_dir: Path, seed: int) -> None:
        self.base_dir = Path(base_dir)
        self.seed = seed
        self._base = load_base(self.base_dir)
        self.names = sorted(self._base)

    def at(self, version: int) -> dict[str, np.ndarray]:
        out = {n: t.copy() for n, t in self._base.items()}
        for v in range(1, version + 1):
            for name in changed_at(self.names, v, self.seed):
                t = out[name]
                rng = np.random.default_rng([self.seed, v, len(name)])
                flat = t.reshape(-1)
                idx = rng.integers(0, flat.size, max(1, flat.size // 40))
                flat[idx] = flat[idx] + rng.standard_normal(idx.size).astype(t.dtype) * t.dtype.type(0.02)
        return out

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one object per run, a handful of versions
    def digest(self, version: int, fmt: str = "xxh3-128") -> str:
        """weights_digest of the trainer's tensors at ``version`` (computed here, not read from a replica)."""
        from rollfleet.policy_store import tensor_checksum
        from rollfleet.policy_store.digest import weights_digest

        return weights_digest({n: tensor_checksum(t, fmt) for n, t in self.at(version).items()})
