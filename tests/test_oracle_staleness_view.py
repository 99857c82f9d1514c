"""The oracle's ``version`` rule for a ``max_staleness`` request resubmitted after a broker wipe,
on a recorded history (no processes). Seed 415513: the trainer was SIGKILLed, the broker
restarted on an empty store (its policy KV, ``latest`` with it, gone), and the next trainer,
started 0.8 s after the broker came back, resubmitted ``max_staleness=0`` before the next commit:
it resolved to ``min 0`` (there was no ``latest`` to read). The oracle applied its "the view may
lag" exemption to the first submit's moment, not to this one's, and flagged the resolution.
"""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import LOST_WITH_STORE, Oracle
from tests.oracle_histories import echo_worker, history_oracle


def _oracle(t_resubmit: float, stores_lost: list[dict[str, Any]], trainers: list[dict[str, Any]]) -> Oracle:
    t = time.time()
    req = {"kind": "staleness", "value": 0, "retry": "replayable", "payload": {"prompt": [1, 2], "max_tokens": 4},
           "timeout": 15.0}  # fmt: skip
    answer = {"kind": "result", "job_id": "job-b", "worker_id": "w1", "version_start": 30, "version_end": 30,
              "spans": [[[30, 0, 4]]]}  # fmt: skip
    journal: list[dict[str, Any]] = [
        {"ev": "submit", "rid": "0:1", "inc": 0, "op": "new", "key": "k", "t": t, "req": req},
        {"ev": "stored", "rid": "0:1", "key": "k", "t": t, "job_id": "job-a", "deadline": t + 15,
         "constraint": ["min", 29]},
        {"ev": "submit", "rid": "1:1", "inc": 1, "op": "resume", "key": "k", "t": t_resubmit, "req": req},
        {"ev": "stored", "rid": "1:1", "key": "k", "t": t_resubmit, "job_id": "job-b", "deadline": t_resubmit + 15,
         "constraint": ["min", 0]},
        {"ev": "answer", "rid": "1:1", "inc": 1, "op": "resume", "key": "k", "t": t_resubmit + 1, **answer},
    ]  # fmt: skip
    timeline = {"workers": [echo_worker("w1", t - 60)], "broker_down": [[x["at"], x["back"]] for x in stores_lost],
                "commits": [(29, t - 5, t - 5), (30, t + 20, t + 20)], "trainers": trainers,
                "stores_lost": stores_lost}  # fmt: skip
    oracle = history_oracle(journal, timeline=timeline)
    oracle._check_versions_and_sessions()
    return oracle


def test_a_resubmit_after_a_wipe_resolves_against_no_latest_unverified() -> None:
    t = time.time()
    wipe = {"kind": "wipe", "lost_from": 0.0, "at": t + 8.0, "back": t + 9.0}
    trainers = [{"incarnation": 0, "start": t - 60, "how": "killed"}, {"incarnation": 1, "start": t + 8.5}]
    oracle = _oracle(t + 9.3, [wipe], trainers)
    assert [v.line() for v in oracle.violations] == []
    assert oracle.unverified[f"max_staleness: `latest` {LOST_WITH_STORE}, nothing committed since"] == 1


def test_a_resubmit_resolved_below_a_latest_it_could_read_is_flagged() -> None:
    """No store loss, no restart or outage near the resubmit: min 0 for max_staleness=0 at v29."""
    t = time.time()
    trainers = [{"incarnation": 0, "start": t - 60, "how": "killed"}, {"incarnation": 1, "start": t + 1.0}]
    oracle = _oracle(t + 9.3, [], trainers)
    assert [v.check for v in oracle.violations] == ["version"], oracle.unverified
