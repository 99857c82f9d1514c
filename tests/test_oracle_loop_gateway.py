"""The oracle's invariants over the adversary's rollout loop and the gateways' HTTP callers, judged
on histories made here (``reliability.adversary.oracle_loop``, ``oracle_gateway``): each history
that keeps the promise passes, and each that breaks it, in the way the product once did, is
flagged by the invariant that owns the promise. Tokens are the keyed echo engine's, made here from
a toy key per version with the engine's own pure functions, as the oracle recomputes them from the
trainer's weights. Pure: milliseconds, no process.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from reliability.adversary.journal import prompt_digest
from reliability.adversary.oracle_gateway import (
    UNSEEN_WORK,
    calls_of,
    judge_answers,
    judge_gone,
    judge_keys_and_turns,
)
from reliability.adversary.oracle_loop import Answer, judge_loops, lives_of
from rollfleet.workers.engines.keyed import VOCAB, keyed_tokens


class Judged:
    """The oracle's bookkeeping, as the invariants see it."""

    def __init__(self) -> None:
        self.checks: dict[str, int] = defaultdict(int)
        self.unverified: dict[str, int] = defaultdict(int)
        self.violations: list[tuple[str, str | None, str]] = []

    def check(self, name: str, ok: bool, key: str | None, message: str, defect: str | None = None) -> bool:
        self.checks[name] += 1
        if not ok:
            self.violations.append((name, key, message))
        return ok

    def flagged(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for name, _, message in self.violations:
            out[name].append(message)
        return dict(out)


def key_of(version: int) -> bytes:
    return hashlib.blake2b(f"weights v{version}".encode(), digest_size=32).digest()


def made(prompt: list[int], count: int, version: int, *, seed: int | None, index: int) -> list[int]:
    """What the keyed echo makes for sample ``index`` of a request (a stream of the group)."""
    return keyed_tokens(key_of(version), prompt, count, seed=seed, sample=index, vocab=VOCAB)


PROMPT = [1, 2, 33, 444]
PLAN = {"group_size": 3, "max_staleness": 1, "stale": "drop", "split_groups": True, "partial_rollout": True}


def sample(tokens: list[int], spans: list[list[Any]], finish: str = "length") -> dict[str, Any]:
    return {"tokens": tokens, "spans": spans, "finish": finish}


def seeded_group(seed: int | None = 7, version: int = 4, count: int = 12) -> dict[str, Any]:
    samples = [sample(made(PROMPT, count, version, seed=seed, index=i), [[version, 0, count, "w1"]]) for i in range(3)]
    return {"prompt": PROMPT, "seed": seed, "max_tokens": count, "samples": samples, "jobs": []}


def life_records(groups: list[dict[str, Any]], version_before: int = 4, **plan: Any) -> list[dict[str, Any]]:
    return [
        {"ev": "loop_open", "loop": "L0.0", "inc": 0, "client_id": "loop-0", "plan": {**PLAN, **plan}, "t": 100.0},
        {"ev": "loop_batch", "loop": "L0.0", "step": 1, "version_before": version_before, "groups": groups, "t": 110.0},
    ]


def judge(
    records: list[dict[str, Any]],
    answers: list[Answer] | None = None,
    blind: bool = False,
    prompts: set[str] | None = None,
) -> Judged:
    """``prompts``: the prompt digests of the loop's jobs the wiretap saw delivered."""
    j = Judged()
    judge_loops(
        j,
        records,
        answers or [],
        stored={},
        submitted={},
        key_of=key_of,
        keyed=lambda worker: True,
        blind=lambda t0, t1: blind,
        killed=set(),
        prompts={"loop-0": prompts or set()},
    )
    return j


# -- the loop: groups, tokens, staleness ------------------------------------------------------------


def test_a_whole_seeded_group_of_distinct_streams_passes() -> None:
    j = judge(life_records([seeded_group()]))
    assert j.flagged() == {}
    assert j.checks["loop-group"] == j.checks["served"] == j.checks["loop-staleness"] == 1


def test_a_seeded_group_of_copies_is_flagged() -> None:
    # Split into n = 1 jobs that each sent the group's seed: every sample is the group's stream 0,
    # whatever the loop says it sent.
    group = seeded_group()
    copy = group["samples"][0]
    group["samples"] = [dict(copy) for _ in range(3)]
    found = judge(life_records([group])).flagged()
    assert list(found) == ["loop-group"] and "copies" in found["loop-group"][0]


def test_unseeded_copies_are_not_demanded_distinct() -> None:
    group = seeded_group(seed=None)
    group["samples"] = [dict(group["samples"][0]) for _ in range(3)]
    assert judge(life_records([group])).flagged() == {}


def continued(version_from: int, version_to: int, cut: int, count: int, index: int, seed: int) -> dict[str, Any]:
    """A sample stopped after ``cut`` tokens at ``version_from`` and continued at ``version_to`` from
    its tokens so far (its own stream, as one chain of context)."""
    head = made(PROMPT, cut, version_from, seed=seed, index=index)
    rest = keyed_tokens(key_of(version_to), [*PROMPT, *head], count - cut, seed=seed + index, sample=0, vocab=VOCAB)
    return sample([*head, *rest], [[version_from, 0, cut, "w1"], [version_to, cut, count, "w2"]])


def test_a_continued_group_is_recomputed_across_its_versions_and_judged_by_its_last_run() -> None:
    samples = [continued(2, 4, 5, 12, i, 7) for i in range(3)]
    group = {"prompt": PROMPT, "seed": 7, "max_tokens": 12, "jobs": [], "samples": samples}
    continuations = {prompt_digest([*PROMPT, *s["tokens"][:5]]) for s in samples}
    # Its samples continued at v4 after 5 tokens (the wiretap saw those jobs): judged by v4.
    assert judge(life_records([group], version_before=5), prompts=continuations).flagged() == {}
    # Continuation jobs never seen: each sample is judged by all its tokens (v2), 3 versions old.
    found = judge(life_records([group], version_before=5)).flagged()
    assert list(found) == ["loop-staleness"] and "staleness 3 > max_staleness 1" in found["loop-staleness"][0]
    # A sample that had finished at v2 before its group was stopped is judged by all its tokens: a
    # group trained at v5 with it is stale, however fresh its continued samples are.
    group["samples"] = [*samples[:2], seeded_group(version=2)["samples"][2]]
    continuations = {prompt_digest([*PROMPT, *s["tokens"][:5]]) for s in samples[:2]}
    found = judge(life_records([group], version_before=5), prompts=continuations).flagged()
    assert list(found) == ["loop-staleness"] and "never continued" in found["loop-staleness"][0]
    # A policy that keeps stale groups is not judged by it.
    assert judge(life_records([group], version_before=5, stale="keep")).flagged() == {}


def test_a_continued_sample_that_changes_streams_is_flagged() -> None:
    # Every stopped sample continued as its own job with the group's seed: sample 2's tokens after
    # the stop are stream 0's, its tokens before it stream 2's.
    samples = [continued(2, 4, 5, 12, i, 7) for i in range(2)]
    head = made(PROMPT, 5, 2, seed=7, index=2)
    tail = keyed_tokens(key_of(4), [*PROMPT, *head], 7, seed=7, sample=0, vocab=VOCAB)
    samples.append(sample([*head, *tail], [[2, 0, 5, "w1"], [4, 5, 12, "w2"]]))
    group = {"prompt": PROMPT, "seed": 7, "max_tokens": 12, "jobs": [], "samples": samples}
    found = judge(life_records([group], version_before=3)).flagged()
    assert list(found) == ["loop-group"] and "sample 2 changes streams" in found["loop-group"][0]


def test_a_span_labelled_with_another_version_is_flagged_by_its_tokens() -> None:
    group = seeded_group(version=4)
    group["samples"][1]["spans"] = [[5, 0, 12, "w1"]]  # made at v4, labelled v5
    found = judge(life_records([group], version_before=5)).flagged()
    assert "served" in found and "labelled v5" in found["served"][0]


def test_a_cut_or_missing_sample_is_flagged() -> None:
    group = seeded_group()
    group["samples"][2] = sample(group["samples"][2]["tokens"][:7], [[4, 0, 7, "w1"]], finish="abort")
    assert "loop-group" in judge(life_records([group])).flagged()
    group = seeded_group()
    group["samples"].pop()
    assert "loop-group" in judge(life_records([group])).flagged()
    group = seeded_group()
    group["samples"][0]["spans"] = [[4, 0, 6, "w1"], [4, 7, 12, "w1"]]  # a token no span made
    assert "loop-group" in judge(life_records([group])).flagged()


def closed(records: list[dict[str, Any]], **totals: int) -> list[dict[str, Any]]:
    return [*records, {"ev": "loop_close", "loop": "L0.0", "t": 130.0, "totals": totals}]


def test_tokens_generated_are_tokens_trained_plus_waste_by_cause() -> None:
    records = closed(life_records([seeded_group()]), tokens=36, waste_tokens_tail=10, waste_tokens_closed=5)
    answers = [Answer("loop-0", "j1", 105.0, 12, "a"), Answer("loop-0", "j2", 105.0, 24, "b"),
               Answer("loop-0", "j3", 106.0, 10, "c"), Answer("loop-0", "j4", 131.0, 5, "d"),
               Answer("someone-else", "j9", 106.0, 99, "e")]  # fmt: skip
    j = judge(records, answers)
    assert j.flagged() == {} and j.checks["loop-tokens"] == 1
    # A job's stopped answer counted nowhere (a continued group that then failed).
    found = judge(records, [*answers, Answer("loop-0", "j5", 107.0, 262, "f")]).flagged()
    assert list(found) == ["loop-tokens"] and "262 unaccounted" in found["loop-tokens"][0]
    # The loop's own count of trained tokens differing from the batches the trainer received.
    found = judge(closed(life_records([seeded_group()]), tokens=40, waste_tokens_tail=6, waste_tokens_closed=5),
                  answers).flagged()  # fmt: skip
    assert "loop-tokens" in found and "counts 40 tokens trained" in found["loop-tokens"][0]
    # The wiretap away during the life: a difference is not verifiable, never a violation.
    j = judge(records, [*answers, Answer("loop-0", "j5", 107.0, 262, "f")], blind=True)
    assert j.flagged() == {} and j.unverified["loop-tokens: the wiretap away during the life"] == 1


def test_a_job_answered_twice_counts_its_stored_answer_once() -> None:
    records = closed(life_records([seeded_group()]), tokens=36)
    twice = [Answer("loop-0", "j1", 105.0, 36, "first"), Answer("loop-0", "j1", 109.0, 20, "stored")]
    j = Judged()
    judge_loops(j, records, twice, stored={"j1": {"first"}}, submitted={}, key_of=key_of, keyed=lambda w: True,
                blind=lambda a, b: False, killed=set())  # fmt: skip
    assert j.flagged() == {}


def test_a_loop_that_hung_or_raised_is_flagged_and_a_killed_one_is_not_verifiable() -> None:
    records = [*life_records([]), {"ev": "loop_hang", "loop": "L0.0", "where": "next_batch", "waited_s": 75.0}]
    assert "loop-ran" in judge(records).flagged()
    j = Judged()
    judge_loops(j, life_records([seeded_group()]), [], stored={}, submitted={}, key_of=key_of, keyed=lambda w: True,
                blind=lambda a, b: False, killed={0})  # fmt: skip
    assert j.flagged() == {} and j.unverified["loop-tokens: cut short by the trainer's SIGKILL"] == 1
    assert [life.lid for life in lives_of(records)] == ["L0.0"]


# -- the gateways: keys, turns, versions, callers that left ------------------------------------------


def gw_answer(job: str, tokens: list[int], version: int, key: str | None) -> dict[str, Any]:
    return {"kind": "result", "job_id": job, "worker_id": "w1", "version_start": version, "version_end": version,
            "spans": [[[version, 0, len(tokens)]]], "token_ids": [tokens], "tokens": f"digest-{job}",
            "replicas": [["w1"]], "idem_key": key}  # fmt: skip


def turn_call(rid: str, traj: str, turn: int, key: str | None, tries: list[dict[str, Any]], **body: Any) -> list[Any]:
    call = {"ev": "gw_call", "rid": rid, "kind": "turn", "traj": traj, "turn": turn, "key": key, "t0": 100.0 + turn,
            "body": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, **body}}  # fmt: skip
    return [call, *({"ev": "gw_try", "rid": rid, "try": i + 1, "key": key, "input_ids": PROMPT, **t}
                    for i, t in enumerate(tries))]  # fmt: skip


