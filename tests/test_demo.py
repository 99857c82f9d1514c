"""A shortened `make demo`: the reward rises and every consumed sample respects its staleness bound."""

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
    for step in summary["history"]:
        assert step["staleness_max"] <= 1 and step["samples"] > 0
        assert step["version"] == step["step"]  # one published version per optimizer step
    assert (out / "rollfleet_demo.png").stat().st_size > 10_000
