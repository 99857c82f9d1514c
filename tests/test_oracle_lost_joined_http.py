"""The oracle's ``lost`` rule for a call over HTTP that asked a key again and joined its job stored
earlier, on a recorded history (no processes). Campaign 9, seed 19: a request (timeout 20 s) was
stored at T through gateway g1, which was killed; the trainer, SIGKILLed too, restarted and asked
the key again through g2 at T + 17.6 s with a timeout of its own. The gateway's client stores
nothing new within the duplicate window: it follows the job stored first, deadline included, and
answered ``Expired`` at T + 22.18 s (the deadline and the client's grace). The replica that ran the
job (delivered 4.8 s before its deadline, 7 s of generation) published its answer 20 ms later. The
oracle dated the re-ask by its own timeout (T + 37.6 s) and flagged the answer as published "15.4 s
before the deadline".
"""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import Oracle
from reliability.adversary.tap import Delivery, Published
from tests.oracle_histories import echo_worker, history_oracle

KEY, JOB, TIMEOUT = "http-0-2", "job-http-0-2", 20.0


def _oracle(published_after: float) -> Oracle:
    t = time.time()
    req = {
        "kind": "min",
        "value": 0,
        "retry": "replayable",
        "payload": {"prompt": [3, 6], "max_tokens": 8, "n": 1},
        "timeout": TIMEOUT,
    }
    journal: list[dict[str, Any]] = [
        {"ev": "submit", "rid": "0:1", "op": "new", "key": KEY, "req": req, "client": "gateway", "t": t, "inc": 0},
        {"ev": "http_attempt", "rid": "0:1", "key": KEY, "gateway": "g1", "address": "http://127.0.0.1:1",
         "t_sent": t, "outcome": "ServerDisconnectedError: Server disconnected", "t": t + 5.9, "inc": 0},
        {"ev": "submit", "rid": "1:1", "op": "resume", "key": KEY, "req": req, "client": "gateway",
         "t": t + 17.6, "inc": 1},
        {"ev": "http_attempt", "rid": "1:1", "key": KEY, "gateway": "g2", "address": "http://127.0.0.1:2",
         "t_sent": t + 17.6, "outcome": 504, "t": t + 22.18, "inc": 1},
        {"ev": "answer", "rid": "1:1", "op": "resume", "key": KEY, "t0": t + 17.6, "client": "gateway",
         "kind": "error", "cls": "Expired", "code": "expired", "retryable": True,
         "message": f"no result for {KEY!r} by its deadline", "status": 504, "tries": 1, "t": t + 22.18, "inc": 1},
    ]  # fmt: skip
    delivered = Delivery(
        t=t + 15.2, inbox="rf.adv.jobs.min.0", ack="$JS.ACK.RF_ADV_JOBS.min-0.1.37.1.1.0", job_id=JOB,
        key=KEY, client_id="gateway", constraint=("min", 0), retry="replayable", session_id=None,
        fingerprint="fp", stream_seq=37, attempt=1, consumer="min-0", max_tokens=8, submitted_at=t + 0.002,
        deadline=t + 0.002 + TIMEOUT, worker="w1", prompt=None,
    )  # fmt: skip
    subject = f"rf.adv.results.gateway.keyhash.{JOB}.w1"
    answer = Published(
        t=t + published_after, subject=subject, kind="result", key=KEY, job_id=JOB, worker="w1", digest="d1",
        desc={"kind": "result", "job_id": JOB, "worker_id": "w1", "version_start": 0, "version_end": 0,
              "spans": [[[0, 0, 8]]], "ntokens": 8, "session_id": None, "idem_key": KEY},
    )  # fmt: skip
    timeline = {"workers": [echo_worker("w1", t - 60, stops=[])], "commits": [(0, t - 60, t - 60)],
                "trainers": [{"incarnation": 0, "start": t - 30, "end": t + 12.0, "how": "killed"},
                             {"incarnation": 1, "start": t + 15.0}]}  # fmt: skip
    tap = {"deliveries": [delivered], "published": [answer], "stored_jobs": {JOB: 1}}
    stored = {KEY: [{"subject": subject, "seq": 40, "digest": "d1", "kind": "result", "job_id": JOB}]}
    oracle = history_oracle(journal, timeline=timeline, tap=tap, stored=stored, cfg={"duration": 90})
    oracle._gateway_facts()
    oracle._check_lost_and_stranded()
    return oracle


def test_an_http_reask_that_joined_an_earlier_job_is_due_by_that_jobs_deadline() -> None:
    """Published after the joined job's deadline (and after the Expired): no answer was lost."""
    oracle = _oracle(published_after=22.2)
    resumed = next(c for c in oracle.calls if c.rid == "1:1")
    assert resumed.stored is not None and abs(float(resumed.stored["deadline"]) - (resumed.t0 - 17.6 + 20.002)) < 1e-6
    assert [v.line() for v in oracle.violations if v.check == "lost"] == []
    assert oracle.checks["lost"] == 1


def test_an_answer_published_before_the_joined_jobs_deadline_is_still_lost() -> None:
    oracle = _oracle(published_after=18.5)
    assert [(v.check, v.key) for v in oracle.violations if v.check == "lost"] == [("lost", KEY)]


def test_a_call_that_stored_its_own_job_is_due_by_its_own_timeout() -> None:
    """The first call's copy was stored during its own try: due by the later of the copy's deadline
    and its own (the two agree here, up to the 2 ms the gateway took to store it)."""
    oracle = _oracle(published_after=22.2)
    first = next(c for c in oracle.calls if c.rid == "0:1")
    assert first.stored is not None and abs(float(first.stored["deadline"]) - (first.t0 + 20.002)) < 1e-6
