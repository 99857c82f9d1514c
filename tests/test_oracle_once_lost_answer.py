"""The oracle's ``once`` rule for a key asked again after its first answer was lost with the broker's
store, on a recorded history (no processes). Campaign 9, seed 90912: an ``at_most_once`` job was
answered (w4 stored its result 3.4 s after it was stored); the broker was then SIGKILLed and came
back on a copy of its store 5.06 s old, without that answer and without w4's ack. The job was
delivered again; its claim's holder was gone and no answer was stored, so the replica answered
``Interrupted`` (it must never start twice). The trainer asked the key again and got that
``Interrupted``. The key's promise holds while the results stream keeps the answer; this one was
lost with the store, which the oracle already allowed for a second result, not for an error.
"""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import LOST_WITH_STORE, Oracle
from reliability.adversary.tap import Published
from tests.oracle_histories import echo_worker, history_oracle

KEY, JOB, TIMEOUT = "job-2-37", "job-a3c6", 17.1
UNVERIFIED = f"once: the first answer {LOST_WITH_STORE}"


def _oracle(*, lost: bool) -> Oracle:
    t = time.time()
    req = {
        "kind": "staleness",
        "value": 0,
        "retry": "at_most_once",
        "payload": {"prompt": [210, 398], "max_tokens": 8, "n": 1},
        "timeout": TIMEOUT,
    }
    stored = {
        "ev": "stored",
        "key": KEY,
        "job_id": JOB,
        "deadline": t + TIMEOUT,
        "constraint": ["min", 35],
        "fingerprint": "fp",
        "stream_seq": 208,
        "inc": 2,
    }
    journal: list[dict[str, Any]] = [
        {"ev": "submit", "rid": "2:1", "op": "new", "key": KEY, "req": req, "t": t, "inc": 2},
        {**stored, "rid": "2:1", "op": "new", "t0": t, "t": t + 0.002},
        {"ev": "answer", "rid": "2:1", "op": "new", "key": KEY, "t0": t, "kind": "result", "job_id": JOB,
         "worker_id": "w4", "version_start": 35, "version_end": 35, "spans": [[[35, 0, 8]]], "tokens": "aa",
         "t": t + 3.4, "inc": 2},
        {"ev": "submit", "rid": "2:2", "op": "resubmit", "key": KEY, "req": req, "t": t + 12.69, "inc": 2},
        {**stored, "rid": "2:2", "op": "resubmit", "t0": t + 12.69, "t": t + 12.695},
        {"ev": "answer", "rid": "2:2", "op": "resubmit", "key": KEY, "t0": t + 12.69, "kind": "error",
         "cls": "Interrupted", "code": "interrupted", "retryable": True,
         "message": "the worker that started this at_most_once job stopped; it was not run again",
         "t": t + 14.93, "inc": 2},
    ]  # fmt: skip
    subject = f"rf.adv.results.trainer.keyhash.{JOB}.w4"
    answer = Published(
        t=t + 3.39, subject=subject, kind="result", key=KEY, job_id=JOB, worker="w4", digest="d1",
        desc={"kind": "result", "job_id": JOB, "worker_id": "w4", "version_start": 35, "version_end": 35,
              "spans": [[[35, 0, 8]]], "ntokens": 8, "idem_key": KEY},
    )  # fmt: skip
    losses = [{"kind": "rollback", "lost_from": t + 0.34, "at": t + 5.4}] if lost else []
    timeline = {"workers": [echo_worker("w4", t - 60, stops=[])], "commits": [(35, t - 9, t - 9)],
                "trainers": [{"incarnation": 2, "start": t - 30}], "stores_lost": losses}  # fmt: skip
    tap = {"published": [answer], "stored_jobs": {JOB: 1}}
    oracle = history_oracle(journal, timeline=timeline, tap=tap, cfg={"duration": 90, "duplicate_window": 60.0})
    oracle._check_once()
    return oracle


def test_an_error_asked_again_after_the_first_answer_was_lost_with_the_store_is_unverified() -> None:
    oracle = _oracle(lost=True)
    assert [v.line() for v in oracle.violations if v.check == "once"] == []
    assert oracle.unverified[UNVERIFIED] == 1


def test_with_the_answer_kept_the_same_error_is_a_violation() -> None:
    oracle = _oracle(lost=False)
    assert [(v.check, v.key) for v in oracle.violations if v.check == "once"] == [("once", KEY)]
    assert oracle.unverified[UNVERIFIED] == 0
