"""Test fault points (``runtime.faults``): armed by the environment, also when it is set while the
process runs (a trainer that arms its own commit), and silent for every other point."""

from __future__ import annotations

import pytest

from rollfleet.runtime import faults


def test_a_point_fires_only_when_the_environment_names_it_even_if_armed_after_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.point("worker:job-delivered")  # unarmed: nothing happens
    monkeypatch.setenv(faults.ENV, "raise:worker:job-delivered")
    faults.point("worker:mid-drain")  # another point: nothing happens
    with pytest.raises(faults.InjectedFault):
        faults.point("worker:job-delivered")
    monkeypatch.setenv(faults.ENV, "explode:worker:job-delivered")
    with pytest.raises(ValueError, match="expected"):
        faults.point("worker:mid-drain")  # a mistyped fault is said at the first point passed
    monkeypatch.delenv(faults.ENV)
    faults.point("worker:job-delivered")  # disarmed again
