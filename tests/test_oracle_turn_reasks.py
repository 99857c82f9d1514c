"""The oracle's judgement of a session turn asked again, on recorded histories (no processes).

A turn is asked again by its index (``generate(turn=k)``): the payload passed with it is not
read, the turn's stored answer is returned. After a trainer restart the adversary's load can
ask a turn's index again with another prompt (its journal lacked the answer that had moved the
conversation on): the client refuses that request with ``SessionConflict``, and the re-ask by
index returns the answer of the job stored first under the turn's key. The oracle took the
re-ask's payload for the answer's prompt (``served``: 13 of 13 tokens "not what v11's weights
make", seed 747109) and the ``SessionConflict`` refusal for the turn's answer (``reask-turn``:
"failed SessionConflict, asked again: Expired", the same run); both answers were right.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from harness.weights import write_base_checkpoint
from reliability.adversary.journal import prompt_digest
from reliability.adversary.oracle import Oracle
from reliability.adversary.tap import Delivery
from reliability.adversary.trainer_weights import TrainerWeights
from reliability.adversary.truth import tensors_key
from rollfleet.workers.engines.keyed import keyed_tokens
from tests.oracle_histories import echo_worker, history_oracle

SEED = 5
FIRST = [2, 5, 7, 9]  # the prompt the turn's job was stored with
OTHER = [2, 5, 7, 9, 11, 13]  # the prompt a restarted trainer asked the same index with


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> TrainerWeights:
    return TrainerWeights(write_base_checkpoint(tmp_path_factory.mktemp("base")), SEED)


def _answer(weights: TrainerWeights, worker: str, prompt: list[int], version: int = 1) -> dict[str, Any]:
    tokens = keyed_tokens(tensors_key(weights.at(version)), prompt, 12, seed=None, sample=0, vocab=32_000)
    return {"kind": "result", "job_id": "job-t1", "worker_id": worker, "version_start": version,
            "version_end": version, "spans": [[[version, 0, len(tokens)]]], "token_ids": [tokens],
            "fingerprint": "fp-first", "session_id": "s", "idem_key": "s/inc/1", "replicas": [[None]]}  # fmt: skip


def _oracle(
    weights: TrainerWeights,
    journal: list[dict[str, Any]],
    published: list[Any] | None = None,
    deliveries: list[Any] | None = None,
) -> Oracle:
    now = journal[0]["t"]
    timeline = {"workers": [echo_worker(w, now - 5) for w in ("w1", "w2")],
                "commits": [(0, now - 9, now - 9), (1, now - 8, now - 8)],
                "trainers": [{"incarnation": 0, "how": "killed"}]}  # fmt: skip
    tap = {"deliveries": deliveries or [], "published": published or []}
    oracle = history_oracle(journal, timeline=timeline, tap=tap, weights=weights, cfg={"seed": SEED})
    return oracle


def _turn(rid: str, inc: int, op: str, prompt: list[int], t: float) -> dict[str, Any]:
    return {"ev": "turn", "rid": rid, "op": op, "sid": "s", "turn": 1, "key": "s/1", "inc": inc, "t": t,
            "payload": {"prompt": prompt, "max_tokens": 12, "n": 1}, "timeout": 12.0}  # fmt: skip


def _reply(rid: str, inc: int, op: str, t: float, **answer: Any) -> dict[str, Any]:
    return {"ev": "answer", "rid": rid, "op": op, "sid": "s", "turn": 1, "key": "s/1", "inc": inc, "t0": t - 1,
            "t": t, "spent": True, "session": {"last_version": None, "replica": "w1", "next_turn": 2},
            **answer}  # fmt: skip


def _conflict(rid: str, t: float) -> dict[str, Any]:
    return _reply(rid, 1, "turn", t, kind="error", cls="SessionConflict", code="session_conflict", retryable=False,
                  message="turn 1 of session 's' was already asked with another prompt")  # fmt: skip


def _history(weights: TrainerWeights, re_answer: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn 1 answered (inc 0), the trainer killed; inc 1 asks index 1 with another prompt
    (SessionConflict), then asks turn 1 again by index, with that other prompt."""
    now = time.time()
    return [
        {"ev": "session_open", "sid": "s", "policy": "free", "retry": "replayable", "t": now, "inc": 0},
        _turn("0:1", 0, "turn", FIRST, now),
        _reply("0:1", 0, "turn", now + 1, **_answer(weights, "w1", FIRST)),
        {"ev": "session_resume", "sid": "s", "next_turn": 1, "kind": "ok", "t": now + 5, "inc": 1},
        _turn("1:1", 1, "turn", OTHER, now + 5),
        _conflict("1:1", now + 5.1),
        _turn("1:2", 1, "reask-turn", OTHER, now + 5.2),
        _reply("1:2", 1, "reask-turn", now + 6, **re_answer),
    ]


