"""Replay coordinates: what they add to a result, and how often a replay comes out the same.

One hf engine in this process (the tiny preset of ``rollfleet.models``, float32, on the CPU) serves
every figure, all from this run:

1. Size: one 512-token sample (``ignore_eos``, temperature 1.0, unseeded: the engine draws the
   seed and the coordinate records it), made into the ``RolloutResult`` a replica stores, with the
   coordinate a replica stamps (``workers.replay_stamp.stamp``: the version's content digest from
   the checkpoint's own checksums). Its encoded MessagePack bytes with the coordinate against the
   same result without it. Target: <= 2 % more.
2. Replay at batch 1: samples generated deterministic (alone), each replayed as
   ``RolloutClient.replay`` asks (one sample, its stream's seed, deterministic) and judged by
   ``judge_replay``: the fraction bit-exact (tokens and log-probs). Target: 100 %.
3. Replay of samples made under load: the same number of seeded requests generated at once, not
   deterministic (batched together), each replayed alone: the fraction with the same tokens, and
   the fraction bit-exact (log-probs too). Measured, no target: batching changes float32 rounding.
4. The cost of deterministic mode: those concurrent requests' tokens per second, deterministic
   (each runs alone, one after another) against batched.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import msgspec

from benchmarks.report import Row
from rollfleet.models import build_model_dir
from rollfleet.policy_store import CheckpointLayout
from rollfleet.policy_store.digest import content_digest
from rollfleet.policy_store.materialize import checkpoint_checksums
from rollfleet.schemas import Completion, RolloutPayload, RolloutResult, SamplingParams, VersionConstraint, encode
from rollfleet.schemas.replay_rules import judge_replay, replay_request
from rollfleet.workers.engines.base import Generation
from rollfleet.workers.engines.hf import HFEngine
from rollfleet.workers.replay_stamp import stamp

PROMPT = [(7 * j + 3) % 1000 for j in range(32)]


def ask(max_tokens: int, seed: int | None, deterministic: bool) -> RolloutPayload:
    return RolloutPayload(
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed),
        deterministic=deterministic,
        extra={"ignore_eos": True},
    )


def as_result(payload: RolloutPayload, gen: Generation, engine: HFEngine, digests: dict[int, bytes]) -> RolloutResult:
    """The result a replica stores for ``gen`` (the fields ``JobRunner`` fills, at their sizes)."""
    return RolloutResult(
        job_id="a1b2c3d4e5f6a7b8c9d0e1f2",
        idempotency_key="a1b2c3d4e5f6a7b8c9d0e1f2",
        client_id="trainer-0",
        outputs=gen.outputs,
        version_start=gen.version_start,
        version_end=gen.version_end,
        worker_id="hf-7f3a9c2e",
        engine=engine.name,
        queue_wait_s=0.0123456,
        generation_s=1.23456789,
        delivery_attempt=1,
        finished_at=time.time(),
        prompt_tokens=gen.prompt_tokens,
        fingerprint="0123456789abcdef01234567",
        constraint=VersionConstraint("exact", 0),
        replay=stamp(payload, gen, engine, digests, "hf-7f3a9c2e"),
    )


async def replayed(engine: HFEngine, result: RolloutResult, payload: RolloutPayload, rid: str) -> Completion:
    """What ``RolloutClient.replay`` asks the fleet for, asked of the engine directly."""
    req = replay_request(result, 0)
    again = msgspec.structs.replace(payload, n=req.n, sampling=req.sampling, deterministic=True)
    return (await engine.generate(rid, again)).outputs[req.pick]


async def measure(quick: bool, tmp: Path) -> list[Row]:
    base = build_model_dir(tmp / "base", preset="tiny", seed=0, dtype="float32")
    digests = {0: content_digest(checkpoint_checksums(CheckpointLayout.read(base)))}
    engine = HFEngine(device="cpu", max_batch=32)
    await engine.start(base, 0)
    rows: list[Row] = []
    try:
        # 1. Size of a 512-token sample's result, with and without its coordinate.
        payload = ask(512, None, deterministic=True)
        gen = await engine.generate("size", payload)
        result = as_result(payload, gen, engine, digests)
        with_coord, without = len(encode(result)), len(encode(msgspec.structs.replace(result, replay=None)))
        coord_bytes = len(encode(result.replay))
        overhead = (with_coord - without) / without
        rows.append(Row(
            "replay/coordinate-size", "1 sample x 512 tok, hf tiny", "bytes", float(with_coord),
            baseline=float(without), baseline_name="without", higher_is_better=False, target="<= 1.02x baseline",
            met=overhead <= 0.02, extra={"overhead_percent": overhead * 100, "coordinate_bytes": coord_bytes},
        ))  # fmt: skip

        # 2. Deterministic originals, replayed alone.
        n, tokens = (4, 32) if quick else (16, 128)
        exact = 0
        for i in range(n):
            p = ask(tokens, None, deterministic=True)
            original = as_result(p, await engine.generate(f"d{i}", p), engine, digests)
            again = await replayed(engine, original, p, f"d{i}.replay")
            exact += judge_replay(
                replay_request(original, 0), original.outputs[0], again, original.replay, original.replay
            ).matched  # type: ignore[arg-type]
        rows.append(Row(
            "replay/batch-1", f"{n} samples x {tokens} tok", "fraction", exact / n, target=">= 1.0", met=exact == n,
            extra={"bit_exact": exact, "samples": n},
        ))  # fmt: skip

        # 3 and 4. The same load batched, and deterministic; the batched samples replayed alone.
        loads = [ask(tokens, 1000 + i, deterministic=False) for i in range(n)]
        t0 = time.perf_counter()
        batched = await asyncio.gather(*(engine.generate(f"b{i}", p) for i, p in enumerate(loads)))
        batched_s = time.perf_counter() - t0
        alone = [msgspec.structs.replace(p, deterministic=True) for p in loads]
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(f"a{i}", p) for i, p in enumerate(alone)))
        alone_s = time.perf_counter() - t0
        same_tokens = same_bits = 0
        for i, (p, gen) in enumerate(zip(loads, batched, strict=True)):
            original = as_result(p, gen, engine, digests)
            again = await replayed(engine, original, p, f"b{i}.replay")
            out = judge_replay(
                replay_request(original, 0), original.outputs[0], again, original.replay, original.replay
            )  # type: ignore[arg-type]
            same_tokens += out.first_token is None
            same_bits += out.first_token is None and out.first_logprob is None
        rows.append(Row(
            "replay/under-load-tokens", f"{n} concurrent x {tokens} tok", "fraction", same_tokens / n,
            extra={"same_tokens": same_tokens, "samples": n},
        ))  # fmt: skip
        rows.append(Row(
            "replay/under-load-bit-exact", f"{n} concurrent x {tokens} tok", "fraction", same_bits / n,
            extra={"bit_exact": same_bits, "samples": n},
        ))  # fmt: skip
        total = n * tokens
        rows.append(Row(
            "replay/deterministic-cost", f"{n} concurrent x {tokens} tok", "tokens/s", total / alone_s,
            baseline=total / batched_s, baseline_name="batched",
        ))  # fmt: skip
    finally:
        await engine.close()
    return rows


def run(quick: bool = False) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="rf-bench-replay-") as tmp:
        return asyncio.run(measure(quick, Path(tmp)))
