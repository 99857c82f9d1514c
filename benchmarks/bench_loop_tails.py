"""The rollout loop in a long-tailed regime: what oversampling throws away, and whom it starves.

Two in-process echo replicas of 8 slots each follow the trainer's store; groups of 4 samples
made side by side, 4 ms a token (1,024 tokens: four optimizer steps). Completion lengths are
long-tailed (``ignore_eos``: every sample has exactly its prompt's ``max_tokens``): 70 % of the
prompts ask for 32 tokens, 20 % for 128, 8 % for 512, 2 % for 1,024. The trainer takes a batch,
"optimizes" for 1 s and publishes a new version, for ``steps`` steps; then its source runs dry
and it takes batches (still committing a version per step) until the loop has handed over
everything. Two configurations:

- **oversample**: ``oversample=4``, ``max_staleness=1``: tails (groups a whole batch overtook)
  are acted on at every batch;
- **partial**: ``max_staleness=2``, ``partial_rollout=True``, ``oversample=2``.

Figures, from raw facts only (the workers' engines count every token they generate, per prompt;
the batches say what was trained on; the source counts what it handed out):

- ``waste``: the fraction of the tokens the workers generated that were never trained on, over
  the whole drained run (``(generated - trained) / generated``);
- ``length ratio``: the mean length of the samples trained on during the ``steps`` steps over the
  mean ``max_tokens`` of the prompts the loop took from the source in that time. Below 1, the
  trainer sees shorter answers than its prompts ask for: RL biased toward short answers;
- ``stale drops``: groups the loop dropped as too stale (its ``waste_groups_stale``); by the
  loop's construction (``loop_machine`` rule 8) none, with a trainer that commits once a batch;
- ``untrained prompts``: prompts the source handed out that no batch trained on, once the loop has
  handed over everything (a long prompt starved shows here);
- ``trainer wait``: seconds the trainer waited for its batches during the ``steps`` steps (what
  waiting for a group at its last chance costs), in each row's ``extra``.

``ROLLFLEET_BENCH_BASELINE=<a loop_tails.json>`` fills the baseline column from an earlier run
(the same bench on earlier code), so one table shows before and after.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks._fleet import machine_load
from benchmarks.report import Row
from harness import running_worker, temp_broker
from harness.weights import tensors_at, write_base_checkpoint
from rollfleet.schemas import Completion, RolloutPayload, SamplingParams, version_spans
from rollfleet.trainer_client import LoopConfig, PolicyPublisher, RolloutClient, RolloutLoop
from rollfleet.workers.engines.echo import EchoEngine

LENGTHS = ((32, 0.70), (128, 0.20), (512, 0.08), (1024, 0.02))
GROUP = 4
BATCH = 4
STEP_S = 1.0  # the optimizer step
PER_TOKEN_S = 0.004  # 1,024 tokens in 4 s: four optimizer steps
SLOTS = 8
DRAIN_STEPS = 200  # a bound on the drain (never reached in a healthy run)

CONFIGS = {
    "oversample": {"max_staleness": 1, "oversample": 4},
    "partial": {"max_staleness": 2, "oversample": 2, "partial_rollout": True},
}


class TallyEcho(EchoEngine):
    """The echo engine, counting the tokens it generates per prompt (a continuation's prompt
    starts with its prompt's, so its first token names the prompt), and making the samples of a
    request side by side, a token of each per step, as a batching engine does (the echo engine
    makes them one after another: the first sample of a group would finish long before the last)."""

    def __init__(self, tally: Counter[int], **kw: Any) -> None:
        super().__init__(**kw)
        self.tally = tally

    async def _step(self, request_id: str, prompt: list[int], payload: RolloutPayload, sink: Any) -> list[Completion]:
        made: list[list[int]] = [[] for _ in range(payload.n)]
        versions: list[list[int]] = [[] for _ in range(payload.n)]
        finish = "length"
        for i in range(payload.sampling.max_tokens):
            if not self._running.is_set():
                await self._running.wait()  # (an activation lands between steps)
            if request_id in self._aborted:
                finish = "abort"
                break
            await asyncio.sleep(self.per_token_s)
            for k in range(payload.n):
                made[k].append((sum(prompt) + k + i) % self.vocab)
                versions[k].append(self.version)
        return [
            Completion(token_ids=t, finish_reason=finish, logprobs=[0.0] * len(t), weight_versions=version_spans(v))  # type: ignore[arg-type]
            for t, v in zip(made, versions, strict=True)
        ]

    async def generate(self, request_id: str, payload: RolloutPayload, *a: Any, **kw: Any) -> Any:
        out = await super().generate(request_id, payload, *a, **kw)
        self.tally[(payload.prompt_token_ids or [0])[0]] += sum(len(c.token_ids) for c in out.outputs)
        return out


def _length(rng: random.Random) -> int:
    x, acc = rng.random(), 0.0
    for tokens, share in LENGTHS:
        acc += share
        if x < acc:
            return tokens
    return LENGTHS[-1][0]


async def run_one(url: str, tmp: Path, name: str, steps: int, seed: int) -> dict[str, float]:
    namespace = "lt" + uuid.uuid4().hex[:8]
    store = tmp / f"store-{namespace}"
    publisher = PolicyPublisher(store, write_base_checkpoint(tmp / f"base-{namespace}"), keep_last=4)
    tally: Counter[int] = Counter()
    rng = random.Random(seed)
    taken: dict[int, int] = {}  # prompt id -> max_tokens, as the source handed them out
    taken_in_steps: list[int] = []
    state = {"stepping": True, "dry": False}

    async def source() -> AsyncIterator[RolloutPayload]:
        i = 0
        while not state["dry"]:
            pid, tokens = 1000 + i, _length(rng)
            taken[pid] = tokens
            if state["stepping"]:
                taken_in_steps.append(tokens)
            i += 1
            yield RolloutPayload(
                prompt_token_ids=[pid, 7, 11],
                sampling=SamplingParams(max_tokens=tokens, temperature=1.0),
                extra={"ignore_eos": True},
            )

    cfg = LoopConfig(group_size=GROUP, batch_groups=BATCH, job_timeout_s=300, **CONFIGS[name])  # type: ignore[arg-type]
    trained_in_steps: list[int] = []
    trained: Counter[int] = Counter()
    waited_in_steps = 0.0
    async with await RolloutClient.connect(url, namespace=namespace, client_id="trainer") as client:
        await client.publish_policy(publisher, tensors_at(0))
        replicas = [
            running_worker(
                url, namespace, engine=TallyEcho(tally, per_token_s=PER_TOKEN_S), worker_id=w, capacity=SLOTS,
                store_dir=store, local_dir=tmp / f"local-{namespace}-{w}",
            )
            for w in ("a", "b")
        ]  # fmt: skip
        async with replicas[0], replicas[1]:
            await client.wait_for_version(0, replicas=2, timeout=60)
            t0 = time.perf_counter()
            async with RolloutLoop(client, source(), cfg) as loop:
                step = 0
                async for batch in loop.batches():
                    step += 1
                    if state["stepping"]:
                        waited_in_steps += batch.stats.trainer_wait_s
                    for g in batch.groups:
                        for s in g.samples:
                            trained[g.prompt.prompt_token_ids[0]] += len(s.tokens)
                            if state["stepping"]:
                                trained_in_steps.append(len(s.tokens))
                    if step == steps:
                        state["stepping"], state["dry"] = False, True
                        wall = time.perf_counter() - t0
                    if step >= steps + DRAIN_STEPS:
                        break
                    await asyncio.sleep(STEP_S)
                    await client.publish_policy(publisher, tensors_at((client.latest_version or 0) + 1))
                totals = dict(loop.totals)
    generated, used = sum(tally.values()), sum(trained.values())
    mean_trained = sum(trained_in_steps) / len(trained_in_steps)
    mean_taken = sum(taken_in_steps) / len(taken_in_steps)
    return {
        "generated_tokens": generated,
        "trained_tokens": used,
        "waste_fraction": (generated - used) / generated if generated else 0.0,
        "length_ratio": mean_trained / mean_taken,
        "mean_trained_len": mean_trained,
        "mean_taken_len": mean_taken,
        "stale_groups": float(totals.get("waste_groups_stale", 0)),
        "untrained_prompts": float(sum(1 for p in taken if trained[p] == 0)),
        "steps_wall_s": wall,
        "trainer_wait_s": waited_in_steps,
        "batches": float(step),
    }


def _baseline() -> dict[tuple[str, str, str], float]:
    path = os.environ.get("ROLLFLEET_BENCH_BASELINE")
    if not path:
        return {}
    rows = json.loads(Path(path).read_text())["rows"]
    return {(r["bench"], r["case"], r["metric"]): r["value"] for r in rows}


async def bench(url: str, tmp: Path, step_counts: tuple[int, ...]) -> list[Row]:
    results: dict[tuple[str, int], dict[str, float]] = {}
    for name in CONFIGS:
        for steps in step_counts:
            results[name, steps] = await run_one(url, tmp, name, steps, seed=steps)
            print(f"  {name:<11} {steps:>3} steps {results[name, steps]}", flush=True)
    before = _baseline()
    label = "before" if before else ""
    rows = []
    for (name, steps), r in results.items():
        case = f"{name}, {steps} steps"
        extra = {**r, "load": machine_load(), "config": CONFIGS[name]}
        for metric, unit, value, higher, target, met in (
            ("waste", "fraction", r["waste_fraction"], False, "<= 0.05", r["waste_fraction"] <= 0.05),
            ("length-ratio", "fraction", r["length_ratio"], True, ">= 0.9", r["length_ratio"] >= 0.9),
            ("stale-drops", "groups", r["stale_groups"], False, "== 0", r["stale_groups"] == 0),
            ("untrained-prompts", "prompts", r["untrained_prompts"], False, "== 0", r["untrained_prompts"] == 0),
        ):
            bench = f"loop_tails/{metric}"
            rows.append(
                Row(bench, case, unit, value, before.get((bench, case, unit)), label, higher, target,
                    extra if metric == "waste" else {}, met)
            )  # fmt: skip
    return rows


def run(quick: bool = False) -> list[Row]:
    step_counts = (4,) if quick else (10, 30)
    with temp_broker("bench-loop-tails-") as broker, tempfile.TemporaryDirectory(prefix="bench-loop-tails-") as tmp:
        return asyncio.run(bench(broker.url, Path(tmp), step_counts))
