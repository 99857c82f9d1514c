"""Scenario 11: sessions while replicas are SIGKILLed and versions are published.

Sessions with random version policies (pinned, monotonic, free) and retry policies run turns
on echo ``rollfleet worker`` processes that follow the store; the trainer publishes versions,
and every few seconds one worker is SIGKILLed (often mid-turn) and restarted under the same id.
Every turn must be answered exactly once, with a result that obeys its session's policy, or a
typed error (``Interrupted`` only for ``at_most_once`` sessions); a session carries on after
an error. Affinity (turns served where the previous turn was) and fallbacks are reported.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from pathlib import Path
from typing import Any

from harness import ProcessGroup, tensors_at, write_base_checkpoint
from reliability.scenarios.common import REPO, Figures, Ledger, read_activations, start_broker
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams
from rollfleet.schemas.errors import Interrupted, NoCompatibleReplica, RollfleetError
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

POLICIES = ("pinned", "monotonic", "free")
WORKER_ARGS = ("--echo-token-latency", "0.01", "--echo-prefill-latency", "0.0005", "--capacity", "8")


async def sessions_under_kills(
    workdir: Path, sessions: int = 12, turns: int = 6, workers: int = 3, kills: int = 3, seed: int = 11
) -> Figures:
    fig = Figures(
        "11",
        "Sessions: replicas SIGKILLed mid-turn while versions are published",
        {"sessions": sessions, "turns": turns, "workers": workers, "kills": kills},
    )
    t0 = time.monotonic()
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    base = write_base_checkpoint(workdir / "base")
    store = workdir / "store"
    broker = start_broker(workdir)
    procs = ProcessGroup(workdir, cwd=REPO)

    def start(i: int) -> None:
        local = str(workdir / f"local{i}")
        procs.worker(broker.url, "rel11", f"w{i}", "--store", str(store), "--local-dir", local, *WORKER_ARGS)

    turns_of: dict[str, list[tuple[int, Any]]] = {}
    settings: dict[str, tuple[str, str]] = {}
    try:
        async with await RolloutClient.connect(broker.url, namespace="rel11", client_id="trainer") as client:
            ledger = Ledger(client)
            publisher = PolicyPublisher(store, base, keep_last=None)
            await client.publish_policy(publisher, tensors_at(0))
            fig.versions_published += 1
            for i in range(workers):
                start(i)
            await client.wait_for_version(0, replicas=workers, timeout=60)

            async def conversation(n: int) -> None:
                policy, retry = rng.choice(POLICIES), "at_most_once" if rng.random() < 0.25 else "replayable"
                async with client.session(
                    f"s{n}",
                    min_version=0,
                    version_policy=policy,
                    retry_policy=retry,
                    affinity_wait_s=1.0,  # type: ignore[arg-type]
                ) as s:
                    settings[s.session_id] = (policy, retry)
                    context = [1 + n, 2]
                    for turn in range(turns):
                        payload = RolloutPayload(
                            prompt_token_ids=list(context), sampling=SamplingParams(max_tokens=rng.randint(20, 120))
                        )
                        try:
                            result: Any = await s.generate(payload, timeout=60)
                            context += result.outputs[0].token_ids[:8]
                        except RollfleetError as exc:
                            result = exc
                        turns_of.setdefault(s.session_id, []).append((turn, result))
                        await asyncio.sleep(rng.random() * 0.2)

            async def chaos() -> None:
                for _ in range(kills):
                    await asyncio.sleep(1.5 + rng.random())
                    victim = rng.randrange(workers)
                    procs.kill(f"w{victim}")
                    fig.faults += 1
                    latest = client.latest_version or 0
                    await client.publish_policy(publisher, tensors_at(latest + 1))
                    fig.versions_published += 1
                    await asyncio.sleep(0.5)
                    start(victim)  # the same id: its own subject and consumer carry on

            await asyncio.gather(chaos(), *(conversation(n) for n in range(sessions)))
            await asyncio.sleep(1.0)  # late duplicates would arrive now
            fig.duplicated = await ledger.duplicated()
            fig.versions_activated = len(await read_activations(client.js, client.names))
            fallbacks = {
                reason: client.metrics.affinity_fallbacks.labels(client_id="trainer", reason=reason)._value.get()
                for reason in ("not_taken_in_time", "replica_gone", "replica_leaving", "replica_incompatible")
            }
    finally:
        procs.close()
        broker.stop()
    _judge(fig, turns_of, settings, sessions * turns, fallbacks)
    fig.seconds = time.monotonic() - t0
    return fig


def _judge(
    fig: Figures,
    turns_of: dict[str, list[tuple[int, Any]]],
    settings: dict[str, tuple[str, str]],
    expected: int,
    fallbacks: dict[str, float],
) -> None:
    outside: list[str] = []
    untyped: list[str] = []
    hits = later = 0
    for sid, answered in turns_of.items():
        policy, retry = settings[sid]
        results = [r for _, r in answered if isinstance(r, RolloutResult)]
        for _, r in answered:
            if isinstance(r, RolloutResult):
                continue
            # A pinned session whose version every replica has left is told so, not retryable.
            hopeless_pin = policy == "pinned" and isinstance(r, NoCompatibleReplica) and "pinned to" in r.message
            if not (isinstance(r, RollfleetError) and (r.retryable or hopeless_pin)) or (
                isinstance(r, Interrupted) and retry != "at_most_once"
            ):
                untyped.append(f"{sid}: {r!r}")
        if policy == "pinned" and results:
            pin = results[0].version_start
            outside += [
                f"{sid}: pinned {pin}, ran {r.version_start}..{r.version_end}"
                for r in results
                if not r.version_start == r.version_end == pin
            ]
        if policy == "monotonic":
            outside += [
                f"{sid}: {a.version_end} then {b.version_start}"
                for a, b in itertools.pairwise(results)
                if b.version_start < a.version_end
            ]
        for a, b in itertools.pairwise(results):
            later += 1
            hits += a.worker_id == b.worker_id
    answered = sum(len(v) for v in turns_of.values())
    fig.submitted = expected
    fig.completed = sum(isinstance(r, RolloutResult) for v in turns_of.values() for _, r in v)
    fig.failed = answered - fig.completed
    fig.lost = expected - answered
    fig.expect(not outside, f"{len(outside)} turns outside their session's version policy: {outside[:5]}")
    fig.expect(
        not untyped,
        f"errors that are not typed and retryable (but a pinned session the fleet left), or Interrupted for "
        f"replayable: {untyped[:5]}",
    )
    fig.expect(fig.lost == 0, f"{fig.lost} turns without an answer")
    fig.expect(fig.duplicated == 0, f"{fig.duplicated} turns answered twice")
    fig.expect(fig.completed >= expected // 2, f"only {fig.completed} of {expected} turns served")
    fig.notes["turns outside their session's version policy"] = len(outside)
    fig.notes["affinity: consecutive served turns on the same replica"] = f"{hits} / {later}"
    fig.notes["turns moved off their replica, by reason"] = {k: int(v) for k, v in fallbacks.items()}
    fig.notes["failures by session policy"] = {
        policy: sum(
            1
            for sid, v in turns_of.items()
            if settings[sid][0] == policy
            for _, r in v
            if not isinstance(r, RolloutResult)
        )
        for policy in POLICIES
    }
    fig.notes["failures by code"] = {
        code: sum(1 for v in turns_of.values() for _, r in v if getattr(r, "code", None) == code)
        for code in sorted(
            {getattr(r, "code", "") for v in turns_of.values() for _, r in v if not isinstance(r, RolloutResult)}
        )
    }
