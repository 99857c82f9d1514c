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

    def __init__(self, base_dir: Path, seed: int, adopted: dict[int, int] | None = None) -> None:
        self.base_dir = Path(base_dir)
        self.seed = seed
        self._base = load_base(self.base_dir)
        self.names = sorted(self._base)
        self.adopted: dict[int, int] = {int(v): int(s) for v, s in (adopted or {}).items()}

    def adopting(self, adopted: dict[int, int]) -> TrainerWeights:
        """The lineage in which each version ``v`` of ``adopted`` is ``candidate(v, salt)`` (and
        later versions build on it); exactly ``adopted``, whatever this one adopted."""
        out = object.__new__(TrainerWeights)
        out.base_dir, out.seed, out._base, out.names = self.base_dir, self.seed, self._base, self.names
        out.adopted = {int(v): int(s) for v, s in adopted.items()}
        return out

    def at(self, version: int) -> dict[str, np.ndarray]:
        out = {n: t.copy() for n, t in self._base.items()}
        for v in range(1, version + 1):
            self._step(out, v)
            if v in self.adopted:
                perturb(out, self.names, v, self.seed, self.adopted[v])
        return out

    def candidate(self, version: int, salt: int) -> dict[str, np.ndarray]:
        """What a racing publisher seeded ``salt`` publishes as ``version``: this lineage's tensors
        at ``version``, perturbed (never equal to them)."""
        out = self.at(version)
        perturb(out, self.names, version, self.seed, salt)
        return out

    def _step(self, out: dict[str, np.ndarray], v: int) -> None:
        for name in changed_at(self.names, v, self.seed):
            t = out[name]
            rng = np.random.default_rng([self.seed, v, len(name)])
            flat = t.reshape(-1)
            idx = rng.integers(0, flat.size, max(1, flat.size // 40))
            flat[idx] = flat[idx] + rng.standard_normal(idx.size).astype(t.dtype) * t.dtype.type(0.02)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one object per run, a handful of versions
    def digest(self, version: int, fmt: str = "xxh3-128") -> str:
        """weights_digest of the trainer's tensors at ``version`` (computed here, not read from a replica)."""
        from rollfleet.policy_store import tensor_checksum
        from rollfleet.policy_store.digest import weights_digest

        return weights_digest({n: tensor_checksum(t, fmt) for n, t in self.at(version).items()})

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one object per run, a handful of versions
    def content_digest(self, version: int, fmt: str = "xxh3-128") -> bytes:
        """content_digest of the trainer's tensors at ``version``, as a replay coordinate records
        it (each tensor's checksum as ``"fmt:hex"``, as a store publishes it), computed here."""
        from rollfleet.policy_store import tensor_checksum
        from rollfleet.policy_store.digest import content_digest

        return content_digest({n: f"{fmt}:{tensor_checksum(t, fmt)}" for n, t in self.at(version).items()})


def perturb(tensors: dict[str, np.ndarray], names: list[str], version: int, seed: int, salt: int) -> None:
    """Move a few entries of one or two tensors, in place, by a stream of (seed, version, salt)'s
    own: a publisher's different idea of ``version`` (each moved entry changes by 0.125 or more)."""
    rng = np.random.default_rng([seed, version, int(salt), 11])
    k = int(rng.integers(1, min(2, len(names)) + 1))
    for name in sorted(rng.choice(sorted(names), size=k, replace=False).tolist()):
        t = tensors[name]
        flat = t.reshape(-1)
        idx = np.unique(rng.integers(0, flat.size, max(1, flat.size // 50)))
        flat[idx] = flat[idx] + t.dtype.type(0.125) + np.abs(rng.standard_normal(idx.size)).astype(t.dtype)
