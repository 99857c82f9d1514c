"""Weight publication: encode/apply throughput, wire bytes and apply memory, against same-run baselines.

A bf16 model (>= 1 GiB; ~64 MiB with --quick) takes one simulated RL step per density: fp32
master weights plus a small multiplicative update, cast to bf16, calibrated so that 0.25 %, 1 %
and 3 % of the bf16 elements change. For each delta encoding we time ``PolicyPublisher.publish``
(encode + write + fsync) and ``materialize`` (apply in place + verify + fsync), in model bytes per
second, against

- ``numpy.copyto`` of the same bytes (the memory-bandwidth ceiling), and
- a straightforward single-threaded per-tensor baseline: XOR, zstd level 1, xxh3-128 (and the
  same file writes / mmap application), which is what the target ratio is measured against.

Wire bytes per encoding are compared with xor+zstd-1. Peak memory while applying is measured in
a child process: anonymous RSS (heap) sampled during the apply, and VmHWM growth; the mmap'd
checkpoint pages are file-backed page cache, not process memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard as zstd

from benchmarks.report import Row
from rollfleet.policy_store import materialize
from rollfleet.policy_store.layout import CheckpointLayout, TensorSpec, write_shard
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.policy_store.writer import write_file

DENSITIES = (0.0025, 0.01, 0.03)
ENCODINGS = ("xor", "overwrite", "rf-sparse-xor")
BASELINE = "1-thread xor+zstd1+xxh3"


def model_shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    """A Llama-like layout: ~1.17 GB of bf16 (or ~67 MB with quick)."""
    h, inter, vocab, layers = (512, 1376, 8000, 8) if quick else (2048, 5504, 32000, 9)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (h, h)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    return shapes


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def calibrate(density: float) -> float:
    """Relative update size r such that bf16(w + r*|w|*N(0,1)) differs from bf16(w) at ``density``."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 20, generator=g) * 0.02
    noise = torch.randn(1 << 20, generator=g)
    lo, hi = 1e-6, 1.0
    for _ in range(40):
        r = (lo * hi) ** 0.5
        changed = ((w + noise * w.abs() * r).to(torch.bfloat16) != w.to(torch.bfloat16)).float().mean().item()
        lo, hi = (r, hi) if changed < density else (lo, r)
    return (lo * hi) ** 0.5


class Model:
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        g = torch.Generator().manual_seed(1)
        self.master = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
        self.g = g

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: m.to(torch.bfloat16) for n, m in self.master.items()}

    def step(self, r: float) -> dict[str, torch.Tensor]:
        for m in self.master.values():
            noise = torch.randn(m.shape, generator=self.g)
            m.add_(noise.mul_(m.abs()).mul_(r))
        return self.bf16()


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text("{}")
    items = [(n, TensorSpec("BF16", tuple(t.shape)), _bits(t)) for n, t in tensors.items()]
    (root / "model.safetensors").unlink(missing_ok=True)  # a new inode: a store may hard-link the old one
    write_file(root / "model.safetensors", lambda f: write_shard(f, items, {"format": "pt"}))


# -- baselines ---------------------------------------------------------------------------------


def baseline_encode(new: dict[str, np.ndarray], old: dict[str, np.ndarray], out: Path) -> float:
    t0 = time.perf_counter()
    frames, sums = [], {}
    for name, n in new.items():
        x = np.bitwise_xor(n, old[name])
        frames.append((name, TensorSpec("U8", (0,)), zstd.ZstdCompressor(level=1).compress(x)))
        sums[name] = xxhash.xxh3_128_hexdigest(n)
        np.copyto(old[name], n)
    frames = [(n, TensorSpec("U8", (len(f),)), f) for n, _, f in frames]
    write_file(out, lambda f: write_shard(f, frames, sums))
    return time.perf_counter() - t0


