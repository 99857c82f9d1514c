"""Activation pause: the hf engine swaps a ~1 % dense version in place, against a full reload.

For models of ~0.1 B and ~0.5 B parameters (fp32, CPU; ``tiny`` with --quick) built from a
config: a trainer publishes versions through ``PolicyPublisher`` (xor deltas, every tensor with
~1 % of its elements changed); the replica prepares each one while a request is decoding
(``materialize`` into its host-local checkpoint, then ``prepare_weights`` stages the changed
elements), then activates it exactly as ``VersionSync.update_to`` does: ``pause()`` (waits for the
step in progress) -> ``load_weights`` -> ``resume()``. The pause is timed the same way: from after
``pause()`` returns until ``resume()`` returns (no step can run in between); the wait for the step
in progress is reported next to it.

Baselines, in the same run: ``AutoModelForCausalLM.from_pretrained`` of the whole host-local
checkpoint (what an activation without deltas would have to do while paused), bare and followed
by copying every parameter into process memory as the hf engine's own load does. On CPU the bare
call maps the safetensors files lazily (the bytes are read by later forward passes), so it is
a lower bound of a reload, not a reload. Target: pause <= 0.1x the full reload.

Also reported: the first decode step after ``resume()`` (the hf engine re-prefills the KV cache
of in-flight requests on the new weights; that step is not part of the pause but requests feel it).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._fleet import machine_load
from benchmarks.report import Row
from rollfleet.models import build_model_dir, load_model_tensors, param_count
from rollfleet.policy_store import materialize
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.trainer_client import PolicyPublisher
from rollfleet.workers.engines.hf import HFEngine

DENSITY = 0.01
BASELINE = "bare from_pretrained"
BASELINE_OWNED = "from_pretrained+own copy"


def rl_step(tensors: dict[str, torch.Tensor], gen: torch.Generator, density: float = DENSITY) -> None:
    """A small update to ~``density`` of the elements of every tensor, in place (an RL step's shape)."""
    for t in tensors.values():
        flat = t.view(-1)
        k = max(1, int(flat.numel() * density))
        idx = torch.randint(0, flat.numel(), (k,), generator=gen)
        flat[idx] += torch.randn(k, generator=gen).to(flat.dtype) * 0.01


def full_reload_s(checkpoint: Path, *, own: bool) -> float:
    """The baseline: load the whole checkpoint with ``from_pretrained`` (page cache warm).

    On CPU, transformers maps the safetensors files and the parameters alias the mapping, so a
    bare ``from_pretrained`` reads almost nothing (pages fault in during the next forward passes).
    ``own=True`` also copies every parameter into process memory, as the hf engine's load does
    (the replica's checkpoint files change in place while it serves): a reload that has the bytes.
    """
    from transformers import AutoModelForCausalLM

    from rollfleet.workers.engines.hf_loading import own_memory

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype="auto", local_files_only=True)
    if own:
        own_memory(model)
    seconds = time.perf_counter() - t0
    del model
    return seconds


async def _wait_steps(engine: HFEngine, n: int, timeout: float = 120.0) -> None:
    target, deadline = engine.steps + n, time.monotonic() + timeout
    while engine.steps < target:
        if time.monotonic() > deadline:
            raise TimeoutError("the in-flight request stopped decoding")
        await asyncio.sleep(0.001)


