"""The oracle's ``served`` invariant against a real keyed echo worker process (issue 30).

A ``rollfleet worker --engine echo --echo-keyed`` process follows a real policy store to v1
(a delta on v0); its real answers are recomputed token by token from the trainer's own v1
tensors (``reliability.adversary.truth``), and differ from what v0's make. The same real answers,
mutated as a lying fleet would serve them (a label one version off, the tokens of two answers
swapped), are flagged, by the truth check and by the oracle that wires it in.
"""

from __future__ import annotations

import asyncio
import copy
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness import start_worker_process, temp_broker, wait_until
from harness.processes import CHILD_LOG_ENV, spawn, worker_command
from harness.weights import write_base_checkpoint
from reliability.adversary.journal import describe_result, seed_used
from reliability.adversary.oracle import Oracle
from reliability.adversary.trainer_weights import TrainerWeights
from reliability.adversary.truth import Truth, recompute
from rollfleet.broker.topology import TopologyConfig
from rollfleet.runtime.processes import terminate
from rollfleet.schemas import Names, RolloutPayload, SamplingParams
from rollfleet.schemas.progress import TokensRecord
from rollfleet.schemas.seeds import job_seed
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests.helpers import progress_records

pytestmark = pytest.mark.timeout(120)

SEED = 3
PROMPTS = ([5, 6, 7], [9, 1, 4, 4])


@dataclass
class Served:
    weights: TrainerWeights
    answers: list[dict[str, Any]]  # describe_result of each real answer, in PROMPTS' order
    log: Path


async def _serve(url: str, tmp: Path) -> Served:
    namespace = "truth"
    weights = TrainerWeights(write_base_checkpoint(tmp / "base"), SEED)
    publisher = PolicyPublisher(tmp / "store", weights.base_dir, keep_last=None)
    log = tmp / "worker.log"
    async with await RolloutClient.connect(url, namespace=namespace, client_id="trainer") as client:
        await client.publish_policy(publisher, weights.at(0))
        cmd = worker_command(url, namespace, "w1", "--engine", "echo", "--echo-keyed", "--heartbeat", "0.5",
                             "--store", str(tmp / "store"), "--local-dir", str(tmp / "local"), "--catch-up-wait", "30")
        proc = spawn(cmd, log, env=CHILD_LOG_ENV)
        try:
            await client.wait_for_version(0, replicas=1, timeout=60)
            await client.publish_policy(publisher, weights.at(1))  # a delta: the worker reloads what changed
            await client.wait_for_version(1, replicas=1, timeout=60)
            handles = [
                await client.submit(
                    RolloutPayload(prompt_token_ids=p, sampling=SamplingParams(max_tokens=24), n=2 - i),
                    exact_version=1,
                    timeout=30,
                )
                for i, p in enumerate(PROMPTS)
            ]
            results = [await h.result(30) for h in handles]
        finally:
            terminate(proc, 10.0)
    return Served(weights, [describe_result(r) for r in results], log)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """Real answers of a keyed echo worker process at v1 (one worker run for the module)."""
    with temp_broker() as broker:
        return asyncio.run(_serve(broker.url, tmp_path_factory.mktemp("truth")))


def _judge(truth: Truth, desc: dict[str, Any], prompt: list[int]) -> Any:
    return truth.judge(desc, prompt, seed=None, versions=[0, 1], keyed_replica=lambda w: w == "w1")


def test_a_keyed_echo_worker_serves_the_tokens_its_weights_make(served: Served) -> None:
    truth = Truth(served.weights)
    for desc, prompt in zip(served.answers, PROMPTS, strict=True):
        assert desc["spans"] and all(s[0] == 1 for spans in desc["spans"] for s in spans), desc["spans"]
        verdict = _judge(truth, desc, prompt)
        assert verdict.mismatches == [] and verdict.checked == desc["ntokens"] > 0, (verdict, served.log.read_text())
        # v0's weights make other tokens: the label is proved by the weights, not by itself.
        as_v0 = recompute(lambda v: truth.key(0), prompt, desc["token_ids"], desc["spans"], seed=None)
        assert len(as_v0.mismatches) == len(desc["token_ids"]) and all(
            m.bad >= 20 for m in as_v0.mismatches
        ), as_v0
    a = served.answers[0]["token_ids"]
    assert len(a) == 2 and a[0] != a[1]  # the two samples of one request differ


def _mutations(served: Served) -> dict[str, tuple[dict[str, Any], list[int]]]:
    """key -> (an answer, its request's prompt): the real first answer, and real answers mutated."""
    first, second = served.answers
    off = copy.deepcopy(first)
    off["spans"] = [[[v - 1, s, e] for v, s, e in spans] for spans in off["spans"]]
    off["version_start"] = off["version_end"] = 0
    swapped_a, swapped_b = copy.deepcopy(first), copy.deepcopy(second)
    swapped_a["token_ids"][0], swapped_b["token_ids"][0] = second["token_ids"][0], first["token_ids"][0]
    return {
        "real": (first, PROMPTS[0]),
        "one-version-off": (off, PROMPTS[0]),
        "swapped-a": (swapped_a, PROMPTS[0]),
        "swapped-b": (swapped_b, PROMPTS[1]),
    }


def test_the_truth_check_flags_a_label_one_version_off_and_swapped_tokens(served: Served) -> None:
    truth = Truth(served.weights)
    verdicts = {k: _judge(truth, desc, prompt) for k, (desc, prompt) in _mutations(served).items()}
    assert verdicts["real"].mismatches == []
    off = verdicts["one-version-off"].mismatches
    assert len(off) == 2 and all(m.version == 0 and m.fits == (1,) for m in off)  # the tokens are v1's
    assert [m.sample for m in verdicts["swapped-a"].mismatches] == [0]
    assert [m.sample for m in verdicts["swapped-b"].mismatches] == [0]


