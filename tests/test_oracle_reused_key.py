"""The oracle's ``once`` rule for a key asked with another request (campaign seed 2,
broker-stores): a rollback took the first request's job, so the key was free and the other
request ran under it (a job id is the key's, so with the same job id and tokens of its own); a
wipe then took that answer, and the first request asked again ran once more. Never a violation
where the store loss freed the key; always one where the first job stood, or where the other
request is handed the first request's result."""

from __future__ import annotations

import time
from typing import Any

from reliability.adversary.oracle import LOST_WITH_STORE, Oracle
from tests.oracle_histories import echo_worker, history_oracle

JOB = "39ee8a5eddb75ad4d4c89475b6fefe12"
FIRST = {"kind": "staleness", "value": 1, "retry": "at_most_once", "timeout": 9.34,
         "payload": {"prompt": [445, 264, 158, 392], "max_tokens": 179, "n": 1}}  # fmt: skip
OTHER = {"kind": "staleness", "value": 0, "retry": "at_most_once", "timeout": 17.59,
         "payload": {"prompt": [420, 185, 492], "max_tokens": 50, "n": 2}}  # fmt: skip


def _call(rid: str, op: str, req: dict[str, Any], t: float, answer: dict[str, Any]) -> list[dict[str, Any]]:
    base = {"rid": rid, "op": op, "key": "g0x0:0", "inc": 0}
    return [
        {"ev": "submit", **base, "req": req, "latest": 4, "t": t},
        {"ev": "stored", **base, "job_id": JOB, "deadline": t + 9.0, "constraint": ["min", 3], "stream_seq": 87,
         "fingerprint": op, "t0": t, "t": t + 0.01},
        {"ev": "answer", **base, "t0": t, "t": t + 3.0, **answer},
    ]  # fmt: skip


def _result(tokens: str, worker: str) -> dict[str, Any]:
    return {"kind": "result", "job_id": JOB, "worker_id": worker, "version_start": 6, "version_end": 6,
            "tokens": tokens, "token_ids": [[1, 2]], "ntokens": 2, "finish": ["length"], "lengths": [2]}  # fmt: skip


def _oracle(tokens_of_other: str, losses: list[dict[str, Any]]) -> Oracle:
    t = time.time()
    expired = {"kind": "error", "cls": "Expired", "code": "expired", "retryable": True}
    journal = [
        *_call("0:53", "new", FIRST, t, expired),
        *_call("0:103", "conflict", OTHER, t + 13.0, _result(tokens_of_other, "w3")),
        *_call("0:208", "resubmit", FIRST, t + 36.0, _result("e51a1349ce2dfaea", "w2")),
    ]
    timeline = {"workers": [echo_worker("w2", t - 5), echo_worker("w3", t - 5)], "commits": [(0, t - 9, t - 9)],
                "stores_lost": [{**loss, "lost_from": t + loss["lost_from"], "at": t + loss["at"],
                                 "back": t + loss["at"] + 1.0} for loss in losses]}  # fmt: skip
    oracle = history_oracle(journal, timeline=timeline)
    oracle._check_once()
    return oracle


ROLLBACK = {"kind": "rollback", "lost_from": -0.3, "at": 2.7}  # took the first request's job
WIPE = {"kind": "wipe", "lost_from": -100.0, "at": 23.0}  # took the other request's answer


def test_a_key_freed_by_a_store_loss_runs_another_request_under_its_job_id() -> None:
    oracle = _oracle("17ca3daca8466e86", [ROLLBACK, WIPE])
    assert [v.line() for v in oracle.violations if v.check == "once"] == []
    assert oracle.unverified[f"once: a key reused after its first request's job was {LOST_WITH_STORE}"] == 1


def test_another_request_run_while_the_first_job_stood_or_handed_its_result_is_a_violation() -> None:
    stood = _oracle("17ca3daca8466e86", [WIPE])  # (no rollback: the first job stood)
    assert [v.message for v in stood.violations if v.check == "once"] == [
        "a key reused for another request ran under the first request's job while it stood"
    ]
    handed = _oracle("e51a1349ce2dfaea", [ROLLBACK, WIPE])  # the first request's own tokens
    assert [v.message for v in handed.violations if v.check == "once"] == [
        "a key reused for another request was answered with the first request's result"
    ]
