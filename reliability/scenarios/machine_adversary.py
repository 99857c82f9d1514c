"""Scenario 12: the machine adversary's campaign (``reliability.adversary``) as one scenario's figures,
and the campaign's plan (its fixed seeds, named schedules and further runs), kept in this one place.

Many seeds and named schedules, each one run of the adversary judged by its oracle; their
reports summed into the suite's ``Figures`` (``python -m reliability``, ``make reliability``).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from reliability.adversary.run import Config, print_report, run_one
from reliability.scenarios.common import Figures

# The long campaign's seeds (fixed, so the page's figures can be reproduced run by run).
SEEDS = [19, 1905, 7, 42, 101, 2024, 31337, 4242, 8080, 99, 123, 777]
# Runs with the components the default machine does not start: the policy store in a bucket
# behind fault proxies, sglang replicas behind keyed engine servers, and the store-loss schedule.
MORE_RUNS: list[dict[str, object]] = [
    {"seed": 31337, "duration": 60.0, "store": "s3"},
    {"seed": 4242, "duration": 60.0, "store": "s3", "sglang": 1},
    {"seed": 8080, "duration": 60.0, "sglang": 1},
    {"schedule": "engines", "seed": 1, "duration": 35.0, "sglang": 1},
    {"schedule": "broker-stores", "seed": 2, "duration": 45.0},
    {"seed": 5, "duration": 60.0, "cluster": True},  # a 3-node cluster: nodes killed, frozen, cut off
    # The fleet sized by `rollfleet autoscale` controllers (3:5, no auth): controllers killed, frozen and
    # doubled, replicas killed while they start, scale-ins during an activation and resumable jobs.
    {"schedule": "autoscaler", "seed": 1, "duration": 60.0},
]
# The named schedules a long campaign runs too: (schedule, seed, duration, hf workers, echo workers).
NAMED_RUNS = [
    ("drain-flaky-mount", 5, 35.0, 1, 2),
    ("sessions-trainer", 7, 35.0, 0, 3),
    ("chunks-consumers", 8, 35.0, 0, 3),
    ("long-at-most-once", 9, 60.0, 0, 3),
    ("pauses", 11, 40.0, 0, 3),
    ("publishers", 5, 45.0, 0, 3),
]


async def campaign(
    workdir: Path,
    seeds: list[int],
    duration: float,
    hf_seeds: int = 0,
    named: list[tuple[str, int, float, int, int]] | None = None,
    more: list[dict[str, Any]] | None = None,
) -> Figures:
    """Many seeds (the last ``hf_seeds`` with an hf replica too) and the ``named`` schedules, as
    one reliability scenario's figures (``python -m reliability``, scenario 12). ``more``: further
    runs, each a ``Config``'s fields (a bucket store, sglang engine servers, a named schedule)."""
    named = named or []
    # `make reliability` adds fresh seeds (RF_ADV_FRESH_SEEDS=<n>) to the fixed ones, printed
    # here and in every run's line, so each can be replayed.
    fresh = [secrets.randbelow(10**6) for _ in range(int(os.environ.get("RF_ADV_FRESH_SEEDS") or 0))]
    if fresh:
        print(f"adversary fresh seeds: {', '.join(map(str, fresh))}", flush=True)
    fig = Figures(
        "12",
        "The machine adversary: random faults composed at random moments, an independent oracle",
        {"seeds": len(seeds) + len(fresh), "duration_s": duration, "hf_seeds": hf_seeds, "named_schedules": len(named)},
    )
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    checks: dict[str, int] = {}
    events: dict[str, int] = {}
    unverified: dict[str, int] = {}
    runs = []
    plan = [(None, seed, duration, 1 if i >= len(seeds) - hf_seeds else 0, 3) for i, seed in enumerate(seeds)]
    plan += [(None, seed, duration, 0, 3) for seed in fresh]
    runs_planned = [dict(schedule=sc, seed=se, duration=du, hf=hf, workers=w) for sc, se, du, hf, w in [*plan, *named]]
    for fields in [*runs_planned, *(more or [])]:
        schedule, seed = fields.get("schedule"), fields["seed"]
        modes = ("store", "sglang", "hf", "cluster", "autoscale")
        tag = "-".join(f"{k}{fields[k]}" for k in modes if fields.get(k) not in (None, 0, "dir", False))
        cfg = Config(**{"workdir": workdir / f"{schedule or 'seed'}-{seed}{'-' + tag if tag else ''}", "quiet": True,
                        **fields})  # fmt: skip
        hf = cfg.hf
        report = await run_one(cfg)
        print_report(report)
        s = report.summary()
        runs.append(
            {
                "seed": f"{schedule + ' ' if schedule else ''}{seed}{f' ({tag})' if tag else ''}",
                "hf": hf,
                "seconds": report.seconds,
                "events": report.events,
                "checks": s["checks"],
                "violations": s["violations"],
                "replay": cfg.replay(),
            }
        )
        for k, v in report.checks.items():
            checks[k] = checks.get(k, 0) + v
        for k, v in report.events_by_kind.items():
            events[k] = events.get(k, 0) + v
        for k, v in report.unverified.items():
            unverified[k] = unverified.get(k, 0) + v
        fig.submitted += int(report.notes.get("calls", 0))
        fig.completed += int(report.notes.get("results_accepted", 0))
        fig.failed += sum((report.notes.get("errors_by_class") or {}).values())
        fig.faults += report.events
        fig.versions_published += int(report.notes.get("versions_committed", 0))
        fig.versions_activated += int(report.notes.get("activations", 0))
        for v in report.violations:
            fig.problems.append(f"seed {seed}: {v.line()}  (replay: {cfg.replay()})")
            hang = v.check == "resolution" and "unanswered" in v.message
            fig.lost += v.check in ("lost", "stranded", "orphan") or hang
            fig.duplicated += v.check in ("once", "twice", "moved")
        if report.crashed:
            fig.problems.append(f"seed {seed}: crashed: {report.crashed}  (replay: {cfg.replay()})")
        if report.vacuous:
            fig.problems.append(f"seed {seed}: {report.vacuous}  (replay: {cfg.replay()})")
    fig.notes["runs"] = len(runs)
    fig.notes["events injected"] = sum(events.values())
    fig.notes["events by kind"] = events
    fig.notes["invariant checks"] = sum(checks.values())
    fig.notes["checks by invariant"] = checks
    fig.notes["violations"] = len(fig.problems)
    fig.notes["not verifiable (counted, not violations)"] = unverified
    fig.notes["runs (seed, seconds, events, checks, violations)"] = [
        (r["seed"], r["seconds"], r["events"], r["checks"], r["violations"]) for r in runs
    ]
    # (for the page's latest-campaign region, ``reliability.scenarios.run.campaign_section``)
    fig.notes["_campaign"] = {"started": started, "fresh": fresh, "runs": runs}
    fig.seconds = time.monotonic() - t0
    return fig