def test_a_key_is_one_answer_and_a_retried_key_no_new_turn() -> None:
    tokens = made(PROMPT, 6, 0, seed=None, index=0)
    answered = {"status": 200, "answer": gw_answer("j1", tokens, 0, "k0")}
    same = turn_call("r1", "traj-1", 0, "k0", [{"status": 503}, answered, answered])
    j = Judged()
    judge_keys_and_turns(j, calls_of(same), {"j1": "gw-s"}, {"gw-s": {"j1"}})
    assert j.flagged() == {} and j.checks["once"] == 2
    # The same key retried ran a new job (a session turn that ignored its key): two answers, and
    # a turn too many.
    other = {"status": 200, "answer": gw_answer("j2", tokens, 0, "k0")}
    again = turn_call("r1", "traj-1", 0, "k0", [answered, other])
    j = Judged()
    judge_keys_and_turns(j, calls_of(again), {"j1": "gw-s", "j2": "gw-s"}, {"gw-s": {"j1", "j2"}})
    found = j.flagged()["once"]
    assert len(found) == 2 and "2 different answers" in found[0] and "ran 2 turn jobs for 1 keys" in found[1]
    # Asked again at the end, the key ran its turn again: another answer.
    final = {"gw:k0@g1": {**gw_answer("j1", tokens, 0, "k0"), "kind": "http-result", "status": 200},
             "gw:k0@g2": {**gw_answer("j3", tokens, 0, "k0"), "kind": "http-result", "status": 200}}  # fmt: skip
    j = Judged()
    judge_keys_and_turns(j, calls_of(same), {"j1": "gw-s", "j3": "gw-s"}, {"gw-s": {"j1"}}, final)
    assert "2 different answers" in j.flagged()["once"][0]
    # Asked again through a gateway restarted since: no answer within its time-out.
    final = {"gw:k0@g1": {"kind": "http-none", "waited_s": 25.0, "error": "TimeoutError()"}}
    j = Judged()
    judge_keys_and_turns(j, calls_of(same), {"j1": "gw-s"}, {"gw-s": {"j1"}}, final)
    assert "through g1: no answer in 25.0 s" in j.flagged()["once"][0]
    final = {"gw:k0@g1": {"kind": "http-error", "status": 504, "cls": "Expired", "message": "past its deadline"}}
    j = Judged()
    judge_keys_and_turns(j, calls_of(same), {"j1": "gw-s"}, {"gw-s": {"j1"}}, final)
    assert "answered 504 Expired" in j.flagged()["once"][0]


