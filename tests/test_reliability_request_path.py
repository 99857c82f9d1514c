"""Reliability scenarios 1-3 (CI sizes): worker kills, a broker restart, a cluster node loss.

Each drives the real system (nats-server, `rollfleet worker` processes, SIGKILL) through the
scenario functions in ``reliability/scenarios/``; ``make reliability`` runs the same ones larger.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability.scenarios.request_path import broker_restart, cluster_node_loss, worker_kills

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_workers_killed_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    fig = await worker_kills(tmp_path, jobs=200, kills=2, workers=3)
    print(fig.summary())
    assert fig.passed, fig.problems
    assert fig.submitted == fig.completed == 200 and fig.lost == 0 and fig.duplicated == 0
    assert fig.faults >= 3  # two kills plus the worker that dies between storing a result and acking


async def test_broker_killed_and_restarted_loses_no_acknowledged_job(tmp_path: Path) -> None:
    fig = await broker_restart(tmp_path, jobs=100, rate=40.0, down_s=1.0)
    print(fig.summary())
    assert fig.passed, fig.problems
    assert fig.lost == 0 and fig.duplicated == 0 and fig.faults == 1


@pytest.mark.long  # (test_deploy_cluster is its short representative)
async def test_cluster_node_killed_under_load(tmp_path: Path) -> None:
    fig = await cluster_node_loss(tmp_path, jobs=100, rate=30.0)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.lost == 0 and fig.duplicated == 0
    # The slack: the fail-over probe answers with 1 s time-outs, and workers poll every 1 s.
    assert fig.notes["stall_s"] <= fig.notes["failover_s"] + 2.0
