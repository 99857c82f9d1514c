"""The oracle's ``reask-turn`` rule on a recorded history (no processes): a session turn asked
again must return the turn's stored answer, unless that answer was stored after the copy of the
broker's store a rollback went back to (campaign 14, seed 167: the at_most_once turn's job, back
in the stream, was answered ``Interrupted``; its answer was not there to return)."""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import LOST_WITH_STORE, Oracle
from tests.oracle_histories import echo_worker, history_oracle


def _oracle(stores_lost: list[dict[str, Any]]) -> Oracle:
    now = time.time()
    payload = {"prompt": [1, 2], "max_tokens": 4, "n": 1}
    turn = {"sid": "s", "turn": 0, "key": "s/0", "payload": payload, "timeout": 10.0}
    journal: list[dict[str, Any]] = [
        {"ev": "session_open", "sid": "s", "policy": "monotonic", "retry": "at_most_once", "t": now, "inc": 0},
        {"ev": "turn", "rid": "0:1", "op": "turn", "t": now, "inc": 0, **turn},
        {"ev": "answer", "rid": "0:1", "op": "turn", "sid": "s", "turn": 0, "key": "s/0", "t0": now, "inc": 0,
         "session": {"last_version": 0, "replica": "w1", "next_turn": 1}, "kind": "result", "job_id": "job-1",
         "worker_id": "w1", "version_start": 0, "version_end": 0, "spent": True, "t": now + 2.0},
        {"ev": "turn", "rid": "1:1", "op": "reask-turn", "t": now + 10.0, "inc": 1, **turn},
        {"ev": "answer", "rid": "1:1", "op": "reask-turn", "sid": "s", "turn": 0, "key": "s/0", "t0": now + 10.0,
         "inc": 1, "kind": "error", "cls": "Interrupted", "code": "interrupted", "retryable": True, "spent": True,
         "t": now + 11.0},
    ]  # fmt: skip
    timeline = {"workers": [echo_worker("w1", now - 5)], "commits": [(0, now - 9, now - 9)],
                "trainers": [{"incarnation": 0, "how": "killed"}], "stores_lost": stores_lost}  # fmt: skip
    oracle = history_oracle(journal, timeline=timeline, namespace="t")
    oracle._check_reask_turns()
    return oracle


def test_a_turn_asked_again_must_return_its_stored_answer() -> None:
    oracle = _oracle([])
    assert [v.check for v in oracle.violations] == ["reask-turn"], [v.line() for v in oracle.violations]


def test_a_turn_whose_answer_a_rollback_took_is_not_verifiable() -> None:
    now = time.time()
    # The copy was taken before the answer was stored (t + 2), the broker restarted on it after.
    oracle = _oracle([{"kind": "rollback", "lost_from": now + 1.0, "at": now + 5.0, "back": now + 6.0}])
    assert oracle.violations == [], [v.line() for v in oracle.violations]
    assert oracle.unverified[f"reask-turn: the answer {LOST_WITH_STORE}"] == 1