def test_a_try_cut_short_by_the_trainers_sigkill_counts_from_its_send() -> None:
    # Seed 747109: turns 0 and 1 answered; turn 2's try sent, then the trainer SIGKILLed before
    # the try ended (no ``gw_try``), and its turn ran: three jobs, for three keys sent.
    tokens = made(PROMPT, 6, 0, seed=None, index=0)
    records = [*turn_call("r0", "tr", 0, "k0", [{"status": 200, "answer": gw_answer("j0", tokens, 0, "k0")}]),
               *turn_call("r1", "tr", 1, "k1", [{"status": 200, "answer": gw_answer("j1", tokens, 0, "k1")}]),
               *turn_call("r2", "tr", 2, "k2", [])]  # fmt: skip
    sent = {"ev": "gw_send", "rid": "r2", "try": 1, "key": "k2", "input_ids": PROMPT}
    sessions = ({"j0": "gw-s", "j1": "gw-s", "j2": "gw-s"}, {"gw-s": {"j0", "j1", "j2"}})
    j = Judged()
    judge_keys_and_turns(j, calls_of([*records, sent]), *sessions)
    assert j.flagged() == {}
    # Without the send, nothing accounts for the third job: a turn too many.
    j = Judged()
    judge_keys_and_turns(j, calls_of(records), *sessions)
    assert "ran 3 turn jobs for 2 keys" in j.flagged()["once"][0]
    # A keyless try counts once, from its send and its end alike; a second one only if sent.
    keyless = [*turn_call("r0", "tr", 0, None, [{"status": 200, "answer": gw_answer("j0", tokens, 0, None)}]),
               {"ev": "gw_send", "rid": "r0", "try": 1, "key": None, "input_ids": PROMPT}]  # fmt: skip
    two = ({"j0": "gw-s", "j1": "gw-s"}, {"gw-s": {"j0", "j1"}})
    j = Judged()
    judge_keys_and_turns(j, calls_of(keyless), *two)
    assert "ran 2 turn jobs for 1 keys" in j.flagged()["once"][0]
    j = Judged()
    judge_keys_and_turns(j, calls_of([*keyless, {**keyless[-1], "try": 2}]), *two)
    assert j.flagged() == {}


