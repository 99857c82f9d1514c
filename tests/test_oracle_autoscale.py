"""The autoscaler's invariants (``reliability.adversary.oracle_autoscale``) on recorded histories, no
processes: each keeps a history that holds its promise and flags one that breaks it in the way an
autoscaler would (a fleet above its maximum or short of its minimum once settled; two controllers
acting at once; a waiting request for a held version left unanswered; a resumable job cut by a
scale-in answered with a hole in it)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from reliability.adversary.autoscaler import lease_gaps
from reliability.adversary.oracle_autoscale import AutoscaleFacts, judge_autoscaler

T0 = 1_000_000.0
TTL = 6.0


def _controller(name: str, pid: int, start: float = 0.0, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "pid": pid,
        "start": T0 + start,
        "end": None,
        "how": "",
        "stops": [],
        "termed_at": None,
        "bounds": [2, 4],
        **kw,
    }


def _renewals(pid: int, start: float, end: float, every: float = 2.0) -> list[dict[str, Any]]:
    """The lease key rewritten by ``pid`` every ``every`` s from ``start`` to ``end`` (as the broker stored it)."""
    out, t = [], start
    while t < end:
        out.append({"t": T0 + t, "op": "PUT", "holder": f"host:{pid}", "seq": int(t * 10)})
        t += every
    return out


def _worker(wid: str, start: float, end: float | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "worker_id": wid,
        "pid": hash(wid) % 10_000,
        "start": T0 + start,
        "end": None if end is None else T0 + end,
        "how": "",
        "stops": [],
        "held": None,
        "parent": None,
        "leaving_at": None,
        **kw,
    }


def _facts(**kw: Any) -> dict[str, Any]:
    return {
        "t0": T0,
        "t_end": T0 + 40.0,
        "bounds": [2, 4],
        "policy": {"interval_s": 1.0, "lease_ttl_s": TTL, "need_s": 20.0},
        "controllers": [_controller("c1", 101)],
        "workers": [_worker("as-a", 0.0), _worker("as-b", 0.0)],
        "retires": [],
        "lease": _renewals(101, 0.5, 40.0),
        "lease_gaps": [],
        "evals": [],
        "bursts": [],
        **kw,
    }


def _judge(
    facts: dict[str, Any], broker_out: list[list[float]] | None = None, lost: Any = None, commits: Any = ()
) -> Any:
    """``lost(t)``: whether an answer the wiretap saw stored at ``t`` was lost with the broker's store
    (the oracle's ``lost_with_store``)."""
    oracle = SimpleNamespace(
        checks=defaultdict(int),
        unverified=defaultdict(int),
        violations=[],
        notes={},
        broker_out=broker_out or [],
        t_first=T0,
        weights=None,
        commits=list(commits),
    )

    def check(name: str, ok: bool, key: str | None, message: str, defect: str | None = None) -> bool:
        oracle.checks[name] += 1
        if not ok:
            oracle.violations.append((name, key, message))
        return ok

    oracle.check = check
    oracle.lost_with_store = lambda t, what, after=None: {"kind": "rollback"} if lost and lost(t) else None
    judge_autoscaler(oracle, facts)
    return oracle


def _flagged(oracle: Any, check: str) -> list[str]:
    return [m for name, _, m in oracle.violations if name == check]


# -- fleet-size ------------------------------------------------------------------------------------


def test_a_settled_fleet_within_its_bounds_passes() -> None:
    oracle = _judge(_facts())
    assert oracle.violations == [] and oracle.checks["fleet-size"] == 1
    assert oracle.notes["autoscaler"]["settled_s"] > 30


def test_a_fleet_above_its_maximum_once_settled_is_flagged() -> None:
    workers = [_worker(f"as-{i}", 0.0) for i in range(4)] + [_worker("as-extra", 20.0)]
    oracle = _judge(_facts(workers=workers))
    [message] = _flagged(oracle, "fleet-size")
    assert "5 worker processes" in message and "above max 4" in message and "as-extra" in message


def test_a_fleet_short_of_its_minimum_is_flagged_even_when_its_workers_exit_on_their_own() -> None:
    # A launch that crash-loops leaves the fleet short: a worker that exits by itself excuses nothing.
    workers = [_worker("as-a", 0.0), _worker("as-b", 0.0, end=15.0, how="exited ?")]
    oracle = _judge(_facts(workers=workers))
    [message] = _flagged(oracle, "fleet-size")
    assert "below min 2" in message


def test_a_worker_the_adversary_killed_is_replaced_within_the_reaction_time_unjudged() -> None:
    killed = _worker("as-b", 0.0, end=15.0, how="killed")
    replacement = _worker("as-c", 16.5)  # the next tick's launch
    oracle = _judge(_facts(workers=[_worker("as-a", 0.0), killed, replacement]))
    assert _flagged(oracle, "fleet-size") == []
    # Not replaced at all: flagged once the reaction time (two intervals and a slack) is over.
    oracle = _judge(_facts(workers=[_worker("as-a", 0.0), killed]))
    assert len(_flagged(oracle, "fleet-size")) == 1


def test_a_retired_worker_still_draining_does_not_count() -> None:
    workers = [_worker(f"as-{i}", 0.0) for i in range(3)]
    workers.append(_worker("as-draining", 0.0, end=30.0, how="terminated (retired by c1)", leaving_at=T0 + 10.0))
    workers.append(_worker("as-new", 10.5))
    retires = [{"t": T0 + 10.0, "controller": "c1", "worker_id": "as-draining"}]
    # (the draining one's launch at 0 s is unattributed; as-new is c1's)
    workers[-1]["parent"] = "c1"
    oracle = _judge(_facts(workers=workers, retires=retires))
    assert oracle.violations == []
    # Counted while it drains (no SIGTERM recorded), the fleet is above its maximum.
    workers[-2] = {**workers[-2], "leaving_at": None, "how": "exited ?"}
    oracle = _judge(_facts(workers=workers, retires=[]))
    assert len(_flagged(oracle, "fleet-size")) == 1


def test_nothing_is_judged_while_no_controller_acts_or_the_broker_is_away() -> None:
    # Frozen from 10 s to 40 s, its lease unrenewed: no one acts, nothing is settled after 10 s.
    frozen = _controller("c1", 101, stops=[[T0 + 10.0, T0 + 40.0]])
    workers = [_worker("as-a", 0.0), _worker("as-b", 0.0, end=20.0, how="killed")]
    oracle = _judge(_facts(controllers=[frozen], lease=_renewals(101, 0.5, 10.0), workers=workers))
    assert oracle.violations == []
    assert oracle.notes["autoscaler"]["settled_s"] < 10
    oracle = _judge(_facts(workers=workers), broker_out=[[T0 + 19.0, T0 + 40.0]])
    assert oracle.violations == []


def test_the_harnesss_own_workers_count_in_the_fleet_and_are_no_controllers_action() -> None:
    # An hf replica the harness started beside one follower: two replicas, the minimum.
    workers = [_worker("as-a", 0.0), _worker("h1", 0.0, fixed=True)]
    oracle = _judge(_facts(workers=workers))
    assert oracle.violations == []
    # (as-a's launcher unknown here: one unverified launch; h1 is nobody's)
    assert sum(v for k, v in oracle.unverified.items() if "launcher" in k) == 1


# -- one-acting ------------------------------------------------------------------------------------


def test_launches_and_retirements_within_the_lease_pass() -> None:
    workers = [_worker("as-a", 0.0), _worker("as-b", 0.0), _worker("as-c", 12.0, parent="c1")]
    retires = [{"t": T0 + 20.0, "controller": "c1", "worker_id": "as-c"}]
    workers[-1].update(how="terminated (retired by c1)", leaving_at=T0 + 20.0, end=T0 + 21.0)
    oracle = _judge(_facts(workers=workers, retires=retires))
    assert oracle.violations == [] and oracle.checks["one-acting"] == 2


def test_a_launch_by_a_controller_the_lease_does_not_name_is_flagged() -> None:
    c2 = _controller("c2", 202, start=5.0)  # a standby, never the holder
    workers = [_worker("as-a", 0.0), _worker("as-b", 0.0), _worker("as-x", 14.0, parent="c2")]
    oracle = _judge(_facts(controllers=[_controller("c1", 101), c2], workers=workers))
    [message] = _flagged(oracle, "one-acting")
    assert "c2" in message and "names 'host:101'" in message


def test_acting_past_half_a_lease_time_after_the_last_renewal_is_flagged() -> None:
    # c1 renewed last at 10.5 s (frozen, then thawed) and retires at 15 s: 4.5 s > 3 s.
    lease = _renewals(101, 0.5, 11.0)
    retires = [{"t": T0 + 15.0, "controller": "c1", "worker_id": "as-b"}]
    oracle = _judge(_facts(lease=lease, retires=retires))
    assert any("acting past half a lease time" in m for m in _flagged(oracle, "one-acting"))


def test_two_controllers_interleaving_faster_than_the_handover_bound_are_flagged() -> None:
    # c2 takes the lease at 20 s (c1's last renewal at 19.5 s: a takeover after 0.5 s of silence,
    # not a whole lease time) and launches at 20.2 s; c1 had retired at 19.8 s.
    lease = _renewals(101, 0.5, 20.0) + _renewals(202, 20.0, 40.0)
    workers = [_worker("as-a", 0.0), _worker("as-b", 0.0), _worker("as-c", 20.2, parent="c2")]
    retires = [{"t": T0 + 19.8, "controller": "c1", "worker_id": "as-b"}]
    controllers = [_controller("c1", 101), _controller("c2", 202, start=5.0)]
    oracle = _judge(_facts(controllers=controllers, lease=lease, workers=workers, retires=retires))
    assert any("handover bound" in m for m in _flagged(oracle, "one-acting"))
    # The same, c1 stopped cleanly at 19.9 s (it released the lease): a prompt handover is right.
    controllers[0].update(termed_at=T0 + 19.9, end=T0 + 20.5, how="terminated")
    lease = [*_renewals(101, 0.5, 20.0), {"t": T0 + 19.95, "op": "DEL", "holder": "", "seq": 1}]
    lease += _renewals(202, 20.0, 40.0)
    oracle = _judge(_facts(controllers=controllers, lease=lease, workers=workers, retires=retires))
    assert _flagged(oracle, "one-acting") == []


def test_the_lease_watch_is_blind_while_the_fleet_bucket_is_lost_until_a_write_is_seen_again() -> None:
    # Seed 12 (--autoscale 3:5): the registry's stream deleted at 18.5 s, its watch's consumer gone
    # with it; the next write it saw came at 35.2 s: a controller's actions between are unverifiable.
    lease = [
        {"t": T0 + 17.5, "seen": T0 + 17.5, "op": "PUT", "holder": "host:1"},
        {"t": T0 + 34.8, "seen": T0 + 35.2, "op": "PUT", "holder": "host:1"},
    ]
    deleted = {"kind": "delete_stream", "target": "registry", "lost_from": 0.0, "at": T0 + 18.5, "back": T0 + 18.6}
    assert lease_gaps([], [deleted], lease, T0 + 60) == [[T0 + 18.5, T0 + 35.2]]
    assert lease_gaps([], [{**deleted, "target": "jobs"}], lease, T0 + 60) == []  # (not the lease's bucket)
    rollback = {"kind": "rollback", "lost_from": T0 + 10.0, "at": T0 + 15.0, "back": T0 + 17.0}
    assert lease_gaps([[T0 + 15.0, T0 + 17.0]], [rollback], lease, T0 + 60)[1] == [T0 + 10.0, T0 + 17.5]


def test_an_action_while_the_lease_watch_was_away_is_not_verifiable() -> None:
    c2 = _controller("c2", 202, start=5.0)
    workers = [_worker("as-a", 0.0), _worker("as-b", 0.0), _worker("as-x", 14.0, parent="c2")]
    oracle = _judge(
        _facts(controllers=[_controller("c1", 101), c2], workers=workers, lease_gaps=[[T0 + 12.0, T0 + 16.0]])
    )
    assert _flagged(oracle, "one-acting") == []
    assert sum(v for k, v in oracle.unverified.items() if "the watch was away" in k) == 1


# -- held-wait ---------------------------------------------------------------------------------------


def _eval(answer: dict[str, Any] | None, version: int = 3) -> dict[str, Any]:
    return {
        "kind": "wait",
        "key": "eval-1",
        "version": version,
        "t0": T0 + 5.0,
        "deadline": T0 + 35.0,
        "prompt": [1, 2, 3],
        "max_tokens": 4,
        "answer": answer,
    }


def _result(version: int, t: float) -> dict[str, Any]:
    return {
        "kind": "result",
        "job_id": "j1",
        "worker_id": "as-v3-a",
        "version_start": version,
        "version_end": version,
        "spans": [[[version, 0, 4]]],
        "lengths": [4],
        "tokens": "d",
        "t": T0 + t,
    }


def test_a_waiting_request_answered_by_a_held_replica_in_time_passes() -> None:
    oracle = _judge(_facts(evals=[_eval(_result(3, 20.0))]))
    assert oracle.violations == [] and oracle.checks["held-wait"] == 1


def test_a_waiting_request_expired_while_a_controller_acted_is_flagged() -> None:
    expired = {"kind": "error", "cls": "Expired", "t": T0 + 35.2}
    [message] = _flagged(_judge(_facts(evals=[_eval(expired)])), "held-wait")
    assert "answered Expired" in message and "exact v3" in message


def test_a_waiting_request_for_a_version_never_committed_is_nobodys_to_serve() -> None:
    # Seed 12 (--autoscale 3:5): v35's publisher SIGKILLed at commit:before-cas; asked for with
    # wait_for_replica, the controller rightly held no replica there, and the requests expired.
    expired = {"kind": "error", "cls": "Expired", "t": T0 + 35.2}
    oracle = _judge(_facts(evals=[_eval(expired)]), commits=[(T0 - 9.0, 2), (T0 - 5.0, 4)])
    assert _flagged(oracle, "held-wait") == [] and any("never committed" in k for k in oracle.unverified)
    oracle = _judge(_facts(evals=[_eval(expired)]), commits=[(T0 - 9.0, 3), (T0 - 5.0, 4)])
    assert len(_flagged(oracle, "held-wait")) == 1


def test_a_waiting_request_no_controller_could_serve_is_unverified_but_a_wrong_version_never_is() -> None:
    dead = _controller("c1", 101, end=T0 + 4.0, how="killed")
    expired = {"kind": "error", "cls": "Expired", "t": T0 + 35.2}
    oracle = _judge(_facts(controllers=[dead], lease=_renewals(101, 0.5, 4.0), evals=[_eval(expired)]))
    assert _flagged(oracle, "held-wait") == [] and any(k.startswith("held-wait") for k in oracle.unverified)
    oracle = _judge(_facts(controllers=[dead], lease=_renewals(101, 0.5, 4.0), evals=[_eval(_result(4, 20.0))]))
    assert any("labelled [4], not v3" in m for m in _flagged(oracle, "held-wait"))


# -- scaled-job --------------------------------------------------------------------------------------


def _burst(answer: dict[str, Any], again: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "kind": "burst",
        "key": "burst-1",
        "version": 3,
        "t0": T0 + 10.0,
        "deadline": T0 + 50.0,
        "prompt": [5, 6],
        "max_tokens": 4,
        "retry": "resume",
        "answer": answer,
        "again": again,
    }


def test_a_resumable_job_continued_across_a_scale_in_passes_and_one_with_a_hole_is_flagged() -> None:
    whole = {**_result(3, 20.0), "spans": [[[3, 0, 2], [3, 2, 4]]]}
    oracle = _judge(_facts(bursts=[_burst(whole, again=whole)]))
    assert oracle.violations == [] and oracle.checks["scaled-job"] == 1
    hole = {**_result(3, 20.0), "spans": [[[3, 0, 1], [3, 2, 4]]]}
    [message] = _flagged(_judge(_facts(bursts=[_burst(hole)])), "scaled-job")
    assert "do not tile" in message
    other = {**whole, "job_id": "j2"}
    [message] = _flagged(_judge(_facts(bursts=[_burst(whole, again=other)])), "scaled-job")
    assert "another answer came back" in message


def test_an_answer_lost_with_the_brokers_store_may_come_back_another_when_asked_again() -> None:
    # Seed 10 (--autoscale 3:5): two resumable jobs answered 2.5 s into a rollback's lost window,
    # run again after the restart: asked again at the end, the second run's answer came back.
    whole = {**_result(3, 27.2), "spans": [[[3, 0, 2], [3, 2, 4]]]}
    other = {**whole, "job_id": "j2"}
    facts = _facts(bursts=[_burst(whole, again=other)])
    oracle = _judge(facts, lost=lambda t: T0 + 24.8 <= t <= T0 + 30.0)
    assert _flagged(oracle, "scaled-job") == []
    assert any("lost with the broker's store" in k for k in oracle.unverified)
    # The loss's window elsewhere (before the answer was stored): flagged.
    oracle = _judge(facts, lost=lambda t: T0 + 10.0 <= t <= T0 + 20.0)
    assert len(_flagged(oracle, "scaled-job")) == 1


def test_the_facts_know_who_acts_from_the_lease_as_the_broker_stored_it() -> None:
    f = AutoscaleFacts(_facts(lease=_renewals(101, 0.5, 10.0)))
    assert f.acting_at(T0 + 5.0)["name"] == "c1"
    assert f.acting_at(T0 + 12.5) is None  # (its last renewal 4 s before: it may not act)
    assert f.acting_at(T0 + 0.2) is None  # (no lease written yet)


def test_a_resumable_jobs_tokens_are_judged_by_the_seed_its_coordinate_records(tmp_path: Path) -> None:
    """A resumable job that gives no seed runs on its job's seed (``schemas.seeds.job_seed``);
    campaign 8's autoscaler run judged such answers as unseeded and flagged 4 of them."""
    from harness.weights import write_base_checkpoint
    from reliability.adversary.oracle_autoscale import _served_by
    from reliability.adversary.trainer_weights import TrainerWeights
    from reliability.adversary.truth import tensors_key
    from rollfleet.workers.engines.keyed import VOCAB, keyed_tokens

    weights = TrainerWeights(write_base_checkpoint(tmp_path / "base"), 5)
    seed = 1469226431842401052
    tokens = keyed_tokens(tensors_key(weights.at(3)), [5, 6], 4, seed=seed, sample=0, vocab=VOCAB)
    answer = {**_result(3, 20.0), "token_ids": [tokens], "spans": [[[3, 0, 4]]], "replicas": [["w1"]],
              "replay": {"sampling": {"seed": seed}}}  # fmt: skip
    served = _served_by(SimpleNamespace(weights=weights, commits=[(T0 - 9.0, 3)]))
    assert served is not None
    assert served(_burst(answer), answer) is None
    unseeded = {k: v for k, v in answer.items() if k != "replay"}
    assert "not what their labels' weights make" in (served(_burst(unseeded), unseeded) or "")
