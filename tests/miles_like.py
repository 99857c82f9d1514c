"""One rank of a miles-shaped disk-delta trainer, for the integration tests.

It follows the call sequence of miles' ``UpdateWeightFromDiskDelta`` (radixark/miles,
``update_weight_from_distributed/delta.py``) with real ``torch.distributed`` (gloo) ranks:

- the first ``update_weights`` only captures the baseline: rank 0 deletes and recreates
  ``--update-weight-disk-dir``, then calls the post-write hook with that directory itself;
  every rank snapshots its tensors from ``--hf-checkpoint``;
- each later one numbers the version ``weight_version += 1`` (1, 2, ... on every run), diffs
  each rank's tensors against its snapshot (``xor`` or ``overwrite``, one zstd frame each,
  the new state's checksum in the shard's ``__metadata__``), writes one shard per rank that
  changed something (``model-<offset>-of-<total>.safetensors``, numbered over gloo), rank 0
  writes the index last, a barrier, then the hook runs on *every* rank as
  ``hook(args, version_dir, rollout_engines)``, and a barrier.

The hook is loaded from its dotted path as miles' ``load_function`` does, and the rollfleet
settings arrive as ``args`` attributes, as miles' ``--custom-config-path`` sets them. Each rank
saves the full bytes of its tensors after every version to ``--expected`` for the test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import xxhash
import zstandard
from safetensors.numpy import save as save_np
from safetensors.torch import load_file, save_file


def checksum(algorithm: str, data: np.ndarray) -> str:
    if algorithm == "adler32":
        return f"{zlib.adler32(data.tobytes(), 1):08x}"
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(data.tobytes()).hexdigest()
    return xxhash.xxh3_128(data.tobytes()).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_hook(path: str):  # type: ignore[no-untyped-def]
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--pg-file", required=True)
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--disk-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expected", required=True)
    p.add_argument("--config", required=True, help="JSON of rollfleet_* settings (what --custom-config-path sets)")
    p.add_argument("--encoding", default="xor")
    p.add_argument("--checksum", default="xxh3-128")
    p.add_argument("--hook", default="rollfleet.integrations.miles.post_write_hook")
    p.add_argument("--crash-before-hook", type=int, default=0, help="exit after writing this version's files")
    p.add_argument("--kill-in-commit", type=int, default=0, help="SIGKILL rank 0 inside this version's commit")
    a = p.parse_args()

    dist.init_process_group("gloo", init_method=f"file://{a.pg_file}", rank=a.rank, world_size=a.world)
    args = argparse.Namespace(
        update_weight_disk_dir=a.disk_dir,
        hf_checkpoint=a.hf_checkpoint,
        update_weight_delta_encoding=a.encoding,
        update_weight_delta_checksum=a.checksum,
        custom_update_weight_post_write_path=a.hook,
    )
    for key, value in json.loads(a.config).items():
        setattr(args, key, value)
    hook = load_hook(args.custom_update_weight_post_write_path)
    delta_dir = Path(args.update_weight_disk_dir)
    os.makedirs(delta_dir, exist_ok=True)

    # The "model": this rank owns every world-th tensor of the HF checkpoint (think PP stages).
    hf = load_file(str(Path(a.hf_checkpoint) / "model.safetensors"))
    names = sorted(hf)[a.rank :: a.world]
    params = {n: hf[n].clone() for n in names}

    # update_weights() #1: the baseline only.
    if dist.get_rank() == 0:
        shutil.rmtree(delta_dir, ignore_errors=True)
        os.makedirs(delta_dir, exist_ok=True)
        hook(args, str(delta_dir), [])
    dist.barrier()
    snapshot = {n: hf[n].contiguous().view(-1).view(torch.uint8).numpy().copy() for n in names}

    g = torch.Generator().manual_seed(a.seed * 1000 + a.rank)
    expected = Path(a.expected)
    expected.mkdir(parents=True, exist_ok=True)
    for weight_version in range(1, a.steps + 1):
        for i, n in enumerate(names):  # a "training step": some tensors change, a few elements each
            if (weight_version + i) % 3 == 0:
                continue
            flat = params[n].view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[idx] = (flat[idx].float() + torch.randn(idx.numel(), generator=g) * 0.1).to(flat.dtype)
        version_dir = delta_dir / f"weight_v{weight_version:06d}"
        if a.rank == 0:
            os.makedirs(version_dir, exist_ok=True)
        dist.barrier()
        delta: dict[str, np.ndarray] = {}
        sums: dict[str, str] = {}
        for n in names:
            new = params[n].contiguous().view(-1).view(torch.uint8).numpy().copy()
            old = snapshot[n]
            if a.encoding == "xor":
                diff = new ^ old
                changed = int(np.count_nonzero(diff))
            else:
                mask = new != old
                changed = int(np.count_nonzero(mask))
                pos = np.flatnonzero(mask).astype("<u4")
                diff = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), new[mask]])
            snapshot[n] = new
            if changed:
                delta[n] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(diff.tobytes()), np.uint8)
                sums[n] = checksum(a.checksum, new)
        counts: list = [None] * a.world
        dist.all_gather_object(counts, int(bool(delta)))
        offset, total = sum(counts[: a.rank]), sum(counts)
        fname = None
        if delta:
            fname = f"model-{offset:05d}-of-{total:05d}.safetensors"
            atomic_write(version_dir / fname, save_np(delta, metadata=sums))
        maps: list = [None] * a.world
        dist.all_gather_object(maps, dict.fromkeys(delta, fname))
        if a.rank == 0:
            index = {
                "metadata": {
                    "version": f"{weight_version:06d}",
                    "base_version": f"{weight_version - 1:06d}",
                    "delta_encoding": a.encoding,
                    "compression_format": "zstd",
                    "checksum_format": a.checksum,
                },
                "weight_map": {n: f for m in maps for n, f in m.items()},
            }
            atomic_write(version_dir / "model.safetensors.index.json", json.dumps(index).encode())
        dist.barrier()
        save_file(
            {n: t.contiguous() for n, t in params.items()}, str(expected / f"v{weight_version}-r{a.rank}.safetensors")
        )
        if weight_version == a.crash_before_hook:
            os._exit(3)
        if weight_version == a.kill_in_commit and a.rank == 0:
            os.environ["ROLLFLEET_FAULT"] = "kill:commit:before-cas"
        hook(args, str(version_dir), [])  # on every rank, as miles does
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
