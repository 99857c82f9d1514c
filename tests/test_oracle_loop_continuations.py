"""The oracle's ``loop-staleness`` for a continued sample whose continuation job the wiretap never saw
delivered, on a recorded history (no processes). Seed 989501: a partial rollout stopped sample 0
after 5 tokens made at v33 and continued it at v36; the trainer, at v37, took it with
``max_staleness=2``. The wiretap mirrors a worker's inbox only once it hears the pull request that
names it, and the first deliveries of a new version's consumer can arrive before that: it missed the
continuation's delivery. The oracle found a sample's continuations only among the jobs it saw
delivered, so it judged the sample "never continued", from v33, and flagged the loop for a group it
had judged right. A job is heard as its client stores it, whoever it is delivered to: the prompt of
every job the loop stored says where its samples were continued.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from harness.weights import write_base_checkpoint
from reliability.adversary.journal import prompt_digest
from reliability.adversary.oracle import Oracle
from reliability.adversary.tap import Delivery
from reliability.adversary.trainer_weights import TrainerWeights
from reliability.adversary.truth import tensors_key
from rollfleet.workers.engines.keyed import VOCAB, keyed_tokens
from tests.oracle_histories import echo_worker, history_oracle

SEED, GROUP_SEED, CUT, COUNT = 5, 7, 5, 12
PROMPT = [1, 2, 33, 444]
PLAN = {"group_size": 3, "batch_groups": 1, "max_staleness": 1, "stale": "drop", "split_groups": True,
        "partial_rollout": True}  # fmt: skip
UNSEEN = "loop-staleness: a job of the loop answered whose prompt the wiretap never saw"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> TrainerWeights:
    return TrainerWeights(write_base_checkpoint(tmp_path_factory.mktemp("base")), SEED)


def _made(weights: TrainerWeights, version: int, context: list[int], count: int, index: int) -> list[int]:
    """Sample ``index``'s tokens as the keyed echo makes them at ``version`` (its own stream)."""
    key = tensors_key(weights.at(version))
    return keyed_tokens(key, context, count, seed=GROUP_SEED + index, sample=0, vocab=VOCAB)


def _history(weights: TrainerWeights, *, stored_seen: bool, continued: bool = True) -> Oracle:
    """One batch at v3 of a group whose samples made 5 tokens at v1 and (``continued``) the rest
    at v2 as continuation jobs, or (not) all 12 at v1 in one job. The wiretap saw the first jobs
    delivered and stored; the continuations' deliveries it missed, their stores it heard only
    where ``stored_seen``."""
    t = time.time()
    samples, stored, deliveries, prompts = [], {}, [], {}
    for i in range(3):
        head = _made(weights, 1, PROMPT, CUT if continued else COUNT, i)
        jobs = [(f"first-{i}", PROMPT, head, 1)]
        spans = [[1, 0, len(head), "w1"]]
        if continued:
            rest = _made(weights, 2, [*PROMPT, *head], COUNT - CUT, i)
            jobs.append((f"cont-{i}", [*PROMPT, *head], rest, 2))
            spans.append([2, CUT, COUNT, "w2"])
        samples.append({"tokens": [*head, *(rest if continued else [])], "spans": spans, "finish": "length"})
        for n, (job, prompt, tokens, _) in enumerate(jobs):
            subject = f"rf.adv.results.loop-0.k{job}.{job}.w{n + 1}"
            stored[job] = [{"subject": subject, "seq": 10 + i * 2 + n, "digest": f"d-{job}", "kind": "result",
                            "job_id": job, "ntokens": len(tokens)}]  # fmt: skip
            if n == 0:
                deliveries.append(Delivery(
                    t=t + 0.1, inbox="rf.adv.jobs.min.1", ack=f"$JS.ACK.RF_ADV_JOBS.min-1.1.{i + 1}.{i + 1}.1.0",
                    job_id=job, key=f"loop:x:p0:a1:r0:s{i}:d0", client_id="loop-0", constraint=("min", 1),
                    retry="replayable", session_id=None, fingerprint="fp", stream_seq=i + 1, attempt=1,
                    consumer="min-1", max_tokens=COUNT, submitted_at=t, deadline=t + 30, worker="w1",
                    prompt=prompt_digest(prompt),
                ))  # fmt: skip
            if n == 0 or stored_seen:
                prompts[job] = ["loop-0", prompt_digest(prompt)]
    group = {"prompt": PROMPT, "seed": GROUP_SEED, "max_tokens": COUNT, "samples": samples, "jobs": []}
    journal: list[dict[str, Any]] = [
        {"ev": "loop_open", "loop": "L0.0", "inc": 0, "client_id": "loop-0", "plan": PLAN, "t": t},
        {"ev": "loop_batch", "loop": "L0.0", "step": 1, "t_asked": t + 5, "version_before": 3, "version_after": 3,
         "labelled": 3, "groups": [group], "failed": 0, "t": t + 6},
    ]  # fmt: skip
    timeline = {"workers": [echo_worker(w, t - 5, stops=[]) for w in ("w1", "w2")],
                "commits": [(v, t - 9 + v, t - 9 + v) for v in (1, 2, 3)],
                "trainers": [{"incarnation": 0, "start": t - 10}]}  # fmt: skip
    tap = {"deliveries": deliveries, "job_submitted": {j: t for j in stored}, "job_prompts": prompts}
    oracle = history_oracle(journal, timeline=timeline, tap=tap, stored=stored, weights=weights,
                            cfg={"seed": SEED, "ack_wait": 2.0, "duplicate_window": 15.0})  # fmt: skip
    oracle._check_loops()
    return oracle


def _flagged(oracle: Oracle) -> list[str]:
    return [v.line() for v in oracle.violations]


def test_a_continuation_heard_stored_but_not_delivered_judges_the_sample_by_its_last_run(
    weights: TrainerWeights,
) -> None:
    oracle = _history(weights, stored_seen=True)
    assert _flagged(oracle) == []
    assert oracle.checks["loop-staleness"] == 1 and oracle.checks["served"] == 1
    assert not any(k.startswith("loop-staleness") for k in oracle.unverified)


def test_a_continuation_the_wiretap_never_saw_asked_leaves_staleness_unverified(weights: TrainerWeights) -> None:
    # (a run kept before the wiretap heard jobs' prompts as they were stored: their answers say
    # jobs were asked that it cannot place)
    oracle = _history(weights, stored_seen=False)
    assert _flagged(oracle) == []
    assert oracle.unverified[UNSEEN] == 1


def test_a_sample_never_continued_is_still_judged_by_all_its_tokens(weights: TrainerWeights) -> None:
    oracle = _history(weights, stored_seen=True, continued=False)
    found = _flagged(oracle)
    assert len(found) == 1 and "[loop-staleness]" in found[0] and "staleness 2 > max_staleness 1" in found[0]
