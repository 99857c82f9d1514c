"""A shortened `make demo`: the reward rises, every consumed sample respects its staleness bound,
and little is generated only to be dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def test_shortened_demo_learns_within_its_staleness_bound(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, str(REPO / "examples" / "async_grpo.py"), "--steps", "10", "--out", str(out), "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10
    assert summary["reward_end"] > summary["reward_start"]
    assert summary["max_staleness_seen"] <= summary["max_staleness_allowed"] == 1
    # The loop admits only what can be trained on in time: the old submit-ahead loop dropped a
    # third of its samples as too stale (31 to 34 %); a regression to it shows here.
    assert summary["dropped_stale_fraction"] < 0.1, summary["loop_totals"]
    assert summary["loop_totals"]["groups"] == 10 * 4
    for step in summary["history"]:
        assert step["staleness_max"] <= 1 and step["samples"] > 0
        assert step["version"] == step["step"]  # one published version per optimizer step
    assert (out / "rollfleet_demo.png").stat().st_size > 10_000