async def bench_preset(preset: str, versions: int, reloads: int, tmp: Path) -> list[Row]:
    t0 = time.perf_counter()
    base = build_model_dir(tmp / "base", preset=preset, seed=0, dtype="float32")
    build_s = time.perf_counter() - t0
    store, local = tmp / "store", tmp / "local"
    publisher = PolicyPublisher(store, base, keyframe_every=0, keep_last=None)
    tensors = load_model_tensors(base)
    publisher.publish(tensors)  # version 0: the base checkpoint
    materialize(local, store, 0)  # the replica's starting point (not timed)
    gen = torch.Generator().manual_seed(0)

    engine = HFEngine(device="cpu", max_batch=4, seed=0)
    await engine.start(local, 0)
    rows: list[Row] = []
    samples: list[dict[str, float]] = []
    try:
        prompt = [(7 * j + 3) % 1000 for j in range(16)]
        max_new = min(1024, engine.model.config.max_position_embeddings - len(prompt) - 1)
        inflight = asyncio.create_task(
            engine.generate(
                "inflight",
                RolloutPayload(
                    prompt_token_ids=prompt,
                    sampling=SamplingParams(max_tokens=max_new, temperature=1.0, seed=1),
                    extra={"ignore_eos": True},
                ),
            )
        )
        await _wait_steps(engine, 3)
        for version in range(1, versions + 1):
            rl_step(tensors, gen)
            record = await asyncio.to_thread(publisher.publish, tensors)  # trainer side, not timed
            assert record.version == version
            await _wait_steps(engine, 2)  # decoding on the current version
            # Prepare, while serving: pull+apply+verify into the host-local dir, then stage.
            t0 = time.perf_counter()
            result = await asyncio.to_thread(materialize, local, store, version)
            t1 = time.perf_counter()
            await engine.prepare_weights(local, result.changed, result.version)
            t2 = time.perf_counter()
            step_t0, steps0 = time.perf_counter(), engine.steps
            await _wait_steps(engine, 3)
            step_s = (time.perf_counter() - step_t0) / max(1, engine.steps - steps0)
            # Activate, timed as VersionSync.update_to times it.
            t3 = time.perf_counter()
            await engine.pause()
            t4 = time.perf_counter()
            await engine.load_weights(local, result.changed, result.version)
            await engine.resume()
            t5 = time.perf_counter()
            await _wait_steps(engine, 1)  # the first step on the new weights (re-prefills the KV cache)
            t6 = time.perf_counter()
            samples.append(
                {
                    "pause_s": t5 - t4,
                    "wait_step_s": t4 - t3,
                    "materialize_s": t1 - t0,
                    "stage_s": t2 - t1,
                    "step_s": step_s,
                    "first_step_after_s": t6 - t5,
                    "density": result.density,
                    "changed_tensors": len(result.changed),
                    "wire_bytes": result.wire_bytes,
                }
            )
        await engine.abort("inflight")
        done = await inflight
        inflight_versions = [done.version_start, done.version_end]
    finally:
        await engine.close()
        publisher.close()
    del tensors
    full_reload_s(local, own=True)  # warm-up: imports, page cache (the replica's own files are hot too)
    reload_s = [full_reload_s(local, own=False) for _ in range(reloads)]
    owned_s = [full_reload_s(local, own=True) for _ in range(reloads)]
    reload, owned = min(reload_s), min(owned_s)  # the baseline's best case

    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    params = param_count(preset)
    case = f"{preset} ({params / 1e6:.3g} M params, fp32, cpu)"
    extra: dict[str, object] = {
        "params": params,
        "versions": versions,
        "pause_s_each": [round(s["pause_s"], 5) for s in samples],
        "wait_step_s": round(med["wait_step_s"], 5),
        "decode_step_s": round(med["step_s"], 5),
        "first_step_after_resume_s": round(med["first_step_after_s"], 5),
        "materialize_s": round(med["materialize_s"], 4),
        "stage_s": round(med["stage_s"], 4),
        "density": round(med["density"], 5),
        "changed_tensors": int(med["changed_tensors"]),
        "wire_bytes": int(med["wire_bytes"]),
        "full_reload_s_each": [round(s, 4) for s in reload_s],
        "full_reload_owned_s_each": [round(s, 4) for s in owned_s],
        "inflight_versions": inflight_versions,
        "build_s": round(build_s, 2),
        "threads": torch.get_num_threads(),
    } | machine_load()
    rows.append(
        Row(
            "activation/pause",
            case,
            "s",
            med["pause_s"],
            owned,
            BASELINE_OWNED,
            higher_is_better=False,
            target="<= 0.1x baseline",
            extra=extra,
        )
    )
    rows.append(
        Row(
            "activation/pause",
            case,
            "s",
            med["pause_s"],
            reload,
            BASELINE,
            higher_is_better=False,
            target="<= 0.1x baseline",
            extra={"note": "bare from_pretrained maps the files lazily on CPU; see the module docstring"},
        )
    )
    # The whole stall a request sees: waiting for the step in progress + the pause.
    rows.append(
        Row(
            "activation/stall",
            case + " wait+pause",
            "s",
            med["wait_step_s"] + med["pause_s"],
            owned,
            BASELINE_OWNED,
            higher_is_better=False,
        )
    )
    # Off the pause, while serving: what preparation costs next to a reload.
    rows.append(
        Row(
            "activation/prepare",
            case + " materialize+stage",
            "s",
            med["materialize_s"] + med["stage_s"],
            owned,
            BASELINE_OWNED,
            higher_is_better=False,
        )
    )
    return rows


def run(quick: bool) -> list[Row]:
    presets = ("tiny",) if quick else ("0.1b", "0.5b")
    rows: list[Row] = []
    for preset in presets:
        tmp = Path(tempfile.mkdtemp(prefix=f"rf-bench-act-{preset}-"))
        try:
            print(f"activation: {preset}", flush=True)
            rows += asyncio.run(bench_preset(preset, versions=3, reloads=2 if quick else 3, tmp=tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the 0.5b checkpoint and its copies are ~4 GB
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row.line())
