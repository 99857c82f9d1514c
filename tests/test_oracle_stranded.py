"""The oracle's ``stranded`` rule on recorded histories (no processes): a job that waited
unpulled while a live replica able to serve it sat idle is flagged; the time in which the only
able replicas were frozen by the adversary (SIGSTOP: their registry entries stay, they pull
nothing) does not count against the fleet. Seed 747108: job-1-64 waited 10.6 s, 2 s of them
while its only able replica was frozen."""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import Oracle
from rollfleet.schemas import ReplicaStatus
from tests.oracle_histories import echo_worker, history_oracle


def _oracle(stops: list[list[float]], t: float) -> Oracle:
    req = {"kind": "min", "value": 0, "retry": "replayable", "payload": {"prompt": [1, 2], "max_tokens": 4},
           "timeout": 12.0}  # fmt: skip
    journal: list[dict[str, Any]] = [
        {"ev": "submit", "rid": "0:1", "inc": 0, "op": "new", "key": "k", "t": t, "req": req},
        {"ev": "stored", "rid": "0:1", "key": "k", "t": t, "job_id": "job-k", "deadline": t + 12.0,
         "constraint": ["min", 0], "stream_seq": 5},
        {"ev": "answer", "rid": "0:1", "inc": 0, "op": "new", "key": "k", "t": t + 12.1, "kind": "error",
         "cls": "Expired", "code": "expired", "retryable": True, "message": "no result by its deadline"},
    ]  # fmt: skip
    # An idle replica at v3, its registry entry refreshed every half second (frozen or not: the
    # entry stays what it last wrote).
    entries = [
        (t - 5.0 + 0.5 * i, "w1", ReplicaStatus(worker_id="w1", state="ready", active_version=3, engine="echo",
                                                capacity=3, in_flight=0, heartbeat_at=t - 5.0 + 0.5 * i,
                                                heartbeat_interval_s=0.5, started_at=t - 5.0))
        for i in range(40)
    ]  # fmt: skip
    timeline = {"workers": [echo_worker("w1", t - 5.0, stops=stops)], "commits": [(3, t - 9, t - 9)],
                "trainers": [{"incarnation": 0, "start": t - 6.0}]}  # fmt: skip
    oracle = history_oracle(journal, timeline=timeline, tap={"fleet": entries})
    oracle._check_lost_and_stranded()
    return oracle


def test_a_job_an_idle_replica_never_pulled_is_stranded() -> None:
    oracle = _oracle([], time.time())
    assert [(v.check, v.key) for v in oracle.violations] == [("stranded", "k")]


def test_the_time_its_only_replica_was_frozen_does_not_count() -> None:
    t = time.time()
    oracle = _oracle([[t + 4.0, t + 7.0]], t)  # 12 s in all, 3 of them frozen: 9 s against the fleet
    assert [v.line() for v in oracle.violations] == []
    assert oracle.checks["stranded"] == 1