def baseline_apply(local: Path, frames: dict[str, bytes], flush: bool = False) -> float:
    layout = CheckpointLayout.read(local)
    t0 = time.perf_counter()
    mm = np.memmap(local / "model.safetensors", dtype=np.uint8, mode="r+")
    for name, frame in frames.items():
        loc = layout.tensors[name]
        dst = mm[loc.offset : loc.offset + loc.nbytes]
        delta = np.frombuffer(zstd.ZstdDecompressor().decompress(frame), np.uint8)
        np.bitwise_xor(dst, delta, out=dst)
        xxhash.xxh3_128_hexdigest(dst)
    if flush:
        mm.flush()
        fd = os.open(local / "model.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    del mm
    return time.perf_counter() - t0


def copyto_seconds(new: dict[str, np.ndarray]) -> float:
    dst = {n: np.empty_like(a) for n, a in new.items()}
    for n, a in new.items():  # fault the pages in first: we want bandwidth, not page faults
        np.copyto(dst[n], a)
    t0 = time.perf_counter()
    for n, a in new.items():
        np.copyto(dst[n], a)
    return time.perf_counter() - t0


# -- peak memory -------------------------------------------------------------------------------

_PEAK_CHILD = """
import json, sys, threading, time
from rollfleet.policy_store import materialize
def field(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0
peak, stop = [0], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], field("RssAnon:"))
        time.sleep(0.002)
start_anon, start_hwm = field("RssAnon:"), field("VmHWM:")
t = threading.Thread(target=sample); t.start()
materialize(sys.argv[1], sys.argv[2], int(sys.argv[3]))
stop.set(); t.join()
print(json.dumps({"anon_peak": peak[0] - start_anon, "hwm_growth": field("VmHWM:") - start_hwm}))
"""


def peak_apply_memory(local: Path, store: Path, version: int) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(local), str(store), str(version)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# -- the run -----------------------------------------------------------------------------------


def _seed_copy(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


def _time_publish(tmp: Path, enc: str, prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], trials: int):
    """Best-of-``trials`` publish time of ``new`` over a store whose version 0 is ``prev``."""
    best, rec = float("inf"), None
    for i in range(trials):
        store = tmp / f"store-{enc}"
        shutil.rmtree(store, ignore_errors=True)
        pub = PolicyPublisher(store, tmp / "prev", encoding=enc, keyframe_every=0, keep_last=None)
        pub.publish(prev)  # version 0, not timed
        t0 = time.perf_counter()
        rec = pub.publish(new)
        best = min(best, time.perf_counter() - t0)
        pub.close()
        del pub
        if i + 1 < trials:
            shutil.rmtree(store)
    return best, rec


def _time_apply(local: Path, store: Path, trials: int, durable: bool = False) -> float:
    best = float("inf")
    for _ in range(trials):
        materialize(local, store, 0, durable=durable)  # (re)seed, not timed
        for shard in local.glob("*.safetensors"):  # clean pages, like a checkpoint written a while ago
            fd = os.open(shard, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        t0 = time.perf_counter()
        res = materialize(local, store, 1, durable=durable)
        best = min(best, time.perf_counter() - t0)
        assert res.version == 1 and not res.reseeded
    return best


def _time_baseline(tmp: Path, prev: dict[str, torch.Tensor], new_bits: dict[str, np.ndarray], trials: int):
    from safetensors.numpy import load_file

    enc_s = app_s = dur_s = float("inf")
    for _ in range(trials):
        prev_bits = {n: _bits(t).copy() for n, t in prev.items()}
        enc_s = min(enc_s, baseline_encode(new_bits, prev_bits, tmp / "baseline.safetensors"))
        del prev_bits
        frames = {n: a.tobytes() for n, a in load_file(str(tmp / "baseline.safetensors")).items()}
        for flush in (False, True):
            write_checkpoint(tmp / "prev", prev)
            fd = os.open(tmp / "prev" / "model.safetensors", os.O_RDONLY)
            os.fsync(fd)  # start from clean pages, as a seeded checkpoint would
            os.close(fd)
            t = baseline_apply(tmp / "prev", frames, flush=flush)
            if flush:
                dur_s = min(dur_s, t)
            else:
                app_s = min(app_s, t)
    wire = (tmp / "baseline.safetensors").stat().st_size
    write_checkpoint(tmp / "prev", prev)  # undo the baseline's in-place apply
    return enc_s, app_s, dur_s, wire


def run(quick: bool) -> list[Row]:
    rows: list[Row] = []
    shapes = model_shapes(quick)
    trials = 3 if quick else 2
    tmp = Path(tempfile.mkdtemp(prefix="rf-bench-weights-"))
    try:
        model = Model(shapes)
        base = model.bf16()
        total = sum(t.numel() * 2 for t in base.values())
        largest = max(t.numel() * 2 for t in base.values())
        mb = total / 1e6
        case0 = f"{total / 2**30:.2f} GiB bf16"
        print(f"model: {len(shapes)} tensors, {total / 2**20:.0f} MiB, largest {largest / 2**20:.0f} MiB", flush=True)
        copy_s = min(copyto_seconds({n: _bits(t) for n, t in base.items()}) for _ in range(trials))
        rows.append(Row("weights/copyto", case0, "MB/s", mb / copy_s, extra={"seconds": copy_s}))
        del base
        for density in DENSITIES:
            r = calibrate(density)
            prev = model.bf16()
            new = model.step(r)
            new_bits = {n: _bits(t) for n, t in new.items()}
            changed = sum(int(np.count_nonzero(new[n].view(torch.int16) != prev[n].view(torch.int16))) for n in new)
            elem_density = changed / sum(t.numel() for t in new.values())
            case = f"density={density * 100:g}%"
            dx = {"element_density": round(elem_density, 5)}
            write_checkpoint(tmp / "prev", prev)
            enc_s, app_s, dur_s, base_wire = _time_baseline(tmp, prev, new_bits, trials)
            base_enc, base_app = mb / enc_s, mb / app_s
            rows.append(Row("weights/encode", case + " baseline", "MB/s", base_enc, mb / copy_s, "np.copyto", extra=dx))
            rows.append(Row("weights/apply", case + " baseline", "MB/s", base_app, mb / copy_s, "np.copyto", extra=dx))
            wires: dict[str, int] = {}
            apply_mbps: dict[str, float] = {}
            for enc in ENCODINGS:
                pub_s, rec = _time_publish(tmp, enc, prev, new, trials)
                assert rec is not None
                wires[enc] = rec.wire_bytes
                ex = {"seconds": round(pub_s, 4), "vs_copyto": round(copy_s / pub_s, 4)} | dx
                rows.append(
                    Row(
                        "weights/encode",
                        f"{case} {enc}",
                        "MB/s",
                        mb / pub_s,
                        base_enc,
                        BASELINE,
                        target=">= 1.5x baseline",
                        extra=ex,
                    )
                )
                store, local = tmp / f"store-{enc}", tmp / f"local-{enc}"
                app2_s = _time_apply(local, store, trials)
                apply_mbps[enc] = mb / app2_s
                ex = {"seconds": round(app2_s, 4), "vs_copyto": round(copy_s / app2_s, 4)} | dx
                rows.append(
                    Row(
                        "weights/apply",
                        f"{case} {enc}",
                        "MB/s",
                        mb / app2_s,
                        base_app,
                        BASELINE,
                        target=">= 1.5x baseline",
                        extra=ex,
                    )
                )
                if enc == "xor" and density == 0.01:
                    dur2_s = _time_apply(local, store, trials, durable=True)
                    rows.append(
                        Row(
                            "weights/apply",
                            f"{case} xor durable",
                            "MB/s",
                            mb / dur2_s,
                            mb / dur_s,
                            BASELINE + " +msync+fsync",
                            target=">= 1.5x baseline",
                            extra={"seconds": round(dur2_s, 4)} | dx,
                        )
                    )
                if enc == "rf-sparse-xor":
                    rows.append(
                        Row(
                            "weights/apply",
                            f"{case} {enc}",
                            "MB/s",
                            mb / app2_s,
                            apply_mbps["xor"],
                            "xor apply",
                            target=">= 1x xor",
                            extra=ex,
                        )
                    )
                if density == 0.01 and enc in ("xor", "rf-sparse-xor"):
                    materialize(local, store, 0)
                    peak = peak_apply_memory(local, store, 1)
                    rows.append(
                        Row(
                            "weights/apply-memory",
                            f"{case} {enc}",
                            "MiB",
                            peak["anon_peak"] / 2**20,
                            largest / 2**20,
                            "largest tensor",
                            higher_is_better=False,
                            target="small multiple of largest tensor",
                            extra={"vmhwm_growth_mib": round(peak["hwm_growth"] / 2**20, 1)},
                        )
                    )
                shutil.rmtree(local, ignore_errors=True)
                shutil.rmtree(store, ignore_errors=True)
            for enc in ENCODINGS:
                target = "<= 0.75x xor" if enc == "rf-sparse-xor" else ""
                rows.append(
                    Row(
                        "weights/wire",
                        f"{case} {enc}",
                        "bytes",
                        wires[enc],
                        wires["xor"],
                        "xor+zstd1",
                        higher_is_better=False,
                        target=target,
                        extra={"fraction_of_model": round(wires[enc] / total, 5)},
                    )
                )
            rows.append(
                Row(
                    "weights/wire",
                    case + " baseline",
                    "bytes",
                    base_wire,
                    wires["xor"],
                    "xor+zstd1",
                    higher_is_better=False,
                )
            )
            del prev, new, new_bits
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row.line())