def test_a_turn_answered_outside_its_version_or_below_its_last_is_flagged() -> None:
    def judged(records: list[Any]) -> dict[str, list[str]]:
        j = Judged()
        judge_answers(j, calls_of(records), served=lambda answer, prompt, seed: [])
        return j.flagged()

    t0, t1 = made(PROMPT, 6, 0, seed=None, index=0), made(PROMPT, 6, 3, seed=None, index=0)
    fine = [*turn_call("r1", "tr", 0, "k0", [{"status": 200, "answer": gw_answer("j1", t1, 3, "k0")}]),
            *turn_call("r2", "tr", 1, None, [{"status": 200, "answer": gw_answer("j2", t1, 3, None)}],
                       weight_version={"min_required_version": 2})]  # fmt: skip
    assert judged(fine) == {}
    # A later turn asking exact_version 7 answered from version 0 (its constraint ignored).
    wrong = turn_call("r3", "tr2", 0, None, [{"status": 200, "answer": gw_answer("j3", t0, 0, None)}],
                      weight_version={"exact_version": 7})  # fmt: skip
    assert "asked exact_version 7" in judged(wrong)["version"][0]
    # A monotonic session's turn served below its previous turn's version.
    down = [*turn_call("r1", "tr", 0, "k0", [{"status": 200, "answer": gw_answer("j1", t1, 3, "k0")}]),
            *turn_call("r2", "tr", 1, "k1", [{"status": 200, "answer": gw_answer("j2", t0, 0, "k1")}])]  # fmt: skip
    assert "monotonic" in judged(down)["version"][0]


