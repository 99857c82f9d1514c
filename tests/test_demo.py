"""A shortened `make demo`: the reward rises, every consumed sample respects its staleness bound,
and the loop's counters agree with what the demo trained on and dropped."""

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
    # What the loop counted is what the demo trained on and dropped. (How much is dropped depends
    # on how fast the fleet is against the trainer: `make demo` and `make bench` measure it.)
    totals = summary["loop_totals"]
    assert totals["groups"] == 10 * 4 and totals["samples"] == summary["samples"]
    assert totals.get("waste_groups_stale", 0) * 8 == summary["dropped_stale"]
    for step in summary["history"]:
        assert step["staleness_max"] <= 1 and step["samples"] > 0
        assert step["version"] == step["step"]  # one published version per optimizer step
    assert (out / "rollfleet_demo.png").stat().st_size > 10_000
