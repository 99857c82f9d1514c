"""The oracle's ``lost`` rule for a session turn asked again that joined its job stored earlier, on a
recorded history (no processes). Seed 989501: turn 2 of a session was stored at T with its job's
deadline T + 13.72 s; the trainer was SIGKILLed; the next trainer resumed the session and asked
turn 2 again at T + 12.2 s with a timeout of its own. Within the duplicate window the client stores
nothing new: it follows the job stored first, deadline included, and answered ``Expired`` once that
deadline (and the client's grace) had passed. A broker pause held the worker's answer until
T + 18.6 s, after the job's deadline. The oracle dated the turn from the re-ask's own timeout
(T + 25.9 s) and flagged the answer as published "7.3 s before the deadline".
"""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import LOST_JOINED_LATE, Oracle
from reliability.adversary.tap import Delivery, Published
from tests.oracle_histories import echo_worker, history_oracle

KEY, FULL, JOB = "s/2", "s/inc/2", "job-turn-2"
TIMEOUT = 13.72


def _oracle(published_after: float) -> Oracle:
    t = time.time()
    journal: list[dict[str, Any]] = [
        {"ev": "session_open", "sid": "s", "policy": "free", "constraint": {"max_staleness": 1},
         "retry": "replayable", "t": t - 1, "inc": 0},
        {"ev": "turn", "rid": "0:1", "op": "turn", "sid": "s", "turn": 2, "key": KEY, "inc": 0, "t": t,
         "payload": {"prompt": [3, 6], "max_tokens": 8, "n": 1}, "timeout": TIMEOUT},
        {"ev": "session_resume", "sid": "s", "next_turn": 2, "kind": "ok", "t": t + 12.2, "inc": 1},
        {"ev": "turn", "rid": "1:1", "op": "turn", "sid": "s", "turn": 2, "key": KEY, "inc": 1, "t": t + 12.2,
         "payload": {"prompt": [3, 6], "max_tokens": 8, "n": 1}, "timeout": TIMEOUT},
        {"ev": "answer", "rid": "1:1", "op": "turn", "sid": "s", "turn": 2, "key": KEY, "inc": 1, "t0": t + 12.2,
         "t": t + 18.62, "kind": "error", "cls": "Expired", "code": "expired", "retryable": True,
         "message": f"no result for {FULL!r} by its deadline", "spent": True,
         "session": {"last_version": 1, "replica": "w1", "next_turn": 3}},
    ]  # fmt: skip
    delivered = Delivery(
        t=t + 0.2, inbox="rf.adv.jobs.replica.w1", ack="$JS.ACK.RF_ADV_JOBS.replica-w1.1.7.1.1.0", job_id=JOB,
        key=FULL, client_id="trainer", constraint=("min", 1), retry="replayable", session_id="s",
        fingerprint="fp", stream_seq=7, attempt=1, consumer="replica-w1", max_tokens=8, submitted_at=t,
        deadline=t + TIMEOUT, worker="w1", prompt=None,
    )  # fmt: skip
    subject = f"rf.adv.results.trainer.keyhash.{JOB}.w1"
    answer = Published(
        t=t + published_after, subject=subject, kind="result", key=FULL, job_id=JOB, worker="w1", digest="d1",
        desc={"kind": "result", "job_id": JOB, "worker_id": "w1", "version_start": 2, "version_end": 2,
              "spans": [[[2, 0, 8]]], "ntokens": 8, "session_id": "s", "idem_key": FULL},
    )  # fmt: skip
    timeline = {"workers": [echo_worker("w1", t - 60, stops=[])], "broker_paused": [[t + 15.3, t + 18.6]],
                "commits": [(1, t - 9, t - 9), (2, t + 14, t + 14)],
                "trainers": [{"incarnation": 0, "start": t - 30, "end": t + 7.1, "how": "killed"},
                             {"incarnation": 1, "start": t + 9.3}]}  # fmt: skip
    tap = {"deliveries": [delivered], "published": [answer], "stored_jobs": {JOB: 1}}
    stored = {FULL: [{"subject": subject, "seq": 40, "digest": "d1", "kind": "result", "job_id": JOB}]}
    oracle = history_oracle(journal, timeline=timeline, tap=tap, stored=stored,
                            cfg={"ack_wait": 2.0, "duplicate_window": 15.0, "duration": 90})  # fmt: skip
    oracle._check_lost_and_stranded()
    return oracle


def test_a_turn_that_joined_an_earlier_job_is_due_by_that_jobs_deadline() -> None:
    """The answer came after the job's own deadline: the Expired the re-ask got is the promised one;
    that the re-ask's own timeout was longer is not a promise the contract makes (unverified)."""
    oracle = _oracle(published_after=18.64)
    assert [v.line() for v in oracle.violations if v.check == "lost"] == []
    assert oracle.unverified[LOST_JOINED_LATE] == 1


def test_an_answer_published_before_the_joined_jobs_deadline_is_still_lost() -> None:
    oracle = _oracle(published_after=10.0)
    assert [(v.check, v.key) for v in oracle.violations if v.check == "lost"] == [("lost", KEY)]
    assert oracle.unverified[LOST_JOINED_LATE] == 0
