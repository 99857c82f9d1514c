"""Reliability scenario 10 (CI size): version pins across activations on real worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability.scenarios.contract import exact_pins

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_random_schedules_never_serve_outside_a_constraint(tmp_path: Path) -> None:
    fig = await exact_pins(tmp_path, jobs=60, versions=4)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.notes["results outside their constraint"] == 0 and fig.lost == 0 and fig.duplicated == 0
    assert fig.versions_activated >= 3  # activations happened while jobs ran (coalescing may skip versions)
    assert fig.completed >= 30
