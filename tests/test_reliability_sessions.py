"""Reliability scenario 11 (CI size): sessions while replicas are SIGKILLed and versions published."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability.scenarios.sessions import sessions_under_kills

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_session_turns_are_answered_once_within_policy_under_kills(tmp_path: Path) -> None:
    fig = await sessions_under_kills(tmp_path, sessions=8, turns=5, workers=3, kills=2)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.notes["turns outside their session's version policy"] == 0
    assert fig.lost == 0 and fig.duplicated == 0 and fig.faults == 2
    assert fig.completed >= 30
