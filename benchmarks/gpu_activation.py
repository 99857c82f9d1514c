"""GPU activation benchmark: the hf engine swaps in a ~1 % dense delta without re-uploading the model.

    python benchmarks/gpu_activation.py                       # cuda + qwen3-4b if CUDA, else cpu + tiny
    python benchmarks/gpu_activation.py --preset qwen3-4b --device cuda --compare-reload
    python benchmarks/gpu_activation.py --check               # CI smoke: tiny model on CPU, a few seconds

Steps: build a random model from a config (bf16 on CUDA), start the hf engine, measure decode
tokens/s, publish a new version where every tensor has ~``--density`` of its elements changed
(written as a safetensors shard into the checkpoint dir, as the replica's materializer leaves
it), stage it while serving (``prepare_weights``: upload, keep only the differing elements on
the device), then time the pause (pause -> load_weights -> resume, CUDA-synchronised) with a
request in flight across it, measure decode again, and check the live weights' checksums
against the new tensors' ("the trainer's"). Prints ONE JSON line; exit status 1 if the
checksums differ or the in-flight request did not report version 0 -> 1.

Why the pause is small: the staged update holds, per tensor, the indices and new values of
the changed elements only, so the pause moves ~density x model bytes (plus indices) instead of
XOR-ing or copying whole tensors (~3x model bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rollfleet.models import build_model_dir, param_count  # noqa: E402
from rollfleet.schemas import RolloutPayload, SamplingParams  # noqa: E402
from rollfleet.workers.engines import _weights  # noqa: E402
from rollfleet.workers.engines.hf import HFEngine  # noqa: E402

DELTA_SHARD = "model-delta-v1.safetensors"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="qwen3-4b | 0.5b | 0.1b | tiny (default: by device)")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on cuda")
    p.add_argument("--density", type=float, default=0.01, help="fraction of each tensor's elements changed")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests in the decode measurement")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens per request when measuring")
    p.add_argument("--compare-reload", action="store_true", help="also time a full from_pretrained reload")
    p.add_argument("--workdir", default=None, help="where to build the model (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="quick CPU smoke run (tiny model) for CI")
    p.add_argument(
        "--stage-mode", default="swap", choices=["swap", "scatter"], help="swap: fastest pause; scatter: least memory"
    )
    args = p.parse_args(argv)
    if args.check:
        args.device, args.preset = args.device or "cpu", args.preset or "tiny"
        args.batch, args.decode_tokens, args.prompt_tokens = 4, 16, 8
        args.compare_reload = True
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.preset = args.preset or ("qwen3-4b" if args.device == "cuda" else "tiny")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def decode_tok_s(engine: HFEngine, args: argparse.Namespace, tag: str) -> float:
    """Tokens/s over ``batch`` concurrent requests of ``decode_tokens`` new tokens each."""
    vocab = engine.model.config.vocab_size

    def payload(i: int) -> RolloutPayload:
        prompt = [(97 * i + 13 * j) % vocab for j in range(args.prompt_tokens)]
        return RolloutPayload(
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=args.decode_tokens, temperature=1.0, seed=i),
            extra={"ignore_eos": True},
        )

    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(f"{tag}-{i}", payload(i)) for i in range(args.batch)))
    seconds = time.perf_counter() - t0
    return sum(len(r.outputs[0].token_ids) for r in results) / seconds


def make_delta(engine: HFEngine, names: list[str], density: float, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """A new version of every tensor: ~density of its elements moved by a small random step, in the
    tensor's own dtype (bf16 on GPU); returned on the CPU, as a trainer would publish them, with
    the number of elements whose bytes changed."""
    gen = torch.Generator(device=engine.device).manual_seed(seed + 1)
    out: dict[str, torch.Tensor] = {}
    changed = 0
    with torch.no_grad():
        for name in names:
            new = engine.live_tensor(name).clone()
            flat = new.view(-1)
            k = max(1, int(density * flat.numel()))
            idx = torch.randint(0, flat.numel(), (k,), generator=gen, device=engine.device)
            step = torch.randn(k, generator=gen, device=engine.device, dtype=torch.float32) * 0.01
            flat[idx] = (flat[idx].float() + step + 1e-3).to(flat.dtype)
            changed += int((_weights.bits(new) != _weights.bits(engine.live_tensor(name))).sum())
            out[name] = new.cpu()
    return out, changed


def publish(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the changed tensors as one more shard and point the index at it."""
    save_file(tensors, str(ckpt / DELTA_SHARD), metadata={"format": "pt"})
    index_path = ckpt / _weights.INDEX_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: DELTA_SHARD for name in tensors})
    index_path.write_text(json.dumps(index))