def gone(
    delivered: list[tuple[float, str]],
    answered: list[tuple[float, str, str]],
    *,
    gateway_stops: list[list[float]] | None = None,
    gateway_end: float | None = None,
    acks: dict[str, list[tuple[float, str]]] | None = None,
    reused_at: float | None = None,
) -> Judged:
    """A keyless caller that left g1 at 100.0; its job delivered (time, worker) and answered (time,
    worker, kind) as given; ``reused_at``: the same job id delivered then with another request
    (another try's prompt, asking the same session turn)."""
    prompt = [11, 1, 5000, 6000, 7000]
    records = [
        {"ev": "gw_call", "rid": "r1", "kind": "plain", "traj": None, "turn": None, "key": None, "t0": 99.0,
         "body": {"input_ids": prompt}},
        {"ev": "gw_try", "rid": "r1", "try": 1, "gateway": "g1", "t_sent": 99.5, "key": None, "input_ids": prompt,
         "gone": True, "t_gone": 100.0},
    ]  # fmt: skip
    deliveries = [SimpleNamespace(t=t, job_id="job1", client_id="gateway", prompt=prompt_digest(prompt), worker=w,
                                  ack=f"ack{i}") for i, (t, w) in enumerate(delivered)]  # fmt: skip
    if reused_at is not None:
        deliveries.append(SimpleNamespace(t=reused_at, job_id="job1", client_id="gateway", worker="w1", ack="ackx",
                                          prompt=prompt_digest([11, 1, 5000, 6000, 7001])))  # fmt: skip
    published = [SimpleNamespace(t=t, job_id="job1", worker=w, kind=kind) for t, w, kind in answered]
    j = Judged()
    judge_gone(
        j,
        calls_of(records),
        deliveries=deliveries,
        published=published,
        acks=acks or {},
        gateway_lives=[SimpleNamespace(name="g1", start=0.0, end=gateway_end, stops=gateway_stops or [])],
        worker_lives=[SimpleNamespace(worker_id="w1", start=0.0, end=None, stops=[])],
        outages=[],
        gaps=[],
        client_id="gateway",
        run_end=200.0,
    )
    return j