def test_the_oracle_judges_served_once_per_answer(served: Served) -> None:
    """The same histories through ``Oracle``: one ``served`` check per accepted answer (the real
    one handed over again by the final re-ask is the same answer, not a second check)."""
    now = time.time()
    journal: list[dict[str, Any]] = []
    mutations = _mutations(served)
    for i, (key, (desc, prompt)) in enumerate(mutations.items()):
        req = {"kind": "exact", "value": 1, "retry": "replayable", "payload": {"prompt": prompt, "max_tokens": 24},
               "timeout": 30}
        rid = f"r{i}"
        journal += [
            {"ev": "submit", "rid": rid, "inc": 0, "op": "submit", "key": key, "t": now, "req": req},
            {"ev": "stored", "rid": rid, "key": key, "t": now, "job_id": f"job-{key}", "deadline": now + 30},
            {"ev": "answer", "rid": rid, "inc": 0, "op": "submit", "key": key, "t": now + 1, **desc,
             "job_id": f"job-{key}"},
        ]
    tl = SimpleNamespace(workers=[SimpleNamespace(worker_id="w1", engine="echo", start=now - 5, end=None,
                                                  paused_at=None, how="", armed=None)],
                         broker_down=[], commits=[(0, now - 9, now - 9), (1, now - 8, now - 8)], hidden=[],
                         corrupt=[], consumers_deleted=[], trainers=[], second_clients=[], events=[])
    tap = SimpleNamespace(deliveries=[], published=[], acks={}, claims=[], stored_jobs={}, fleet=[], gaps=[])
    oracle = Oracle(cfg=SimpleNamespace(seed=SEED, ack_wait=5.0, duplicate_window=60.0, max_deliver=10, duration=10),
                    timeline=tl, tap=tap, trainer=journal, rogue=[], activations=[], stored={},
                    finals={"real": {**mutations["real"][0], "job_id": "job-real", "t": now + 2}},
                    weights=served.weights, names=Names("truth"))
    oracle.judge()
    assert oracle.checks["served"] == 4
    flagged = sorted(v.key for v in oracle.violations if v.check == "served")
    assert flagged == ["one-version-off", "swapped-a", "swapped-b"], [v.line() for v in oracle.violations]


async def test_a_job_resumed_on_another_worker_at_another_version_is_recomputed_span_by_span(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A resumable job of two samples: its keyed worker SIGKILLed while sample 1 is under way, v1
    committed, and another keyed worker (at v1) continues it from the prompt and the kept
    tokens. Each span is recomputed from its own version's weights: a's at v0, b's at v1."""
    weights = TrainerWeights(write_base_checkpoint(tmp_path / "base"), SEED)
    publisher = PolicyPublisher(tmp_path / "store", weights.base_dir, keep_last=None)
    args = ("--engine", "echo", "--echo-keyed", "--echo-token-latency", "0.01", "--store", str(tmp_path / "store"),
            "--catch-up-wait", "30", "--ack-wait", "1.0", "--checkpoint-tokens", "16", "--checkpoint-s", "0.2")
    prompt = [7, 7, 1]
    job = RolloutPayload(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=80), n=2)
    topology = TopologyConfig(ack_wait_s=1.0)  # a dead holder's job is taken over within a second
    a = start_worker_process(nats_url, namespace, "a", *args, "--local-dir", str(tmp_path / "la"),
                             log_path=tmp_path / "a.log")
    b = None
    try:
        async with await RolloutClient.connect(
            nats_url, namespace=namespace, client_id="c", topology=topology
        ) as client:
            await client.publish_policy(publisher, weights.at(0))
            await client.wait_for_version(0, replicas=1, timeout=60)
            handle = await client.submit(job, min_version=0, retry_policy="resume", idempotency_key="k", timeout=120)

            async def sample_1_under_way() -> bool:  # (the echo makes its samples one after the other)
                records = await progress_records(client.js, client.names, "c", handle.job_id)
                made = [d for r in records if isinstance(r, TokensRecord) for d in r.samples if d.index == 1]
                return sum(len(d.token_ids) for d in made) >= 16

            await wait_until(sample_1_under_way, timeout=30)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            await client.publish_policy(publisher, weights.at(1))
            b = start_worker_process(nats_url, namespace, "b", *args, "--local-dir", str(tmp_path / "lb"),
                                     log_path=tmp_path / "b.log")
            result = await handle.result(60)
    finally:
        terminate(a, 10.0, signal.SIGKILL)
        if b is not None:
            terminate(b, 10.0, signal.SIGKILL)
    desc = describe_result(result)
    assert desc["kept"] > 0 and [s[-1][0] for s in desc["spans"]] == [0, 1], desc["spans"]  # v0 by a, then v1 by b
    assert {r for names in desc["replicas"] for r in names} == {"a", "b"}
    # The job gave no seed: both runs drew its job's seed, which its replay coordinate names.
    seed = seed_used({}, desc)
    assert seed == job_seed(handle.job_id)
    truth = Truth(weights)
    verdict = truth.judge(desc, prompt, seed=seed, versions=[0, 1], keyed_replica=lambda w: w in ("a", "b"))
    assert verdict.mismatches == [] and verdict.checked == 160, verdict
    # Labelled all v0 (b's tokens told as a's version), the resumed span is caught.
    as_v0 = {**desc, "spans": [[[0, s, e] for _, s, e in spans] for spans in desc["spans"]]}
    bad = truth.judge(as_v0, prompt, seed=seed, versions=[0, 1], keyed_replica=lambda w: True).mismatches
    assert [(m.sample, m.fits) for m in bad] == [(1, (1,))], bad
