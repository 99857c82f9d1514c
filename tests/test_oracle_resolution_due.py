"""The oracle's ``resolution`` rule: a call is resolved by its deadline (with slack), or, where
it was asked after its deadline, at once. Campaign seed 7: a restarted trainer resumed a job
whose deadline passed while no trainer ran, 5.7 s after it, and was answered Expired 0.24 s
later; judged from the deadline, that was a violation."""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import RESOLVE_SLACK_S, Oracle
from tests.oracle_histories import echo_worker, history_oracle

REQ = {"kind": "staleness", "value": 2, "retry": "replayable", "timeout": 8.94,
       "payload": {"prompt": [9, 18, 72], "max_tokens": 135, "n": 1}}  # fmt: skip


def _oracle(asked_after_deadline_s: float, answered_after_asked_s: float) -> Oracle:
    t = time.time()
    deadline = t + 9.0
    asked = deadline + asked_after_deadline_s
    base = {"rid": "1:3", "op": "resume", "key": "job-0-19", "inc": 1}
    journal: list[dict[str, Any]] = [
        {"ev": "submit", **base, "req": REQ, "latest": 21, "t": asked},
        {"ev": "stored", **base, "job_id": "j", "deadline": deadline, "constraint": ["min", 9], "stream_seq": 120,
         "fingerprint": "f", "t0": asked, "t": asked + 0.004},
        {"ev": "answer", **base, "t0": asked, "kind": "error", "cls": "Expired", "code": "expired", "retryable": True,
         "t": asked + answered_after_asked_s},
    ]  # fmt: skip
    oracle = history_oracle(journal, timeline={"workers": [echo_worker("w1", t - 5)], "commits": [(0, t - 9, t - 9)]})
    oracle._check_resolution()
    return oracle


def test_a_call_asked_after_its_deadline_is_due_at_once() -> None:
    assert [v.line() for v in _oracle(5.7, 0.24).violations] == []
    assert _oracle(-3.0, 0.24).violations == []  # (asked before it: due at its deadline)


def test_one_answered_long_after_it_was_asked_is_late() -> None:
    late = _oracle(5.7, RESOLVE_SLACK_S + 1.0).violations
    assert [v.check for v in late] == ["resolution"], [v.line() for v in late]
