"""Sessions through the fleet: replica affinity against the same turns routed without it.

Shape (issue 15): 32 sessions x 8 turns on 2 ``rollfleet worker --engine hf`` processes (the tiny
model on CPU, one torch thread each) that follow a policy store, while this process (the
trainer) publishes a new version every few seconds. A turn's prompt is the whole context so far:
the first prompt, then each turn's output and a few hundred tokens of environment output (fixed
pseudo-random tokens per session and turn). Two ways to send the same turns, alternated ABBA so
the machine's drift hits both alike:

- affinity: ``client.session(min_version=0, version_policy="monotonic")``: each turn goes to the
  replica holding its session's context (its own subject), which prefills only the new tokens;
- without affinity (the baseline): the same turns submitted to the shared subjects, with the same
  ``session_id`` and the same monotonic constraint, so a turn reuses its context only when the
  pull happens to land on the replica that holds it;
- no reuse (for scale): the same turns without ``session_id``: every turn prefills everything.

Reported per turn index: p50 and p99 turn latency (submit to result), prefill tokens per turn
(prompt minus ``cached_tokens``); the affinity hit rate (turns after the first served by the
replica that served the previous turn); turns outside the session's version policy (a turn
starting below the version its previous turn ended at), which must be zero. Targets: >= 90 %
affinity hits while versions change; p50 at the longest context >= 2x lower than without.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks._fleet import REPO, machine_load, percentile
from benchmarks.bench_activation import rl_step
from benchmarks.report import Row
from harness import spawn, stop_all, temp_broker, worker_command
from rollfleet.models import build_model_dir
from rollfleet.models import load_model_tensors as load_tensors
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams, VersionConstraint
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

BASELINE = "same turns without affinity"
TARGET_SPEEDUP = 2.0
TARGET_HITS = 0.9
# A trainer steps once per batch of finished rollouts: a new version after every TURNS_PER_VERSION
# finished turns (per session: every 2 turns), so every mode sees the same number of versions
# at the same points of its progress. Each activation invalidates every cached context.
TURNS_PER_SESSION_PER_VERSION = 2


def _turn_payload(context: list[int], rng: random.Random, out: int) -> RolloutPayload:
    return RolloutPayload(
        prompt_token_ids=list(context),
        sampling=SamplingParams(max_tokens=rng.randint(out // 2, out * 3 // 2), temperature=0.0),
        extra={"ignore_eos": True},
    )


async def _session(
    client: RolloutClient,
    sid: int,
    *,
    mode: str,
    turns: int,
    first: int,
    env: int,
    out: int,
    tag: str,
    done: asyncio.Queue[None],
) -> list[dict[str, Any]]:
    affinity = mode == "affinity"
    rng = random.Random(sid)  # the same lengths in both modes
    context = [rng.randrange(3, 1000) for _ in range(first)]
    rows: list[dict[str, Any]] = []
    session_id = f"{tag}-s{sid}"
    session = client.session(session_id, min_version=0, version_policy="monotonic", ttl=600)
    if affinity:
        await session.open()
    last_version = 0
    previous: str | None = None
    try:
        for turn in range(turns):
            payload = _turn_payload(context, rng, out)
            t0 = time.perf_counter()
            if affinity:
                result = await session.generate(payload, timeout=600)
            else:
                handle = await client.submitter.submit(
                    payload,
                    VersionConstraint("min", last_version),
                    written=f"min:{last_version}",
                    idempotency_key=f"{session_id}/{turn}",
                    deadline=None,
                    timeout=600,
                    retry_policy="replayable",
                    session_id=session_id if mode == "shared" else None,
                )
                result = await handle.result()
            dt = time.perf_counter() - t0
            rows.append(_row(sid, turn, len(context), result, dt, previous, last_version))
            done.put_nowait(None)
            previous, last_version = result.worker_id, max(last_version, result.version_end)
            context += result.outputs[0].token_ids + [
                rng.randrange(3, 1000) for _ in range(rng.randint(env // 2, env * 3 // 2))
            ]
    finally:
        if affinity:
            await session.close()
    return rows


def _row(
    sid: int, turn: int, prompt: int, r: RolloutResult, dt: float, previous: str | None, floor: int
) -> dict[str, Any]:
    return {
        "sid": sid,
        "turn": turn,
        "prompt": prompt,
        "cached": r.cached_tokens,
        "s": dt,
        "worker": r.worker_id,
        "hit": previous is not None and r.worker_id == previous,
        "outside_policy": r.version_start < floor,
        "versions": (r.version_start, r.version_end),
        "attempt": r.delivery_attempt,
        "queue_wait_s": r.queue_wait_s,
        "generation_s": r.generation_s,
    }


async def _publisher_loop(
    client: RolloutClient,
    publisher: PolicyPublisher,
    tensors: dict[str, torch.Tensor],
    done: asyncio.Queue[None],
    every: int,
) -> None:
    """Publish a version after every ``every`` finished turns (an RL step's cadence)."""
    gen = torch.Generator().manual_seed(0)
    while True:
        for _ in range(every):
            await done.get()
        rl_step(tensors, gen)
        await client.publish_policy(publisher, tensors)


async def _main(
    url: str, tmp: Path, quick: bool, rounds: list[str] | None = None, shape: tuple[int, ...] | None = None
) -> dict[str, Any]:
    sessions, turns, first, env, out = shape or ((4, 3, 64, 64, 8) if quick else (32, 8, 256, 256, 16))
    modes = ["shared", "affinity", "none"]
    rounds = rounds or (modes if quick else [*modes, *reversed(modes)])
    max_len = first + turns * (env + out) * 3 // 2 + 64
    base = build_model_dir(tmp / "tiny", preset="tiny", seed=1, max_position_embeddings=max(2048, max_len))
    store = tmp / "store"
    publisher = PolicyPublisher(store, base, keyframe_every=0, keep_last=None)
    tensors = load_tensors(base)
    namespace = "sr" + uuid.uuid4().hex[:8]
    procs = []
    out_rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    published = dict.fromkeys(modes, 0)
    async with await RolloutClient.connect(url, namespace=namespace, client_id="trainer") as client:
        try:
            await client.publish_policy(publisher, tensors)  # version 0
            env_vars = {"OMP_NUM_THREADS": "1", "ROLLFLEET_LOG_JSON": "1"}
            for w in ("hf-0", "hf-1"):
                args = ["--engine", "hf", "--device", "cpu", "--store", str(store), "--local-dir", str(tmp / w)]
                args += ["--capacity", "32", "--max-batch", "32", "--heartbeat", "2"]
                procs.append(spawn(worker_command(url, namespace, w, *args), tmp / f"{w}.log", env=env_vars, cwd=REPO))
            await client.wait_for_version(0, replicas=2, timeout=300)
            for i, mode in enumerate(rounds):
                before = client.latest_version or 0
                done: asyncio.Queue[None] = asyncio.Queue()
                every = sessions * TURNS_PER_SESSION_PER_VERSION
                pub = asyncio.ensure_future(_publisher_loop(client, publisher, tensors, done, every))
                per = await asyncio.gather(
                    *(
                        _session(
                            client, s, mode=mode, turns=turns, first=first, env=env, out=out, tag=f"r{i}", done=done
                        )
                        for s in range(sessions)
                    )
                )
                pub.cancel()
                published[mode] += (client.latest_version or 0) - before
                out_rows[mode] += [r for rows in per for r in rows]
                print(f"round {i} ({mode}): done, {published[mode]} versions published so far", flush=True)
            fallbacks = {
                reason: client.metrics.affinity_fallbacks.labels(client_id="trainer", reason=reason)._value.get()
                for reason in ("not_taken_in_time", "replica_gone", "replica_leaving", "replica_incompatible")
            }
        finally:
            stop_all(procs, timeout=30)
            publisher.close()
    return {
        "rows": out_rows,
        "published": published,
        "fallbacks": fallbacks,
        "shape": {"sessions": sessions, "turns": turns, "first": first, "env": env, "out": out, "engines": 2},
    }


def run(quick: bool = False) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp, temp_broker() as broker:
        data = asyncio.run(_main(broker.url, Path(tmp), quick))
    rows_by = data["rows"]
    turns = data["shape"]["turns"]
    later = [r for r in rows_by["affinity"] if r["turn"] > 0]
    hits = sum(r["hit"] for r in later) / len(later)
    base_later = [r for r in rows_by["shared"] if r["turn"] > 0]
    base_hits = sum(r["hit"] for r in base_later) / len(base_later)
    outside = sum(r["outside_policy"] for rs in rows_by.values() for r in rs)
    out: list[Row] = []
    hits_met = hits >= TARGET_HITS
    print(
        f"affinity hits {hits!r} (target >= {TARGET_HITS}: {'met' if hits_met else 'missed'}); without: {base_hits!r}"
    )
    print(f"turns outside their session's version policy: {outside}; versions published {data['published']}")
    out.append(
        Row(
            "session-routing/affinity",
            "turns 2.. on the same replica",
            "fraction",
            hits,
            base_hits,
            BASELINE,
            target=f">= {TARGET_HITS}",
            met=hits_met,
            extra={"outside_policy": outside, "published": data["published"], "fallbacks": data["fallbacks"]}
            | data["shape"]
            | {"threads_per_engine": 1}
            | machine_load(),
        )
    )
    for turn in range(turns):
        with_ = [r for r in rows_by["affinity"] if r["turn"] == turn]
        without = [r for r in rows_by["shared"] if r["turn"] == turn]
        none = [r for r in rows_by["none"] if r["turn"] == turn]
        p50, base = statistics.median(r["s"] for r in with_), statistics.median(r["s"] for r in without)
        speedup = base / p50
        last = turn == turns - 1
        prompt = statistics.mean(r["prompt"] for r in with_)
        case = f"turn {turn + 1} ({prompt:.0f} prompt tokens avg)"
        met = speedup >= TARGET_SPEEDUP if last else None
        print(
            f"{case}: p50 {p50!r} s with affinity, {base!r} s without, "
            f"{statistics.median(r['s'] for r in none)!r} s with no reuse; speedup {speedup!r}"
            + (f" (target >= {TARGET_SPEEDUP}x: {'met' if met else 'missed'})" if last else "")
        )
        out.append(
            Row(
                "session-routing/turn-p50",
                case,
                "s",
                p50,
                base,
                BASELINE,
                higher_is_better=False,
                target=f"<= {1 / TARGET_SPEEDUP}x baseline" if last else "",
                met=met,
                extra={
                    "speedup": speedup,
                    "p99_s": percentile([r["s"] for r in with_], 99),
                    "baseline_p99_s": percentile([r["s"] for r in without], 99),
                    "no_reuse_p50_s": statistics.median(r["s"] for r in none),
                    "speedup_vs_no_reuse": statistics.median(r["s"] for r in none) / p50,
                    "sessions_per_replica_first_turn": dict(Counter(r["worker"] for r in with_)),
                },
            )
        )
        out.append(
            Row(
                "session-routing/prefill",
                case,
                "tokens/turn",
                statistics.mean(r["prompt"] - r["cached"] for r in with_),
                statistics.mean(r["prompt"] - r["cached"] for r in without),
                BASELINE,
                higher_is_better=False,
            )
        )
    return out