def test_a_turn_asked_again_by_index_is_judged_by_the_prompt_its_job_was_stored_with(weights: TrainerWeights) -> None:
    # The same job's answer, stored again by another replica (a redelivery), handed over by the re-ask.
    oracle = _oracle(weights, _history(weights, _answer(weights, "w2", FIRST)))
    oracle._check_served()
    assert [v.line() for v in oracle.violations] == []
    assert oracle.checks["served"] == 2  # both answers recomputed, neither skipped


def test_a_wrong_answer_to_a_turn_asked_again_is_still_flagged(weights: TrainerWeights) -> None:
    wrong = _answer(weights, "w2", FIRST)
    wrong["spans"] = [[[0, 0, 12]]]  # v1's tokens labelled v0
    wrong["version_start"] = wrong["version_end"] = 0
    oracle = _oracle(weights, _history(weights, wrong))
    oracle._check_served()
    assert [(v.check, v.key) for v in oracle.violations] == [("served", "s/1")], [v.line() for v in oracle.violations]


def test_an_answer_whose_prompt_no_call_names_is_unverified(weights: TrainerWeights) -> None:
    """The turn's first asking was cut short by the trainer's SIGKILL (no answer journaled), and
    the key was asked with two prompts since: which one the stored job holds, the journal cannot
    say (the client refused the other). Unverified, with its reason, never judged by either."""
    journal = _history(weights, _answer(weights, "w2", FIRST))
    del journal[2]  # the first asking's answer
    oracle = _oracle(weights, journal)
    oracle._check_served()
    assert oracle.violations == [] and oracle.checks["served"] == 0
    assert oracle.unverified["served: the turn's key was asked with several prompts, none known to be its job's"] == 1


def test_an_answer_is_judged_by_the_prompt_its_job_was_delivered_with(weights: TrainerWeights) -> None:
    """As above, but the wiretap saw the job delivered: its prompt is the first asking's."""
    journal = _history(weights, _answer(weights, "w2", FIRST))
    del journal[2]
    now = journal[0]["t"]
    seen = Delivery(t=now + 0.5, inbox="_INBOX.adv.worker.w2", ack="", job_id="job-t1", key="s/inc/1",
                    client_id="trainer", constraint=("min", 1), retry="replayable", session_id="s",
                    fingerprint="fp-first", stream_seq=7, attempt=1, consumer="replica-w2", worker="w2",
                    prompt=prompt_digest(FIRST))  # fmt: skip
    oracle = _oracle(weights, journal, deliveries=[seen])
    oracle._check_served()
    assert [v.line() for v in oracle.violations] == [] and oracle.checks["served"] == 1, oracle.unverified


def test_a_session_conflict_is_not_the_turns_answer(weights: TrainerWeights) -> None:
    """The turn's first asking cut short by the SIGKILL; its job answered Expired (stored by a
    worker, seen by the wiretap); the re-ask by index returns that Expired: right, and checked."""
    journal = _history(weights, {"kind": "error", "cls": "Expired", "code": "expired", "retryable": True})
    del journal[2]
    stored = SimpleNamespace(t=journal[0]["t"] + 5.5, subject="rf.adv.results.trainer.k.job-t1.w2", kind="failure",
                             code="expired", key="s/inc/1", job_id="job-t1", desc={"session_id": "s"})  # fmt: skip
    oracle = _oracle(weights, journal, [stored])
    oracle._check_reask_turns()
    assert [v.line() for v in oracle.violations] == []
    assert oracle.checks["reask-turn"] == 1


def test_a_turn_asked_again_whose_answer_no_store_shows_is_unverified(weights: TrainerWeights) -> None:
    """As above, but the wiretap saw no Expired stored for the turn: the re-ask's Expired may be
    its own wait running out while the job still waited (what the job was answered, nothing
    journaled says). Unverified, with its reason, never a pass."""
    journal = _history(weights, {"kind": "error", "cls": "Expired", "code": "expired", "retryable": True})
    del journal[2]
    oracle = _oracle(weights, journal)
    oracle._check_reask_turns()
    assert oracle.violations == [] and oracle.checks["reask-turn"] == 0
    assert oracle.unverified["reask-turn: the turn's first asking has no answer, and none stored matches"] == 1


def test_a_re_asked_result_no_stored_answer_names_is_flagged(weights: TrainerWeights) -> None:
    journal = _history(weights, _answer(weights, "w2", FIRST))
    del journal[2]
    oracle = _oracle(weights, journal)
    oracle._check_reask_turns()
    assert [(v.check, v.key) for v in oracle.violations] == [("reask-turn", "s/1")], oracle.unverified