def test_a_job_whose_caller_left_stops_within_the_bound() -> None:
    # Stopped 1 s after its caller left: its partial answer published.
    assert gone([(99.8, "w1")], [(101.0, "w1", "result")]).flagged() == {}
    # Run to its end for nobody: answered 7 s after the caller left.
    found = gone([(99.8, "w1")], [(107.0, "w1", "result")]).flagged()
    assert "gone" in found and "7.00 s after" in found["gone"][0]
    # Never answered, its worker alive and still acking progress after the bound: generating for
    # nobody to the end of the run.
    working = {"ack0": [(100.5, "+WPI"), (103.0, "+WPI"), (106.0, "+WPI")]}
    assert "gone" in gone([(99.8, "w1")], [], acks=working).flagged()
    # Never answered nor acked past the bound: nothing shows it was worked on (a worker running a
    # job acks its progress); not verifiable, not a violation.
    j = gone([(99.8, "w1")], [], acks={"ack0": [(100.5, "+WPI")]})
    assert j.flagged() == {} and j.unverified[UNSEEN_WORK] == 1
    # Delivered (again) after the bound: generating for nobody, however it ends.
    assert "gone" in gone([(99.8, "w1"), (106.0, "w1")], [(100.5, "w1", "result"), (108.0, "w1", "result")]).flagged()
    # Handed back at once (a nak) counts as ended.
    assert gone([(99.8, "w1")], [], acks={"ack0": [(100.3, "-NAK")]}).flagged() == {}


def test_a_job_id_that_later_carries_another_tries_request_is_judged_by_its_own_request_only() -> None:
    """Seed 8080 of a campaign: a keyless try's caller left; its turn's job was held, then handed
    back unrun. A keyless retry through another gateway asked the same session turn with its own
    prompt, under the same job id, and that request ran 6.2 s later for a caller still waiting.
    That run is the retry's, not the first try's: nothing ran for the caller that left. The same
    timing with the first try's own request delivered again is a run for nobody."""
    handed_back = {"ack0": [(100.3, "+WPI"), (101.6, "-NAK")]}
    assert gone([(99.8, "w1")], [(107.4, "w1", "result")], acks=handed_back, reused_at=106.3).flagged() == {}
    found = gone([(99.8, "w1"), (106.3, "w1")], [(107.4, "w1", "result")], acks=handed_back).flagged()
    assert "gone" in found


def test_the_bound_waits_for_a_frozen_gateway_and_a_dead_one_cannot_cancel() -> None:
    # Its gateway frozen 100-104: it learns of the leaving at 104, and stops the job by 109.
    assert gone([(99.8, "w1")], [(107.0, "w1", "result")], gateway_stops=[[100.0, 104.0]]).flagged() == {}
    # Its gateway SIGKILLed at 102: nobody is left to cancel; not verifiable, not a violation.
    j = gone([(99.8, "w1")], [(107.0, "w1", "result")], gateway_end=102.0)
    assert j.flagged() == {} and j.unverified["gone: the caller's gateway ended before the bound"] == 1
