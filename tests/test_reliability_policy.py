"""Reliability scenarios 4-7 (CI sizes): publisher kills, a replica killed mid-apply, corrupt
deltas, a trainer restart. Real processes, real SIGKILLs; see ``reliability/scenarios/policy.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability.scenarios.policy import corrupt_deltas, publisher_kills, replica_killed_mid_apply, trainer_restart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_publisher_killed_at_every_stage_leaves_nothing_partial(tmp_path: Path) -> None:
    fig = await publisher_kills(tmp_path)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.faults == 5 and fig.notes["tmp_dirs_left"] == []


async def test_hf_worker_killed_mid_apply_reseeds_to_the_trainers_bytes(tmp_path: Path) -> None:
    fig = await replica_killed_mid_apply(tmp_path, points=("apply:mid-version",))
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.notes["apply:mid-version: live digest equals trainer's"] is True


async def test_corrupt_deltas_are_refused_and_the_next_keyframe_activates(tmp_path: Path) -> None:
    fig = await corrupt_deltas(tmp_path)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.faults == 4 and fig.notes["keyframe_past_corrupt_delta"] is True


async def test_trainer_restart_recovers_pending_results_and_latest_version(tmp_path: Path) -> None:
    fig = await trainer_restart(tmp_path, jobs=60)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.lost == 0 and fig.duplicated == 0 and fig.notes["pending"] > 0
