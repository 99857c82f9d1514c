"""The adversary's object-store mode (``--store s3``) as plain data: its events come from a stream
of their own, drawn only in that mode, and the oracle's ``converged`` decides from times and
versions alone (milliseconds, no processes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from reliability.adversary.objstore import CONVERGE_S, converged_by, heal_moments
from reliability.adversary.schedule import make_schedule, object_stores


def test_store_events_are_drawn_only_in_s3_mode_and_move_nothing_else() -> None:
    for seed in range(12):
        plain = make_schedule(seed, 90)
        s3 = make_schedule(seed, 90, store="s3")
        assert not [e for e in plain if e.kind.startswith("store_")]
        ours = [e for e in s3 if e.kind.startswith("store_")]
        assert ours and [e for e in s3 if not e.kind.startswith("store_")] == plain
        assert ours == object_stores(seed, 90)  # the seed's own stream, replayable
        for e in ours:
            assert e.params["victim"] in ("random", "all") and 0 < e.params["for_s"] <= 10


def test_heal_moments_are_the_ends_of_quiet_stretches_only() -> None:
    faults = [(10.0, 14.0), (12.0, 16.0), (40.0, 45.0), (50.0, 52.0), (90.0, 95.0)]
    heals, skipped = heal_moments(faults, horizon=110.0, bound=CONVERGE_S)
    # 16 (merged 10-16, next fault at 40): judged; 45: another fault 5 s later; 52: judged;
    # 95: the run watched only 15 s after it.
    assert heals == [16.0, 52.0] and skipped == 2


def test_converged_by_passes_a_replica_that_caught_up_and_flags_one_left_behind() -> None:
    caught_up = [(100.0, 3), (108.0, 3), (112.0, 5), (119.5, 5)]
    assert converged_by(caught_up, latest=5, deadline=120.0) == (True, 5)
    assert converged_by(caught_up, latest=6, deadline=120.0) == (False, 5)  # heard at 119.5, still at 5
    assert converged_by([(100.0, 3), (110.0, 3)], latest=5, deadline=120.0) == (None, 3)  # unheard near the end
    assert converged_by([(100.0, 3), (125.0, 5)], latest=5, deadline=120.0) == (None, 3)  # too late counts not


def _oracle(fleet: list[tuple[float, str, int]], store: str = "s3") -> Any:
    """An oracle over a made-up history: one replica process w1 alive from 0 to 200, v5 committed
    at 50, a store fault from 40 to 60, the registry heard as ``fleet`` (time, worker, version)."""
    from reliability.adversary.oracle import Oracle

    tl = SimpleNamespace(
        workers=[SimpleNamespace(worker_id="w1", start=0.0, end=200.0, paused_at=None, stops=[], engine="echo")],
        store_faults=[{"kind": "store_truncate", "workers": ["w1"], "from": 40.0, "to": 60.0}],
        hidden=[], corrupt=[], broker_down=[], broker_paused=[], publishers=[],
    )  # fmt: skip
    tap = SimpleNamespace(fleet=[(t, w, SimpleNamespace(active_version=v)) for t, w, v in fleet])
    cfg = SimpleNamespace(store=store, ack_wait=2.0, duplicate_window=15.0)
    oracle = Oracle(cfg=cfg, timeline=tl, tap=tap, trainer=[], rogue=[], finals={}, stored={}, activations=[],
                    weights=None, names=None)  # fmt: skip
    oracle.commits, oracle.t_first = [(50.0, 5)], 0.0
    oracle._check_converged()
    return oracle


def test_the_oracle_flags_a_replica_left_behind_after_the_store_healed() -> None:
    heartbeats = [(float(t), "w1") for t in range(0, 120, 2)]
    stuck = _oracle([(t, w, 3) for t, w in heartbeats])
    assert stuck.checks["converged"] == 1 and [v.check for v in stuck.violations] == ["converged"]
    assert "still at v3" in stuck.violations[0].message
    caught_up = _oracle([(t, w, 3 if t < 70 else 5) for t, w in heartbeats])
    assert caught_up.checks["converged"] == 1 and not caught_up.violations
    assert not _oracle([(t, w, 3) for t, w in heartbeats], store="dir").checks  # (judged in --store s3 only)
