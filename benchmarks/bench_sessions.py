"""Sessions: multi-turn turn latency and prefill tokens with the engine's session prefix cache,
against the same turns without it, at growing contexts (the tiny model on CPU, hf engine).

Shape (issue 15): 32 sessions x 8 turns on 2 hf engines (16 sessions each, every turn of a
session on the engine that served its first: the affinity the router provides), all sessions
at once. A turn's prompt is the whole context so far: the first prompt, then each turn's output
and a few hundred tokens of environment output (fixed pseudo-random tokens per session and
turn; output and environment lengths vary from 0.5x to 1.5x their nominal sizes, so sessions
drift apart and turns join batches that are decoding, as in a real agentic run). Greedy
decoding, so both runs send exactly the same prompts (prefix reuse does not change tokens; the
tests prove it, and the run checks it) and the only difference is ``session_id``: with it, a turn prefills
only what its session's cache does not hold; without it (the baseline, measured in the same run
on the same engines), every turn prefills its whole prompt, as it would on a replica without the
session's cache.

Reported per turn index (its context length): p50 turn latency with reuse against without,
prefill tokens per turn (prompt tokens minus ``cached_tokens``), and at the longest context the
target: p50 latency at least 2x lower with reuse (speedup = baseline p50 / p50 >= 2).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._fleet import machine_load, percentile
from benchmarks.report import Row
from rollfleet.models import build_model_dir
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.workers.engines.hf import HFEngine

BASELINE = "same turns without the session cache"
TARGET_SPEEDUP = 2.0


async def _session(engine: HFEngine, sid: int, turns: int, first: int, env: int, out: int, reuse: bool) -> list[dict]:
    rng = random.Random(sid)
    context = [rng.randrange(3, 1000) for _ in range(first)]
    rows = []
    for turn in range(turns):
        # Lengths vary around the nominal ones, so sessions drift apart and turns join running batches.
        payload = RolloutPayload(
            prompt_token_ids=list(context),
            sampling=SamplingParams(max_tokens=rng.randint(out // 2, out * 3 // 2), temperature=0.0),
            extra={"ignore_eos": True},
        )
        t0 = time.perf_counter()
        gen = await engine.generate(f"s{sid}-t{turn}-{reuse}", payload, session_id=f"s{sid}" if reuse else None)
        dt = time.perf_counter() - t0
        out_ids = tuple(gen.outputs[0].token_ids)
        rows.append(
            {"sid": sid, "turn": turn, "prompt": len(context), "cached": gen.cached_tokens, "s": dt, "out": out_ids}
        )
        context += gen.outputs[0].token_ids + [
            rng.randrange(3, 1000) for _ in range(rng.randint(env // 2, env * 3 // 2))
        ]
    if reuse:
        await engine.end_session(f"s{sid}")
    return rows


async def _run_all(
    engines: list[HFEngine], sessions: int, rounds: list[bool], **shape: int
) -> tuple[dict[bool, list[dict]], dict[bool, int]]:
    """All sessions at once, once per entry of ``rounds`` (True: with session ids); the turns and
    the tokens the engines prefilled, per mode."""
    results: dict[bool, list[dict]] = {False: [], True: []}
    prefilled = {False: 0, True: 0}
    for reuse in rounds:
        before = sum(e.prefill_tokens for e in engines)
        per = await asyncio.gather(
            *(_session(engines[i % len(engines)], i, reuse=reuse, **shape) for i in range(sessions))
        )
        results[reuse] += [r for rows in per for r in rows]
        prefilled[reuse] += sum(e.prefill_tokens for e in engines) - before
    return results, prefilled


def run(quick: bool = False) -> list[Row]:
    sessions, turns, first, env, out = (4, 3, 64, 64, 8) if quick else (32, 8, 256, 256, 16)
    engines_n = 2
    max_len = first + turns * (env + out) * 3 // 2 + 64
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_model_dir(Path(tmp) / "tiny", preset="tiny", seed=1, max_position_embeddings=max(2048, max_len))

        async def main() -> tuple[dict[bool, list[dict]], dict[bool, int]]:
            engines = [HFEngine(device="cpu", max_batch=32, seed=0) for _ in range(engines_n)]
            for e in engines:
                await e.start(ckpt, version=0)
            try:
                await _run_all(engines, 2, [False, True], turns=2, first=16, env=16, out=4)  # warm-up
                # Baseline and reuse alternate (ABBA), so drift in the machine's load hits both alike.
                rounds = [False, True] if quick else [False, True, True, False]
                return await _run_all(engines, sessions, rounds, turns=turns, first=first, env=env, out=out)
            finally:
                for e in engines:
                    await e.close()

        results, prefilled = asyncio.run(main())
    # Reuse must not change a single token: both modes saw the same prompts and gave the same outputs.
    same = {(r["sid"], r["turn"], r["out"]) for r in results[True]} == {
        (r["sid"], r["turn"], r["out"]) for r in results[False]
    }
    rows: list[Row] = []
    for turn in range(turns):
        with_ = [r for r in results[True] if r["turn"] == turn]
        without = [r for r in results[False] if r["turn"] == turn]
        p50, base = statistics.median(r["s"] for r in with_), statistics.median(r["s"] for r in without)
        prompt = statistics.mean(r["prompt"] for r in with_)
        prefill = statistics.mean(r["prompt"] - r["cached"] for r in with_)
        prefill_base = statistics.mean(r["prompt"] - r["cached"] for r in without)
        speedup = base / p50
        last = turn == turns - 1
        case = f"turn {turn + 1} ({prompt:.0f} prompt tokens avg)"
        print(
            f"{case}: p50 {p50!r} s with reuse, {base!r} s without; speedup {speedup!r}"
            + (f" (target >= {TARGET_SPEEDUP}x: {'met' if speedup >= TARGET_SPEEDUP else 'missed'})" if last else "")
        )
        rows.append(
            Row(
                "sessions/turn-p50",
                case,
                "s",
                p50,
                base,
                BASELINE,
                higher_is_better=False,
                target=f"<= {1 / TARGET_SPEEDUP}x baseline: {'met' if speedup >= TARGET_SPEEDUP else 'missed'}"
                if last
                else "",
                extra={
                    "speedup": speedup,
                    "met": speedup >= TARGET_SPEEDUP if last else None,
                    "p99_s": percentile([r["s"] for r in with_], 99),
                    "baseline_p99_s": percentile([r["s"] for r in without], 99),
                },
            )
        )
        rows.append(
            Row("sessions/prefill", case, "tokens/turn", prefill, prefill_base, BASELINE, higher_is_better=False)
        )
    rows[0].extra |= {
        "sessions": sessions,
        "turns": turns,
        "first": first,
        "env": env,
        "out": out,
        "engines": engines_n,
        "threads": torch.get_num_threads(),
        "identical_outputs": same,
        "prefilled_tokens_with_reuse": prefilled[True],
        "prefilled_tokens_without": prefilled[False],
    } | machine_load()
    print(
        f"identical outputs with and without reuse: {same}; tokens prefilled: {prefilled[True]} vs {prefilled[False]}"
    )
    return rows
