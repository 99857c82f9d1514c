"""When a session's turn moves off the replica holding its context (``sessions.sticky``),
decided without I/O (milliseconds)."""

from __future__ import annotations

import time

from rollfleet.schemas import ReplicaStatus, VersionConstraint
from rollfleet.trainer_client.sessions.sticky import UNCLAIMED_LOOKS, move_reason


def _replica(state: str = "ready", version: int = 13, *, stale: bool = False) -> ReplicaStatus:
    now = time.time()
    return ReplicaStatus(
        worker_id="w6", state=state, active_version=version, engine="echo", capacity=3, in_flight=0,  # type: ignore[arg-type]
        heartbeat_at=now - (60.0 if stale else 0.0), heartbeat_interval_s=1.0, started_at=now - 100.0,
    )  # fmt: skip


EXACT = VersionConstraint("exact", 13)


def test_a_turn_stays_while_its_replica_may_still_take_it_or_runs_it() -> None:
    assert move_reason(_replica(), EXACT, taken=False, unclaimed_looks=0, waited=False) is None
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=0, waited=True) is None  # claimed: running
    # one look unclaimed: it may be claimed a moment after its delivery
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=UNCLAIMED_LOOKS - 1, waited=True) is None
    assert move_reason(_replica("draining"), EXACT, taken=True, unclaimed_looks=0, waited=True) is None


def test_a_turn_delivered_but_claimed_by_nobody_moves_once_it_has_waited() -> None:
    # Campaign 8, seed 103: the replica handed the turn back (not at v13 yet), then activated v13
    # but never took it again; the turn waited on its subject until it expired.
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=UNCLAIMED_LOOKS, waited=True) == "handed_back"
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=UNCLAIMED_LOOKS, waited=False) is None


def test_a_turn_moves_off_a_gone_leaving_or_incompatible_replica() -> None:
    assert move_reason(None, EXACT, taken=True, unclaimed_looks=0, waited=False) == "replica_gone"
    assert move_reason(_replica(stale=True), EXACT, taken=True, unclaimed_looks=0, waited=False) == "replica_gone"
    assert move_reason(_replica("draining"), EXACT, taken=False, unclaimed_looks=0, waited=False) == "replica_leaving"
    moved_on = _replica(version=14)
    assert move_reason(moved_on, EXACT, taken=True, unclaimed_looks=0, waited=False) == "replica_incompatible"
    assert move_reason(_replica(), EXACT, taken=False, unclaimed_looks=0, waited=True) == "not_taken_in_time"
