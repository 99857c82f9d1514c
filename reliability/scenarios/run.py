"""``python -m reliability``: run every scenario at full size and write their figures into docs/reliability.md.

python -m reliability                 # all scenarios, long sizes (make reliability)
python -m reliability --quick         # CI sizes
python -m reliability --only 12       # some scenarios (here: the machine adversary's campaign alone)
python -m reliability --out PATH      # write into another page (default docs/reliability.md)

The page's prose (the promises, the findings, how the adversary works) is written by hand, in
the page; this writes only its generated regions, each between ``<!-- generated: NAME -->`` and
``<!-- end: NAME -->``:

- ``figures``: the table and the details of every scenario, from a run of all of them that kept
  every promise (a run that broke one writes the page, with its figures, beside it as
  ``reliability.failed.md``, and leaves these as they were);
- ``latest campaign``: the machine adversary's campaign (scenario 12), whenever it ran, passed or
  not: its runs, seeds and replays, events, facts judged, and every violation. It states its own
  verdict, so it is never held back: the page says what the latest campaign found.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from reliability.scenarios import (
    contract,
    fuzz,
    machine_adversary,
    policy,
    replay_truth,
    request_path,
    security,
    sessions,
)
from reliability.scenarios.common import REPO, Figures

Scenario = Callable[[Path], Awaitable[Figures]]


def scenarios(quick: bool) -> list[tuple[str, Scenario]]:
    """(id, run) per scenario; ``quick`` uses the CI sizes, otherwise the long ones."""
    q = quick

    async def s8(_: Path) -> Figures:
        return await asyncio.to_thread(fuzz.fuzz_all, 200 if q else 2000)

    return [
        (
            "1",
            lambda d: request_path.worker_kills(
                d, jobs=200 if q else 1500, kills=2 if q else 10, workers=3 if q else 4, rate=50.0 if q else 80.0
            ),
        ),
        (
            "2",
            lambda d: request_path.broker_restart(
                d, jobs=100 if q else 600, rate=40.0, down_s=1.0 if q else 2.0, restarts=1 if q else 3
            ),
        ),
        ("3", lambda d: request_path.cluster_node_loss(d, jobs=100 if q else 400, rate=30.0)),
        ("4", lambda d: policy.publisher_kills(d)),
        (
            "5",
            lambda d: policy.replica_killed_mid_apply(d, points=policy.APPLY_POINTS[:1] if q else policy.APPLY_POINTS),
        ),
        ("6", lambda d: policy.corrupt_deltas(d)),
        ("7", lambda d: policy.trainer_restart(d, jobs=60 if q else 200)),
        ("8", s8),
        ("9a", lambda d: security.hostile_versions(d)),
        ("9b", lambda d: security.token_end_to_end(d)),
        ("9c", lambda d: security.tls_end_to_end(d)),
        ("10", lambda d: contract.exact_pins(d, jobs=80 if q else 400, versions=5 if q else 15)),
        (
            "11",
            lambda d: sessions.sessions_under_kills(
                d, sessions=8 if q else 40, turns=5 if q else 8, workers=3, kills=2 if q else 8
            ),
        ),
        ("13a", lambda d: replay_truth.replay_truth(d, "hf", jobs=10 if q else 50, load_jobs=2 if q else 10)),
        ("13b", lambda d: replay_truth.replay_truth(d, "vllm", jobs=5 if q else 50, load_jobs=1 if q else 10)),
        (
            "12",
            lambda d: machine_adversary.campaign(
                d,
                seeds=machine_adversary.SEEDS[:2] if q else machine_adversary.SEEDS,
                duration=30.0 if q else 60.0,
                hf_seeds=0 if q else 2,
                named=[] if q else machine_adversary.NAMED_RUNS,
                more=[] if q else machine_adversary.MORE_RUNS,
            ),
        ),
    ]


async def run_all(quick: bool, only: set[str] | None) -> list[Figures]:
    out: list[Figures] = []
    root = Path(tempfile.mkdtemp(prefix="rf-reliability-"))
    try:
        for sid, run in scenarios(quick):
            if only and sid not in only and sid.rstrip("abc") not in only:
                continue
            if sid == "9c" and shutil.which("openssl") is None:
                continue
            print(f"--- scenario {sid}", flush=True)
            t0 = time.monotonic()
            try:
                fig = await asyncio.wait_for(run(root / f"s{sid}"), 3600 if sid == "12" else 900)
            except Exception as exc:  # a crashed scenario is a result too
                fig = Figures(sid, f"scenario {sid} crashed", problems=[f"{type(exc).__name__}: {exc}"])
                fig.notes["traceback"] = traceback.format_exc()[-2000:]
                fig.seconds = time.monotonic() - t0
            print(fig.summary(), flush=True)
            out.append(fig)
    finally:
        # A run that found something keeps its work directory (the adversary removes those of
        # the runs that passed): its logs, wiretap and oracle input are what explain a finding.
        if any(f.problems for f in out):
            print(f"work directories of the runs with findings kept in {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)[:400].replace("|", "\\|")
    return str(value).replace("|", "\\|").replace("\n", " ")[:400]


def figures_section(figs: list[Figures], quick: bool, seconds: float) -> str:
    """The ``figures`` region: the table of every scenario, then each one's details."""
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Figures",
        "",
        f"Measured by `make reliability` ({'CI' if quick else 'long'} sizes) on {when}: "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"loopback only; {seconds:.0f} s in all. Every scenario drives real processes.",
        "",
        "| # | scenario | submitted | completed | duplicated | lost | re-executed | faults "
        "| versions published / activated | time to recover (max) | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        rec = f"{max(f.recover_s):.2f} s" if f.recover_s else "-"
        ok = "pass" if f.passed else "**FAIL**"
        lines.append(
            f"| {f.scenario} | {f.title} | {f.submitted} | {f.completed} | {f.duplicated} | {f.lost} | {f.reexecuted} "
            f"| {f.faults} | {f.versions_published} / {f.versions_activated} | {rec} | {ok} |"
        )
    lines += ["", "Scenario 8 counts examples (inputs tried) under *submitted* and *faults*.", ""]
    lines += ["## Details per scenario", ""]
    for f in figs:
        lines += [f"### {f.scenario}. {f.title}", "", f"Size: `{json.dumps(f.size)}`; {f.seconds:.1f} s.", ""]
        if f.recover_s:
            lines.append(f"Time to recover per fault (s): {', '.join(f'{r:.2f}' for r in f.recover_s)}.")
            lines.append("")
        for key, value in f.notes.items():
            if key != "traceback" and not key.startswith("_"):
                lines.append(f"- {key}: {_fmt(value)}")
        if f.problems:
            lines += ["", "**Broken promises:**", ""] + [f"- {p}" for p in f.problems]
        lines.append("")
    return "\n".join(lines)


