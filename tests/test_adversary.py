"""The machine adversary (issue 19), CI size: fixed seeds plus one fresh seed per run.

Each seed runs ``reliability.adversary`` for ``DURATION`` seconds against real processes (a
nats-server with the generated auth config, echo ``rollfleet worker`` processes with
``--verify-live``, the trainer process, the rogue worker, the wiretap) and asserts that the
independent oracle found no violation. A failure prints every violation, the seed and the
one-line command that replays it. ``RF_ADV_SEED=<n>`` picks the fresh seed (to replay a
CI failure under pytest); ``make reliability`` runs the long campaign.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from reliability.adversary import Config, print_report, run_one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DURATION = 30.0
FIXED_SEEDS = (19, 1905)
FRESH_SEED = int(os.environ.get("RF_ADV_SEED") or secrets.randbelow(10**6))


@pytest.mark.parametrize("seed", [*FIXED_SEEDS, FRESH_SEED], ids=[*map(str, FIXED_SEEDS), f"fresh-{FRESH_SEED}"])
async def test_the_adversary_finds_nothing(seed: int, tmp_path: Path) -> None:
    cfg = Config(seed=seed, duration=DURATION, workdir=tmp_path / "adversary", keep=True, quiet=True)
    print(f"adversary seed {seed}; replay: {cfg.replay()}")
    report = await run_one(cfg)
    print_report(report)
    assert report.events > 0 and sum(report.checks.values()) > 0, "the run injected or checked nothing"
    lines = "\n".join(v.line() for v in report.violations) or (report.crashed or "")
    assert report.passed, f"seed {seed}: {len(report.violations)} violations; replay: {cfg.replay()}\n{lines}"
