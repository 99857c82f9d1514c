"""The autoscale benchmark's pure parts: the demand trace it replays, KEDA's JetStream rule
through the HPA (the baseline), and the figures it computes from what it recorded."""

from __future__ import annotations

from benchmarks.bench_autoscale import (
    FULL,
    QUICK,
    KedaRule,
    KedaState,
    answers_per_key,
    demand_trace,
    direction_changes,
    keda_desired,
    most_within,
    replica_seconds,
)
from rollfleet.schemas import Names
from rollfleet.schemas.names import key_token


def test_the_trace_is_a_ramp_a_burst_a_lull_and_a_pinned_evaluation_burst() -> None:
    for s in (FULL, QUICK):
        trace = demand_trace(s)
        (_, _, ramp_end), (_, _, steady_end), (_, lull_start, lull_end), (_, eval_at, end) = trace.phases
        assert ramp_end < steady_end == lull_start < lull_end == eval_at < end == trace.end_s
        times = [a.t for a in trace.arrivals]
        assert times == sorted(times) and 0 <= times[0] and times[-1] <= end
        ramp = [a.t for a in trace.arrivals if a.t < ramp_end]
        assert len([t for t in ramp if t >= ramp_end / 2]) > len([t for t in ramp if t < ramp_end / 2])  # rising
        assert sum(1 for a in trace.arrivals if a.t == ramp_end) >= s.burst
        assert not [a for a in trace.arrivals if steady_end < a.t < lull_end]  # the lull
        at_eval = [a.kind for a in trace.arrivals if a.t == eval_at]
        assert at_eval.count("eval") == s.eval_waiting and at_eval.count("eval-now") == s.eval_now
        assert {a.kind for a in trace.arrivals if a.t != eval_at} == {"train"}
        gaps = {round(b - a, 9) for a, b in zip(trace.publishes, trace.publishes[1:], strict=False)}
        assert gaps == {round(s.publish_every_s, 9)} and trace.publishes[-1] <= end


def test_kedas_rule_is_the_lag_over_the_threshold_within_bounds_and_the_hpas_tolerance() -> None:
    rule = KedaRule(min_replicas=1, max_replicas=8, lag_threshold=3.0, stabilization_s=20.0)
    assert keda_desired(rule, 0, 1, KedaState(), 0.0)[0] == 1  # (never under the minimum)
    assert keda_desired(rule, 7, 1, KedaState(), 0.0)[0] == 3  # ceil(7 / 3)
    assert keda_desired(rule, 100, 2, KedaState(), 0.0)[0] == 8  # (never over the maximum)
    assert keda_desired(rule, 12, 4, KedaState(), 0.0)[0] == 4
    assert keda_desired(rule, 13, 4, KedaState(), 0.0)[0] == 4  # 13 / 12 is within 10 % of 1: no change
    assert keda_desired(rule, 14, 4, KedaState(), 0.0)[0] == 5
    # Version-blind: jobs of any version count, whether or not a replica it starts could take them.


def test_kedas_scale_down_waits_out_the_stabilization_window_and_a_scale_up_does_not() -> None:
    rule = KedaRule(min_replicas=1, max_replicas=8, lag_threshold=3.0, stabilization_s=20.0)
    n, state = keda_desired(rule, 24, 1, KedaState(), 0.0)
    assert n == 8
    n, state = keda_desired(rule, 0, 8, state, 10.0)
    assert n == 8  # the window still holds 8
    n, state = keda_desired(rule, 6, 8, state, 20.0)
    assert n == 2  # 8 left the window: the largest since (1 at 10, 2 now)
    n, state = keda_desired(rule, 30, 2, state, 21.0)
    assert n == 8  # up at once


def test_replica_seconds_integrate_each_sample_until_the_next_within_the_window() -> None:
    samples = [(0.0, 1), (10.0, 3), (20.0, 1)]
    assert replica_seconds(samples, 0.0, 30.0) == 10 + 30 + 10
    assert replica_seconds(samples, 5.0, 15.0) == 5 * 1 + 5 * 3
    assert replica_seconds([], 0.0, 10.0) == 0


def test_changes_of_direction_per_class_and_the_most_within_a_cooldown() -> None:
    actions = [(0.0, "latest", +1), (5.0, "latest", +1), (10.0, "latest", -1), (12.0, "3", +1),
               (50.0, "latest", +1), (55.0, "latest", -1), (60.0, "3", -1)]  # fmt: skip
    turns = direction_changes(actions)
    assert turns == {"latest": [10.0, 50.0, 55.0], "3": [60.0]}
    assert most_within(turns["latest"], 30.0) == 2  # 50 and 55
    assert most_within([10.0, 50.0], 30.0) == 1
    assert most_within([10.0, 40.0], 30.0) == 1  # (exactly a cooldown apart)
    assert most_within([], 30.0) == 0


def test_answers_are_counted_per_key_from_the_results_streams_subjects() -> None:
    names = Names("ns")
    a1 = names.result_subject("bench", "train-1", "j1", "w1")
    a2 = names.result_subject("bench", "train-1", "j1", "w2")  # answered twice, by two workers
    b = names.result_subject("bench", "train-2", "j2", "w1")
    counts = answers_per_key({a1: 1, a2: 1, b: 1, "rf.ns.jobs.min.0": 4}, names)
    assert counts == {key_token("train-1"): 2, key_token("train-2"): 1}
    assert answers_per_key({b: 2}, names) == {key_token("train-2"): 2}  # (stored twice on one subject)