def _counts(counts: dict[str, int]) -> str:
    """``{"kill": 3, "publish": 9}`` as "publish 9, kill 3" (largest first)."""
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def campaign_section(fig: Figures) -> str:
    """The ``latest campaign`` region, from scenario 12's figures (``machine_adversary.campaign``)."""
    c = fig.notes.get("_campaign") or {}
    runs = c.get("runs") or []
    when = c.get("started") or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    minutes, secs = divmod(fig.seconds, 60.0)
    fresh = c.get("fresh") or []
    unverified = fig.notes.get("not verifiable (counted, not violations)") or {}
    verdict = (
        "**It passed: 0 violations.**"
        if fig.passed
        else f"**It did not pass: {len(fig.problems)} violations** (each with the command that replays its run):"
    )
    lines = [
        "### The latest campaign",
        "",
        f"Written by `make reliability` (`python -m reliability`, scenario 12) on {when}, on "
        f"{platform.system()} {platform.machine()} with {os.cpu_count()} CPUs: {len(runs)} runs in "
        f"{fig.seconds:,.2f} s ({int(minutes)} min {secs:.0f} s)"
        + (f", {len(fresh)} of them on fresh seeds ({', '.join(map(str, fresh))})" if fresh else "")
        + f". {fig.faults:,} events injected ({_counts(fig.notes.get('events by kind') or {})}); "
        f"{int(fig.notes.get('invariant checks') or 0):,} facts judged "
        f"({_counts(fig.notes.get('checks by invariant') or {})}); {sum(unverified.values()):,} counted as not "
        f"verifiable; {fig.submitted:,} calls, {fig.completed:,} results accepted, {fig.failed:,} typed "
        f"errors, {fig.versions_published:,} versions committed, {fig.versions_activated:,} activations.",
        "",
        verdict,
        "",
    ]
    lines += [f"- {p}" for p in fig.problems]
    if fig.problems:
        lines.append("")
    lines += ["| run | seconds | events | facts judged | violations | replay |", "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(
            f"| {r['seed']} | {r['seconds']:.1f} | {r['events']} | {r['checks']} | {r['violations']} "
            f"| `{r.get('replay', '')}` |"
        )
    return "\n".join(lines)


FIGURES, LATEST_CAMPAIGN = "figures", "latest campaign"  # the page's generated regions


def splice(page: str, region: str, body: str) -> str:
    """``page`` with its generated ``region`` replaced by ``body``."""
    begin, end = f"<!-- generated: {region} -->", f"<!-- end: {region} -->"
    i, j = page.find(begin), page.find(end)
    if i < 0 or j < i:
        raise ValueError(f"the page has no generated region {region!r} (between {begin} and {end})")
    return page[: i + len(begin)] + "\n\n" + body.strip() + "\n\n" + page[j:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reliability", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI sizes")
    parser.add_argument("--only", default=None, help="comma-separated scenario ids (1-13)")
    parser.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    args = parser.parse_args(argv)
    os.environ.setdefault("ROLLFLEET_LOG_LEVEL", "warning")
    only = set(args.only.split(",")) if args.only else None
    out = Path(args.out)
    page = out.read_text() if out.exists() else ""
    for region in (FIGURES, LATEST_CAMPAIGN):  # (a page it cannot write is said before hours of scenarios)
        splice(page, region, "")
    t0 = time.monotonic()
    figs = asyncio.run(run_all(args.quick, only))
    failed = [f.scenario for f in figs if not f.passed]
    campaign = next((f for f in figs if f.scenario == "12"), None)
    if campaign is not None:  # (passed or not: the region says which)
        page = splice(page, LATEST_CAMPAIGN, campaign_section(campaign))
        out.write_text(page)
        print(f"wrote the latest campaign into {out}")
    if only is not None:
        print(f"only scenarios {sorted(only)} ran: the figures of {out} left as they were")
        return 1 if failed else 0
    whole = splice(page, FIGURES, figures_section(figs, args.quick, time.monotonic() - t0))
    if failed:
        # The figures state the promises as kept: never published over figures that break one.
        rejected = out.with_name(out.stem + ".failed.md")
        rejected.write_text(whole)
        print(
            f"broken promises in scenarios {failed}; {out}'s figures left as they were, this run's in {rejected}",
            file=sys.stderr,
        )
        return 1
    out.write_text(whole)
    print(f"wrote {out}")
    return 0