def full_reload_s(ckpt: Path, engine: HFEngine) -> float:
    """What an activation without deltas costs: load the whole checkpoint onto the device."""
    fresh = HFEngine(device=str(engine.device), dtype=engine.dtype)
    t0 = time.perf_counter()
    fresh._load_model(ckpt)
    sync(engine.device)
    seconds = time.perf_counter() - t0
    del fresh
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


async def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device(args.device)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rf-gpu-activation-"))
    t0 = time.perf_counter()
    ckpt = build_model_dir(
        workdir / f"{args.preset}-{args.dtype}",
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        init_device="cuda" if device.type == "cuda" else "cpu",
    )
    build_s = time.perf_counter() - t0

    engine = HFEngine(device=args.device, max_batch=max(args.batch, 2), seed=args.seed, stage_mode=args.stage_mode)
    t0 = time.perf_counter()
    await engine.start(ckpt, version=0)
    start_s = time.perf_counter() - t0
    try:
        await decode_tok_s(engine, argparse.Namespace(**{**vars(args), "batch": 2, "decode_tokens": 4}), "warm")
        tok_s_before = await decode_tok_s(engine, args, "before")

        names = engine.tensor_names  # every tensor the checkpoint stores
        new, changed_elements = make_delta(engine, names, args.density, args.seed)
        expected = {name: _weights.checksum(t) for name, t in new.items()}
        total_elements = sum(t.numel() for t in new.values())
        publish(ckpt, new)
        del new

        # A request in flight across the activation: it must report version 0 -> 1.
        max_new = min(4096, engine.model.config.max_position_embeddings - args.prompt_tokens - 1)
        inflight = asyncio.create_task(
            engine.generate(
                "inflight",
                RolloutPayload(
                    prompt_token_ids=[3] * args.prompt_tokens,
                    sampling=SamplingParams(max_tokens=max_new, temperature=0.0),
                    extra={"ignore_eos": True},
                ),
            )
        )
        steps0 = engine.steps
        t0 = time.perf_counter()
        await engine.prepare_weights(ckpt, names, version=1)  # while serving
        prepare_s = time.perf_counter() - t0
        steps_during_prepare = engine.steps - steps0
        staged_bytes = engine.staged_bytes

        sync(device)
        t0 = time.perf_counter()
        await engine.pause()
        t1 = time.perf_counter()
        await engine.load_weights(ckpt, names, version=1)  # synchronises the device before returning
        t2 = time.perf_counter()
        await engine.resume()
        t3 = time.perf_counter()
        resumed_at = engine.steps
        while engine.steps <= resumed_at and not inflight.done():  # noqa: ASYNC110 - one step on new weights
            await asyncio.sleep(0.001)
        await engine.abort("inflight")
        inflight_result = await inflight

        tok_s_after = await decode_tok_s(engine, args, "after")
        live = engine.live_checksums(names)
        mismatched = sorted(n for n in names if live[n] != expected[n])
        result: dict[str, object] = {
            "bench": "gpu_activation",
            "preset": args.preset,
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": args.dtype,
            "params": param_count(args.preset),
            "tensors": len(names),
            "density_target": args.density,
            "density": round(changed_elements / total_elements, 6),
            "staged_bytes": staged_bytes,
            "build_s": round(build_s, 3),
            "start_s": round(start_s, 3),
            "prepare_s": round(prepare_s, 4),
            "decode_steps_during_prepare": steps_during_prepare,
            "pause_ms": round((t3 - t0) * 1e3, 3),  # pause -> load_weights -> resume
            "wait_step_ms": round((t1 - t0) * 1e3, 3),  # of which: finishing the decode step in progress
            "swap_ms": round((t2 - t1) * 1e3, 3),  # of which: making the staged delta live
            "decode_tok_s_before": round(tok_s_before, 1),
            "decode_tok_s_after": round(tok_s_after, 1),
            "batch": args.batch,
            "inflight_versions": [inflight_result.version_start, inflight_result.version_end],
            "checksums_ok": not mismatched,
            "checksum_mismatches": mismatched[:5],
            "target_pause_ms": 10.0 if args.preset == "qwen3-4b" else None,
        }
    finally:
        await engine.close()
    if args.compare_reload:
        reload_s = full_reload_s(ckpt, engine)
        result["full_reload_s"] = round(reload_s, 4)
        result["pause_vs_full_reload"] = round((t3 - t0) / reload_s, 5)
    result["torch"] = torch.__version__
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_activation", "error": "CUDA is not available"}))
        return 2
    result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    ok = result["checksums_ok"] and result["inflight_versions"] == [0, 1]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
