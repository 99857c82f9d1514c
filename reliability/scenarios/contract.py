"""Scenario 10: version pins across activations, on real worker processes.

A trainer publishes versions while it submits exact, minimum-version and staleness jobs of
random lengths to three ``rollfleet worker`` processes that follow the store with different
drain bounds (one short enough to hand jobs back). Every answer is checked token by token
against the constraint it was submitted with; everything else must be a typed, retryable error.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

from harness import ProcessGroup, tensors_at, write_base_checkpoint
from reliability.scenarios.common import REPO, Figures, Ledger, gather_outcomes, read_activations, start_broker
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams, served_within
from rollfleet.schemas.errors import RollfleetError
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

DRAINS = (0.2, 1.0, 5.0)  # --exact-drain of each worker


async def exact_pins(workdir: Path, jobs: int = 80, versions: int = 5, seed: int = 7) -> Figures:
    fig = Figures("10", "Version pins across activations (exact, min, staleness)", {"jobs": jobs, "versions": versions})
    t0 = time.monotonic()
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    base = write_base_checkpoint(workdir / "base")
    store = workdir / "store"
    broker = start_broker(workdir)
    procs = ProcessGroup(workdir, cwd=REPO)
    try:
        async with await RolloutClient.connect(broker.url, namespace="rel10", client_id="trainer") as client:
            ledger = Ledger(client)
            publisher = PolicyPublisher(store, base, keep_last=None)
            await client.publish_policy(publisher, tensors_at(0))
            fig.versions_published += 1
            for i, drain in enumerate(DRAINS):
                procs.worker(
                    broker.url, "rel10", f"w{i}", "--store", str(store), "--local-dir", str(workdir / f"local{i}"),
                    "--echo-token-latency", "0.01", "--exact-drain", str(drain), "--capacity", "4",
                )  # fmt: skip
            await client.wait_for_version(0, replicas=len(DRAINS), timeout=60)
            handles: dict[str, Any] = {}
            kinds: dict[str, str] = {}
            publish_every = max(1, jobs // versions)
            for n in range(jobs):
                latest = client.latest_version or 0
                if n and n % publish_every == 0 and latest < versions:
                    await client.publish_policy(publisher, tensors_at(latest + 1))
                    fig.versions_published += 1
                roll = rng.random()
                if roll < 0.4:
                    kw: dict[str, Any] = {"exact_version": max(0, latest - rng.randint(0, 1))}
                elif roll < 0.7:
                    kw = {"min_version": rng.randint(0, latest)}
                else:
                    kw = {"max_staleness": rng.randint(0, 2)}
                key = f"job-{n}"
                payload = RolloutPayload(
                    prompt_token_ids=[1 + n % 50, 2], sampling=SamplingParams(max_tokens=rng.randint(5, 120))
                )
                handles[key] = await client.submit(payload, idempotency_key=key, timeout=30, **kw)
                kinds[key] = next(iter(kw))
                await asyncio.sleep(rng.random() * 0.05)
            fig.submitted = len(handles)
            results, errors = await gather_outcomes(handles, timeout=60)
            activations = await read_activations(client.js, client.names)
            duplicated = await ledger.duplicated()
    finally:
        procs.close()
        broker.stop()
    outside = [k for k, r in results.items() if not served_within(handles[k].job.constraint, r)]
    untyped = [k for k, e in errors.items() if not (isinstance(e, RollfleetError) and e.retryable)]
    fig.completed = len(results)
    fig.failed = len(errors)
    fig.lost = fig.submitted - len(results) - len(errors)
    fig.duplicated = duplicated
    fig.versions_activated = len(activations)
    fig.expect(not outside, f"{len(outside)} results outside their constraint: {outside[:5]}")
    fig.expect(not untyped, f"errors that are not typed and retryable: {[repr(errors[k]) for k in untyped[:5]]}")
    fig.expect(fig.lost == 0, f"{fig.lost} jobs without any answer")
    fig.expect(fig.duplicated == 0, f"{fig.duplicated} keys answered twice")
    fig.expect(fig.completed >= fig.submitted // 2, f"only {fig.completed} of {fig.submitted} served")
    exact_keys = [k for k in handles if kinds[k] == "exact_version"]
    spanning = [r for r in results.values() if isinstance(r, RolloutResult) and r.version_start != r.version_end]
    drains = [a.drain_s for a in activations]
    fig.notes["results outside their constraint"] = len(outside)
    fig.notes["exact jobs served / failed"] = (
        f"{sum(k in results for k in exact_keys)} / {sum(k in errors for k in exact_keys)}"
    )
    fig.notes["failures by code"] = {
        code: sum(1 for e in errors.values() if getattr(e, "code", "") == code)
        for code in sorted({getattr(e, "code", type(e).__name__) for e in errors.values()})
    }
    fig.notes["min/staleness results spanning an activation"] = len(spanning)
    if drains:
        fig.notes["drain before activation (s): mean / max"] = f"{statistics.fmean(drains):.3f} / {max(drains):.3f}"
    fig.notes["exact jobs handed back at a drain bound"] = sum(a.handed_back for a in activations)
    fig.seconds = time.monotonic() - t0
    return fig
