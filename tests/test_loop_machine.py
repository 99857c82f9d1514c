"""The rollout loop's decisions (``trainer_client.loop_machine``) as sequences of events, in
milliseconds: its rules as functions, then the machine driven by a simulated fleet (jobs that make
tokens tick by tick at the fleet's version, answer, fail, and answer a cancel with the tokens made
so far). Properties over random sequences (hypothesis): every token received is trained, held or
waste by cause at every step; admission never past its bound; nothing handed out past
``max_staleness`` by the rule; with partial rollouts and tails refreshed, no long prompt is
starved and nothing is thrown away."""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.schemas import Completion, RolloutPayload, RolloutResult, SamplingParams, VersionSpan
from rollfleet.schemas.errors import Cancelled, InvalidRequest, ServiceUnavailable
from rollfleet.schemas.seeds import sample_seed
from rollfleet.trainer_client import loop_machine as rules
from rollfleet.trainer_client.loop_machine import (
    WASTE_CAUSES,
    Cancel,
    End,
    Handout,
    LoopConfig,
    LoopMachine,
    Raise,
    Score,
    Submit,
    Wait,
)

# -- the rules, as functions ------------------------------------------------------------------------


def test_admission_room_is_the_bound_less_what_is_ready_or_in_flight() -> None:
    for eta in range(3):
        for b in (1, 2, 5):
            for at_latest in (True, False):
                bound = (eta + at_latest) * b
                for ready in range(bound + 3):
                    for flying in range(bound + 3):
                        room = rules.admission_room(
                            max_staleness=eta, batch_groups=b, ready=ready, in_flight=flying, next_at_latest=at_latest
                        )
                        assert room == max(0, bound - ready - flying)
    assert rules.admission_room(max_staleness=9, batch_groups=4, ready=0, in_flight=3, max_in_flight=5) == 2


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 5),
    eta=st.integers(0, 3),
    steps=st.integers(1, 12),
    finishing=st.lists(st.integers(0, 9), min_size=1, max_size=40),
    per_version=st.integers(1, 4),
)
def test_admitting_by_the_bound_never_yields_a_stale_group_when_groups_finish_in_order(
    batch: int, eta: int, steps: int, finishing: list[int], per_version: int
) -> None:
    """A simulated trainer: each tick admits what the rule allows, some groups finish (in admission
    order), and the trainer asks for a batch whenever one is ready, committing a version after every
    ``per_version`` batches (gradient accumulation). Every batch is handed out (nothing blocks) and
    every consumed group was admitted at most ``eta`` versions before the version it is consumed at."""
    version, admitted_at, in_flight, ready, taken_batches = 0, [], [], [], 0
    at_latest = True
    tick = 0
    while taken_batches < steps and tick < 10_000:
        room = rules.admission_room(
            max_staleness=eta, batch_groups=batch, ready=len(ready), in_flight=len(in_flight), next_at_latest=at_latest
        )
        for _ in range(room):
            admitted_at.append(version)
            in_flight.append(len(admitted_at) - 1)
        done = min(len(in_flight), max(1, finishing[tick % len(finishing)]))
        for _ in range(done):
            ready.append(in_flight.pop(0))
        at_latest = True  # the trainer asks
        if len(ready) >= batch:
            taken, ready = ready[:batch], ready[batch:]
            assert all(version - admitted_at[g] <= eta for g in taken), (version, [admitted_at[g] for g in taken])
            taken_batches += 1
            at_latest = False  # it trains on it
            if taken_batches % per_version == 0:
                version += 1
                at_latest = True
        tick += 1
    assert taken_batches >= steps


def test_new_jobs_ask_for_the_latest_version_once_a_replica_serves_it() -> None:
    args = {"latest": 7, "first": 5, "max_staleness": 3}
    assert rules.submit_floor(**args, fresh_served=True, waited_s=99.0, grace_s=30.0) == 7
    assert rules.submit_floor(**args, fresh_served=False, waited_s=29.9, grace_s=30.0) is None  # wait
    assert rules.submit_floor(**args, fresh_served=False, waited_s=30.0, grace_s=30.0) == 5  # never below first
    assert rules.submit_floor(latest=2, first=0, max_staleness=1, fresh_served=False, waited_s=1, grace_s=0) == 1


def _span(v: int, a: int, b: int) -> VersionSpan:
    return VersionSpan(version=v, start=a, end=b)


def test_a_sample_is_judged_by_the_tokens_of_its_last_run_and_zero_width_spans_never_count() -> None:
    spans = [_span(0, 0, 5), _span(2, 5, 9)]
    assert rules.judged_version(spans, 0, 99) == 0  # made in one run: its oldest token
    assert rules.judged_version(spans, 5, 99) == 2  # continued at token 5: the run since
    assert rules.judged_version([_span(5, 0, 0), _span(6, 0, 4)], 0, 99) == 6
    assert rules.judged_version([], 0, 3) == 3  # no token: the version its run started at
    assert rules.staleness(5, [4, 3, 5]) == 2 and rules.staleness(2, [3]) == 0
    assert not rules.too_stale(5, [4], 1) and rules.too_stale(5, [3], 1)
    assert [rules.on_stale(p) for p in ("drop", "requeue", "keep")] == ["drop", "requeue", "train"]


def test_a_joined_sample_keeps_every_token_and_span_and_drops_zero_width_ones() -> None:
    first = _result([Completion(token_ids=[1, 2, 3], finish_reason="abort", logprobs=[0.0] * 3,
                                weight_versions=[_span(0, 0, 3)])], 0, 0)  # fmt: skip
    prefix = rules.run_sample(first, first.outputs[0], None)
    empty = _result([Completion(token_ids=[], finish_reason="abort", weight_versions=[_span(1, 0, 0)])], 1, 1)
    still = rules.run_sample(empty, empty.outputs[0], prefix)
    assert still.spans == prefix.spans and still.tokens == [1, 2, 3]  # no (1, 3, 3)
    rest = _result([Completion(token_ids=[4, 5], finish_reason="length", logprobs=[0.0] * 2,
                               weight_versions=[_span(2, 0, 2)])], 2, 2)  # fmt: skip
    done = rules.run_sample(rest, rest.outputs[0], still)
    assert done.tokens == [1, 2, 3, 4, 5] and done.spans == [_span(0, 0, 3), _span(2, 3, 5)]
    assert done.continued_from == 3 and done.judged_version == 2 and done.version_start == 0
    assert done.logprobs == [0.0] * 5


def test_the_ready_group_closest_to_going_stale_goes_first() -> None:
    assert rules.next_to_consume([5, 3, 4, 3]) == 1
    assert rules.next_to_consume([7]) == 0


def test_a_batch_waits_for_a_group_in_flight_only_where_taking_it_later_would_be_too_late() -> None:
    wait = rules.wait_for_in_flight
    # Batches of 2 at version 5, max_staleness 1: a group in flight judged from 4 has its last
    # chance now; two ready groups of last chance 7 must not take its place.
    assert wait([6, 6], [4], 5, 1, 2) == 5
    assert wait([4, 6], [4], 5, 1, 2) == 5  # both groups of last chance 5 go now
    assert wait([6, 6], [5], 5, 1, 2) is None  # (its last chance is the next batch, which has room)
    assert wait([5, 6], [5, 5], 5, 1, 2) is None  # three of last chance 6: one now, two next
    assert wait([5, 6], [5, 5, 5], 5, 1, 2) == 6  # four: this batch must take two
    assert wait([5, 5], [5, 5], 5, 1, 2) is None  # (two of them already: the next takes the others)
    assert wait([6, 6], [3], 5, 1, 2) is None  # already past its last chance: no wait saves it
    assert wait([4, 4], [4], 5, 1, 2) is None  # an excess no batch can take: not waited for
    assert wait([4, 4, 4], [], 5, 1, 2) is None


def test_a_job_is_refreshed_only_at_a_fresher_floor() -> None:
    # Partial rollouts: once two batches at most could still take it (at every commit up to 2).
    for eta in (0, 1, 2):
        assert [rules.must_refresh(3, v, v, eta, at_risk_only=True) for v in (3, 4, 5)] == [False, True, True]
    assert [rules.must_refresh(3, v, v, 3, at_risk_only=True) for v in (4, 5)] == [False, True]
    assert [rules.must_refresh(3, v, v, 5, at_risk_only=True) for v in (6, 7)] == [False, True]
    # Not once a finished sample pins its group at or below its own floor: it would gain nothing.
    assert not rules.must_refresh(3, 5, 5, 1, at_risk_only=False, finished_judged=3)
    assert rules.must_refresh(3, 5, 5, 1, at_risk_only=False, finished_judged=4)
    # Never without a fresher floor: no replica at latest (None), or the grace's floor no higher.
    assert not rules.must_refresh(3, None, 9, 1, at_risk_only=True)
    assert not rules.must_refresh(3, 3, 9, 1, at_risk_only=False)
    assert rules.must_refresh(3, 4, 4, 5, at_risk_only=False)  # a tail: at once


def test_tails_are_groups_a_whole_batch_overtook_oldest_first() -> None:
    assert rules.tails([0, 1, 7, 9], [5, 6, 8], oversample=5) == [0, 1]
    assert rules.tails([3, 0, 1], [5, 6], oversample=2) == [0, 1]
    assert rules.tails([0, 1], [5, 6], oversample=0) == []
    assert rules.tails([7], [5, 6], oversample=3) == []
    assert rules.tails([7, 8, 9], [5, 6], oversample=3, risky=[9, 7]) == [7, 9]  # at risk, not overtaken


def test_what_becomes_of_a_group_that_did_not_complete() -> None:
    assert rules.on_failure("requeue", "failed", 1, 3) == "requeue"
    assert rules.on_failure("requeue", "deadline", 3, 3) == "report"
    assert rules.on_failure("report", "failed", 1, 3) == "report"
    assert rules.on_failure("requeue", "closed", 1, 3) == "forget"
    assert rules.past_deadline(0.0, 2.5, 2.0) and not rules.past_deadline(0.0, 1.5, 2.0)
    assert not rules.past_deadline(0.0, 1e9, None)
    assert rules.utilization([1, 2], [2, 2]) == 0.75 and rules.utilization([], []) is None


def test_rewards_are_one_finite_number_per_sample() -> None:
    assert rules.check_rewards([0.0, 1.0], 2) is None
    assert "nan" in (rules.check_rewards([math.nan, 1.0], 2) or "")
    assert rules.check_rewards([math.inf], 1) is not None and rules.check_rewards(["1"], 1) is not None
    assert "3 values for 2" in (rules.check_rewards([0.0] * 3, 2) or "")
    assert rules.uninformative([1.0, 1.0]) and not rules.uninformative([0.0, 1.0]) and not rules.uninformative([])


def test_a_prompt_is_a_nonempty_token_list_text_or_payload() -> None:
    cfg = LoopConfig()
    for bad in ("", [], [1, True], 3, None, RolloutPayload(prompt_token_ids=[])):
        assert isinstance(rules.prompt_payload(bad, cfg), InvalidRequest), bad
    ok = rules.prompt_payload([1, 2], cfg)
    assert isinstance(ok, RolloutPayload) and ok.prompt_token_ids == [1, 2] and ok.sampling == cfg.sampling
    assert isinstance(rules.prompt_payload("hi", cfg), RolloutPayload)


def test_every_way_a_group_is_sent_draws_each_samples_own_stream() -> None:
    base = RolloutPayload(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=9, seed=40))
    [(whole_idx, whole)] = rules.first_pieces(base, 4, split=False)
    assert whole_idx == (0, 1, 2, 3) and whole.n == 4 and whole.sampling.seed == 40
    split = rules.first_pieces(base, 4, split=True)
    assert [(i, p.n, p.sampling.seed) for i, p in split] == [((k,), 1, sample_seed(40, k)) for k in range(4)]
    more = rules.continuation(base, 2, [7, 7], left=5)
    assert more.prompt_token_ids == [1, 2, 7, 7] and more.sampling.seed == 42 and more.sampling.max_tokens == 5
    unseeded = rules.continuation(RolloutPayload(prompt_token_ids=[1]), 3, [], left=1)
    assert unseeded.sampling.seed is None


def test_job_keys_name_their_loop_prompt_and_attempt() -> None:
    key = rules.job_key("run-1", 12, 2, 3, (5,), 1)
    assert rules.key_owner(key) == ("run-1", 12, 2)
    assert rules.key_owner(rules.job_key("x", 0, 1, 0, (0, 1), 0)) == ("x", 0, 1)
    assert rules.key_owner("someone-else") is None and rules.key_owner("loop:x:p1") is None


@pytest.mark.parametrize(
    "bad",
    [{"group_size": 0}, {"batch_groups": "2"}, {"max_staleness": -1}, {"stale": "later"}, {"max_in_flight": 0},
     {"oversample": -1}, {"group_deadline_s": 0.0}, {"job_timeout_s": -1.0}, {"job_timeout_s": math.inf},
     {"activation_grace_s": math.nan}, {"split_groups": 1}, {"retry_policy": "twice"}, {"loop_id": "a b"},
     {"max_attempts": True}],
)  # fmt: skip
def test_a_bad_config_is_a_typed_error_naming_its_field(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        LoopConfig(**bad)
    [name] = bad
    assert caught.value.detail == name and f"LoopConfig.{name}" in caught.value.message


# -- the machine against a simulated fleet ----------------------------------------------------------


def _result(outputs: list[Completion], start: int, end: int, key: str = "k") -> RolloutResult:
    return RolloutResult(
        job_id="j", idempotency_key=key, client_id="c", outputs=outputs, version_start=start, version_end=end,
        worker_id="w", engine="sim", queue_wait_s=0.0, generation_s=0.0, delivery_attempt=1, finished_at=0.0,
    )  # fmt: skip


def _token(stream: int | None, index: int, position: int) -> int:
    """The simulated engine's token: its sample's stream (its seed, or its index in the request)."""
    return (stream if stream is not None else 10_000 + index) * 100_000 + position


@dataclass
class _Job:
    payload: RolloutPayload
    made: list[list[tuple[int, int]]] = field(default_factory=list)  # per sample: (token, version)
    prompt_no: int = 0
    indices: tuple[int, ...] = ()  # the group's samples it makes
    before: int = 0  # tokens its samples made in earlier runs (a continuation's prefix)


_JOB_KEY = re.compile(r"^loop:sim:p(?P<prompt>\d+):a\d+:r(?P<round>\d+):(?:g|s(?P<sample>\d+)):d\d+$")


class Sim:
    """A fleet for the machine: each job makes ``rate`` tokens of each of its samples per tick at the
    fleet's version, answers when every sample is done, answers a cancel with the tokens so far
    (``Cancelled`` if none). ``eos``: (prompt number, sample index) -> the sample's length, where
    it stops ("stop") before its ``max_tokens``. ``delay_cancels``: a cancel lands only at
    ``land()``, and the job may answer on its own before it does (a stop racing a commit)."""

    def __init__(
        self,
        cfg: LoopConfig,
        *,
        rate: int = 4,
        scored: bool = False,
        eos: dict[tuple[int, int], int] | None = None,
        delay_cancels: bool = False,
    ) -> None:
        self.m = LoopMachine(cfg, loop_id="sim", first_version=0, scored=scored)
        self.eos = eos or {}
        self.delay_cancels = delay_cancels
        self.cancels_on_the_way: list[str] = []
        self.base_len: dict[int, int] = {}  # prompt number -> its prompt's length
        self.cfg = cfg
        self.now = 0.0
        self.version = 0
        self.fresh = True
        self.rate = rate
        self.jobs: dict[str, _Job] = {}
        self.cancelled: list[str] = []
        self.scores: list[Score] = []
        self.handed: list[Handout] = []
        self.submits: list[Submit] = []
        self.made_total = 0  # every token the fleet made (the raw side of the identity)
        self.rewards = lambda group: [float(i) for i in range(len(group.samples))]

    def check(self) -> None:
        t = self.m.totals
        waste = sum(t[f"waste_tokens_{c}"] for c in WASTE_CAUSES)
        assert t["generated_tokens"] == t["tokens"] + waste + self.m.held_tokens, dict(t)
        bound = (self.cfg.max_staleness + 1) * self.cfg.batch_groups  # (oversample admits nothing beyond it)
        assert self.m.in_flight + self.m.ready <= bound

    def do(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Submit):
                self.submits.append(a)
                self.jobs[a.key] = self._job(a)
                self.m.submitted(a.key, self.version - a.max_staleness)
            elif isinstance(a, Cancel):
                self.cancelled.append(a.key)
                if self.delay_cancels:
                    self.cancels_on_the_way.append(a.key)
                else:
                    self._cancel(a.key)
            elif isinstance(a, Score):
                self.scores.append(a)
        self.check()

    def _job(self, ask: Submit) -> _Job:
        prompt = ask.payload.prompt_token_ids or []
        m = _JOB_KEY.match(ask.key)
        assert m is not None, ask.key
        no = int(m["prompt"])
        if m["round"] == "0":
            self.base_len[no] = len(prompt)
        indices = (int(m["sample"]),) if m["sample"] is not None else tuple(range(ask.payload.n))
        job = _Job(ask.payload, [[] for _ in range(ask.payload.n)], no, indices)
        job.before = len(prompt) - self.base_len.get(no, len(prompt))
        return job

    def _cancel(self, key: str) -> None:
        job = self.jobs.pop(key, None)
        if job is not None:
            if any(job.made):
                self.do(self.m.answered(self.now, key, self._answer(key, job, "abort")))
            else:
                self.do(self.m.job_failed(self.now, key, Cancelled("withdrawn")))

    def land(self) -> None:
        """Every cancel on its way lands (on a job that already answered: nothing)."""
        while self.cancels_on_the_way:
            self._cancel(self.cancels_on_the_way.pop(0))

    def _done(self, job: _Job, k: int) -> bool:
        """Whether sample ``k`` of ``job`` is complete: its ``max_tokens``, or its length in ``eos``."""
        if len(job.made[k]) >= job.payload.sampling.max_tokens:
            return True
        end = self.eos.get((job.prompt_no, job.indices[k])) if job.indices else None
        return end is not None and job.before + len(job.made[k]) >= end

    def _answer(self, key: str, job: _Job, finish: str) -> RolloutResult:
        outs = []
        for k, made in enumerate(job.made):
            self.made_total += len(made)
            spans = [_span(v, i, i + 1) for i, (_, v) in enumerate(made)]
            merged: list[VersionSpan] = []
            for s in spans:
                if merged and merged[-1].version == s.version:
                    merged[-1] = _span(s.version, merged[-1].start, s.end)
                else:
                    merged.append(s)
            left = job.payload.sampling.max_tokens - len(made)
            why = "length" if left == 0 else "stop" if self._done(job, k) else finish
            outs.append(Completion(token_ids=[t for t, _ in made], finish_reason=why,  # type: ignore[arg-type]
                                   logprobs=[0.0] * len(made), weight_versions=merged))  # fmt: skip
        vs = [v for made in job.made for _, v in made] or [self.version]
        return _result(outs, min(vs), max(vs), key)

    def step(self, ticks: int = 1, stalls: random.Random | None = None) -> None:
        """``ticks`` ticks of the fleet; with ``stalls``, each job makes its tokens of a tick only
        with probability one half (jobs finish in any order)."""
        for _ in range(ticks):
            self.now += 0.1
            for key, job in list(self.jobs.items()):
                if stalls is not None and stalls.random() < 0.5:
                    continue
                prompt = job.payload.prompt_token_ids or [0]
                for i, made in enumerate(job.made):
                    for _ in range(self.rate):
                        if not self._done(job, i):
                            stream = job.payload.sampling.seed
                            stream = stream + i if stream is not None else None
                            made.append((_token(stream, i, len(prompt) + len(made)), self.version))
                if all(self._done(job, i) for i in range(len(job.made))):
                    del self.jobs[key]
                    self.do(self.m.answered(self.now, key, self._answer(key, job, "length")))
            self.do(self.m.tick(self.now))
            while self.scores:
                s = self.scores.pop(0)
                self.do(self.m.scored(self.now, s.group, self.rewards(s.candidate)))

    def commit(self, fresh: bool = True) -> None:
        self.version += 1
        self.fresh = fresh
        self.do(self.m.version_seen(self.now, self.version, fresh))

    def feed(self, *items: Any) -> None:
        for item in items:
            self.do(self.m.prompt(self.now, item))

    def take(self) -> Any:
        decision, actions = self.m.take(self.now)
        self.do(actions)
        if isinstance(decision, Handout):
            self.handed.append(decision)
        return decision

    def fail(self, key: str) -> None:
        self.jobs.pop(key, None)
        self.do(self.m.job_failed(self.now, key, ServiceUnavailable("replica lost")))


def _prompt(i: int, tokens: int = 8, seed: int | None = None) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=[i, 1], sampling=SamplingParams(max_tokens=tokens, seed=seed))


def test_split_and_continued_samples_each_draw_their_own_stream() -> None:
    """A seeded group split into one-sample jobs is, sample by sample, what one job of four makes;
    and stopped by a commit and continued, each sample goes on in its own stream."""
    whole = Sim(LoopConfig(group_size=4, batch_groups=1, max_staleness=3))
    whole.feed(_prompt(1, 6, seed=50))
    whole.step(3)
    split = Sim(LoopConfig(group_size=4, batch_groups=1, max_staleness=3, split_groups=True))
    split.feed(_prompt(1, 6, seed=50))
    split.step(3)
    cont = Sim(
        LoopConfig(group_size=4, batch_groups=1, max_staleness=0, partial_rollout=True, split_groups=True), rate=2
    )
    cont.feed(_prompt(1, 6, seed=50))
    cont.step(1)
    cont.commit()  # stopped at 2 tokens of 6, continued at version 1
    cont.step(3)
    got = {}
    for name, sim in (("whole", whole), ("split", split), ("cont", cont)):
        out = sim.take()
        assert isinstance(out, Handout), name
        got[name] = [s.tokens for s in out.groups[0].samples]
    assert got["whole"] == got["split"] == got["cont"]
    assert len({tuple(t) for t in got["whole"]}) == 4
    assert cont.m.totals["continued"] == 1
    assert [s.continued_from for s in cont.handed[0].groups[0].samples] == [2, 2, 2, 2]


def test_finished_samples_of_a_partial_rollout_are_judged_by_their_own_tokens() -> None:
    """A commit stops a split group: sample 0 had made all its tokens at version 0 (its answer is
    "length", not "abort"), sample 1 is continued at version 1. At version 2 with
    ``max_staleness=1`` the group is judged from sample 0's own tokens (version 0): too stale, and
    dropped; not relabelled by the version the other sample was continued at."""
    cfg = LoopConfig(group_size=2, batch_groups=1, max_staleness=1, partial_rollout=True, split_groups=True)
    sim = Sim(cfg, rate=1)
    sim.feed(_prompt(1, 6))
    sim.do(sim.m.source_done(sim.now))
    first = sim.submits[0].key
    sim.step(2)
    sim.jobs[first].made[0] = [(t, 0) for t in range(6)]  # done, its answer not yet sent
    sim.commit()
    assert sim.m.totals["continued"] == 1
    sim.step(10)
    assert sim.m.ready == 1
    sim.commit()
    assert isinstance(sim.take(), End) and sim.m.totals["waste_groups_stale"] == 1


def test_a_batch_waits_for_a_group_a_finished_sample_pins_at_its_last_chance() -> None:
    """A split group: sample 0 stops after 4 tokens at version 0, sample 1 runs for 40. Its stop
    at the commit to 1 would gain nothing (sample 0 pins the group at 0), so version 1 is its last
    chance: the batch at 1 waits for it instead of taking a fresher group and leaving it to go
    stale at 2."""
    cfg = LoopConfig(group_size=2, batch_groups=1, max_staleness=1, partial_rollout=True, split_groups=True)
    sim = Sim(cfg, rate=4, eos={(0, 0): 4})
    sim.feed(_prompt(0, 40), _prompt(1, 4))
    sim.step(1)  # sample 0 of prompt 0 done; prompt 1 done
    first = sim.take()
    assert isinstance(first, Handout) and first.groups[0].prompt_no == 1
    sim.commit()
    sim.feed(_prompt(2, 4))
    sim.step(1)  # prompt 2 done at version 1: ready, with a later last chance than prompt 0's
    assert sim.m.totals["continued"] == 0 and isinstance(sim.take(), Wait)
    sim.step(10)
    second = sim.take()
    assert isinstance(second, Handout) and second.groups[0].prompt_no == 0 and second.groups[0].staleness == 1
    sim.commit()
    assert isinstance(sim.take(), Handout) and sim.m.totals["waste_groups_stale"] == 0


def test_a_job_that_answers_whole_before_its_stop_lands_is_waited_for() -> None:
    """Partial rollouts: the commit to 1 stops a job of version 0, but the job answers whole
    (all its tokens from its old floor: judged from 0) before the stop lands. Version 1 is its last
    chance, and the batch at 1 waits for it rather than hand out the fresher group beside it."""
    cfg = LoopConfig(group_size=1, batch_groups=1, max_staleness=1, partial_rollout=True)
    sim = Sim(cfg, rate=4, delay_cancels=True)
    sim.feed(_prompt(0, 12), _prompt(1, 4))
    sim.step(1)
    assert isinstance(sim.take(), Handout)
    sim.commit()  # prompt 0's job is stopped; the stop is on its way
    assert sim.cancels_on_the_way
    sim.feed(_prompt(2, 4))
    sim.step(1)  # prompt 2 done; prompt 0 has 8 of its 12 tokens
    assert isinstance(sim.take(), Wait)
    sim.step(1)  # prompt 0 answers whole, judged from version 0
    sim.land()  # (the stop lands on a job that has answered)
    out = sim.take()
    assert isinstance(out, Handout) and out.groups[0].prompt_no == 0 and out.groups[0].judged_version == 0
    sim.commit()
    assert isinstance(sim.take(), Handout) and sim.m.totals["waste_groups_stale"] == 0


def test_oversample_admits_nothing_beyond_the_bound() -> None:
    """``oversample=1`` with a straggler a batch overtook: no extra group is admitted for it. An
    extra admitted at version 1 beside the straggler continued at 1 and a group of 1 can complete
    with both, three groups with their last chance at 2 and two batches left to take them."""
    cfg = LoopConfig(group_size=1, batch_groups=1, max_staleness=1, partial_rollout=True, oversample=1)
    sim = Sim(cfg, rate=4)
    sim.feed(*[_prompt(i, 12 if i == 0 else 4) for i in range(6)])
    sim.step(1)
    assert isinstance(sim.take(), Handout)  # prompt 1; prompt 0 is overtaken
    sim.commit()  # prompt 0 continued at 1
    assert sim.m.in_flight + sim.m.ready == 2
    sim.step(2)
    for _ in range(3):
        assert isinstance(sim.take(), Handout)
        sim.commit()
        sim.step(1)
    assert sim.m.totals["waste_groups_stale"] == 0


def test_the_grace_of_a_version_no_replica_serves_stops_nothing() -> None:
    """Partial rollouts; version 1 committed but no replica takes it. After the grace new groups
    run at version 0 again, and a running job is never stopped to go on at the same version."""
    cfg = LoopConfig(group_size=1, batch_groups=1, max_staleness=1, partial_rollout=True, activation_grace_s=0.3)
    sim = Sim(cfg, rate=1)
    sim.feed(_prompt(1, 40))
    sim.step(2)
    sim.commit(fresh=False)
    sim.feed(_prompt(2, 40))
    assert len(sim.submits) == 1  # the second waits for the grace
    sim.step(30)
    assert sim.cancelled == [] and sim.m.totals["continued"] == 0
    assert len(sim.submits) == 2 and sim.submits[1].max_staleness == 1  # after the grace: at version 0
    sim.commit()  # version 2, served: both go on at 2
    assert len(sim.cancelled) == 2


def test_a_source_error_is_raised_once_and_the_groups_are_kept() -> None:
    sim = Sim(LoopConfig(group_size=1, batch_groups=2, max_staleness=3))
    sim.feed(_prompt(1))
    sim.do(sim.m.source_failed(sim.now, ValueError("broken")))
    decision = sim.take()
    assert isinstance(decision, Raise) and str(decision.error) == "broken"
    assert isinstance(sim.take(), Wait)
    sim.step(3)
    out = sim.take()
    assert isinstance(out, Handout) and len(out.groups) == 1
    assert isinstance(sim.take(), End)


def test_failures_after_the_last_group_come_in_a_last_batch() -> None:
    sim = Sim(LoopConfig(group_size=1, batch_groups=1, max_staleness=3, on_failure="report"))
    sim.feed(_prompt(1))
    sim.do(sim.m.source_done(sim.now))
    sim.fail(sim.submits[0].key)
    last = sim.take()
    assert isinstance(last, Handout) and last.groups == [] and [f.prompt for f in last.failed] == [_prompt(1)]
    assert isinstance(sim.take(), End)


def test_a_trainer_taking_batches_without_committing_is_never_blocked() -> None:
    """``max_staleness=0`` and ten batches at version 0: each ask of the trainer frees room (the
    next batch is at this version after all), and each batch comes."""
    sim = Sim(LoopConfig(group_size=1, batch_groups=1, max_staleness=0))
    sim.feed(*[_prompt(i) for i in range(10)])
    for i in range(10):
        for _ in range(5):
            if isinstance(sim.take(), Handout):
                break
            sim.step(1)
        else:
            raise AssertionError(f"batch {i} never came")
    assert sim.m.totals["waste_groups_stale"] == 0


def test_a_group_past_its_deadline_is_failed_with_every_round_counted() -> None:
    cfg = LoopConfig(group_size=2, batch_groups=1, max_staleness=0, partial_rollout=True, group_deadline_s=1.0,
                     on_failure="report")  # fmt: skip
    sim = Sim(cfg, rate=1)
    sim.feed(_prompt(1, 100))
    sim.step(3)
    sim.commit()  # continued: its first round's tokens are in its prefixes
    sim.step(9)
    t = sim.m.totals
    assert t["waste_groups_deadline"] == 1 and t["waste_tokens_deadline"] == sim.made_total > 6
    assert [f.reason for f in sim.m.failed] == ["cancelled (deadline)"]


def test_a_restarted_machine_asks_for_the_same_jobs() -> None:
    def run() -> list[str]:
        sim = Sim(
            LoopConfig(group_size=2, batch_groups=1, max_staleness=1, partial_rollout=True, split_groups=True), rate=1
        )
        sim.feed(_prompt(1, 5), _prompt(2, 5))
        sim.step(2)
        sim.commit()
        sim.step(10)
        return [s.key for s in sim.submits]

    assert run() == run()


def test_keys_of_prompts_not_yet_read_are_not_taken_as_orphans() -> None:
    sim = Sim(LoopConfig(group_size=1, batch_groups=1, max_staleness=1, loop_id="sim"))
    later = rules.job_key("sim", 5, 1, 0, (0,), 0)
    assert not sim.m.owns(later) and not sim.m.owns("foreign")
    sim.feed(_prompt(1))
    live = sim.submits[0].key
    assert not sim.m.owns(live) and not sim.m.owns(rules.job_key("sim", 0, 1, 1, (0,), 0))  # its group may ask
    assert sim.m.owns(rules.job_key("sim", 0, 0, 0, (0,), 0))  # an attempt that is over
    sim.do(sim.m.close(sim.now))
    assert sim.m.owns(later)
    sim.do(sim.m.orphan(later, _result([Completion(token_ids=[1, 2], finish_reason="length")], 0, 0)))
    assert sim.m.totals["waste_tokens_orphaned"] == 2


# -- properties over random sequences -----------------------------------------------------------------

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("prompt"), st.integers(1, 40), st.sampled_from([None, 7])),
        st.tuples(st.just("step"), st.integers(1, 5)),
        st.tuples(st.just("commit"), st.booleans()),
        st.tuples(st.just("take")),
        st.tuples(st.just("fail"), st.integers(0, 50)),
        st.tuples(st.just("orphan"), st.integers(0, 30)),
        st.tuples(st.just("dry")),
    ),
    max_size=60,
)
_CONFIGS = st.builds(
    LoopConfig,
    group_size=st.integers(1, 3),
    batch_groups=st.integers(1, 3),
    max_staleness=st.integers(0, 2),
    split_groups=st.booleans(),
    stale=st.sampled_from(["drop", "requeue", "keep"]),
    on_failure=st.sampled_from(["requeue", "report"]),
    oversample=st.integers(0, 2),
    group_deadline_s=st.sampled_from([None, 0.5, 3.0]),
    dynamic_sampling=st.booleans(),
    partial_rollout=st.booleans(),
    max_in_flight=st.sampled_from([None, 1, 4]),
    activation_grace_s=st.sampled_from([0.0, 0.3]),
    loop_id=st.just("sim"),
)


@settings(max_examples=400, deadline=None)
@given(cfg=_CONFIGS, ops=_OPS, scored=st.booleans(), rate=st.integers(1, 6))
def test_every_token_is_trained_held_or_waste_and_nothing_stale_is_handed_out(
    cfg: LoopConfig, ops: list[tuple[Any, ...]], scored: bool, rate: int
) -> None:
    """Any sequence of prompts, ticks, commits (served or not), takes, job failures, orphaned answers
    and a dry source, then close: at every step the tokens received are trained + held + waste and
    admission is within its bound (``Sim.check``); every group handed out is within
    ``max_staleness`` by the rule unless ``stale="keep"``; at the end nothing is held and every
    token the fleet made was received."""
    sim = Sim(cfg, rate=rate, scored=scored)
    prompts = 0
    for op in ops:
        if op[0] == "prompt":
            sim.feed(_prompt(prompts, op[1], op[2]))
            prompts += 1
        elif op[0] == "step":
            sim.step(op[1])
        elif op[0] == "commit":
            sim.commit(op[1])
        elif op[0] == "take":
            out = sim.take()
            if isinstance(out, Handout):
                for g in out.groups:
                    assert g.staleness == rules.staleness(out.version, [g.judged_version])
                    assert cfg.stale == "keep" or g.staleness <= cfg.max_staleness
                    assert all(s.judged_version == rules.judged_version(s.spans, s.continued_from, s.judged_version)
                               for s in g.samples)  # fmt: skip
                    assert len(g.samples) == cfg.group_size and all(s.spans or not s.tokens for s in g.samples)
        elif op[0] == "fail" and sim.jobs:
            sim.fail(sorted(sim.jobs)[op[1] % len(sim.jobs)])
        elif op[0] == "orphan":
            key = rules.job_key("sim", op[1], 1, 9, (0,), 0)
            if sim.m.owns(key):
                sim.do(sim.m.orphan(key, _result([Completion(token_ids=[1], finish_reason="length")], 0, 0)))
                sim.made_total += 1
        elif op[0] == "dry":
            sim.do(sim.m.source_done(sim.now))
    sim.do(sim.m.close(sim.now))
    assert not sim.jobs  # every job was cancelled, and answered that
    assert sim.m.held_tokens == 0 and sim.m.in_flight == 0 and sim.m.ready == 0
    assert sim.m.totals["generated_tokens"] == sim.made_total
    sim.check()


_LENGTHS = st.lists(st.sampled_from([8] * 7 + [32] * 2 + [128]), min_size=4, max_size=40)


@settings(max_examples=150, deadline=None)
@given(lengths=_LENGTHS, eta=st.integers(1, 2), oversample=st.integers(0, 2), batch=st.integers(1, 3))
def test_long_prompts_are_never_starved_and_nothing_is_thrown_away(
    lengths: list[int], eta: int, oversample: int, batch: int
) -> None:
    """A long-tailed source, partial rollouts, tails refreshed, stale groups re-queued; the trainer
    takes a batch whenever it can and commits a version after each (served at once). Every prompt
    is trained on whole, once, and no token is thrown away."""
    cfg = LoopConfig(
        group_size=2,
        batch_groups=batch,
        max_staleness=eta,
        partial_rollout=True,
        oversample=oversample,
        stale="requeue",
    )
    sim = Sim(cfg, rate=4)
    sim.feed(*[_prompt(i, n) for i, n in enumerate(lengths)])
    sim.do(sim.m.source_done(sim.now))
    for _ in range(2_000):
        out = sim.take()
        if isinstance(out, End):
            break
        if isinstance(out, Handout):
            sim.commit()
        sim.step()
    trained = Counter(g.prompt.prompt_token_ids[0] for h in sim.handed for g in h.groups)
    assert trained == Counter(range(len(lengths)))
    assert all(len(s.tokens) == g.payload.sampling.max_tokens for h in sim.handed for g in h.groups for s in g.samples)
    wasted = {k: v for k, v in sim.m.totals.items() if k.startswith("waste_tokens_") and v}
    assert not wasted, dict(sim.m.totals)
    assert sim.m.totals["tokens"] + sum(wasted.values()) == sim.made_total


def test_an_answer_delivered_again_is_not_counted_twice() -> None:
    """A restarted loop may get its predecessor's answer twice (found stored, then delivered): the
    same job's answer under a key it used counts once; another job's answer under it is new tokens."""
    sim = Sim(LoopConfig(group_size=1, batch_groups=1, max_staleness=1, loop_id="sim"))
    sim.feed(_prompt(1, 4))
    key = sim.submits[0].key
    answer = _result([Completion(token_ids=[1, 2, 3, 4], finish_reason="length")], 0, 0, key)
    sim.jobs.pop(key)
    sim.do(sim.m.answered(sim.now, key, answer))
    assert sim.m.owns(key)  # (its group is complete: nothing will ask for it again)
    sim.do(sim.m.orphan(key, answer))
    assert sim.m.totals["generated_tokens"] == 4 and sim.m.totals["waste_tokens_orphaned"] == 0
    other = _result([Completion(token_ids=[9], finish_reason="length")], 0, 0, key)
    other.job_id = "another"
    sim.do(sim.m.orphan(key, other))
    assert sim.m.totals["generated_tokens"] == 5 and sim.m.totals["waste_tokens_orphaned"] == 1


_TRAINER = st.lists(
    st.one_of(
        st.tuples(st.just("prompt"), st.sampled_from([4, 8, 8, 8, 32, 128]), st.integers(0, 2**16)),
        st.tuples(st.just("step"), st.integers(1, 6), st.integers(0, 2**16)),
        st.tuples(st.just("take")),
        st.tuples(st.just("commit")),
        st.tuples(st.just("land")),
    ),
    min_size=30,
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=_TRAINER,
    group_size=st.integers(1, 4),
    batch=st.integers(1, 3),
    eta=st.integers(0, 3),
    oversample=st.integers(0, 2),
    split=st.booleans(),
    scored=st.booleans(),
    max_in_flight=st.sampled_from([None, 2, 5]),
)
def test_with_partial_rollouts_nothing_goes_stale_when_the_trainer_commits_once_a_batch(
    ops: list[tuple[Any, ...]],
    group_size: int,
    batch: int,
    eta: int,
    oversample: int,
    split: bool,
    scored: bool,
    max_in_flight: int | None,
) -> None:
    """Partial rollouts, a fleet serving each version as it is committed, and a trainer that
    commits one version per batch it takes (and takes the next only after). Jobs finish in any
    order (each makes its tokens of a tick or not, at random), samples of a group stop at lengths
    of their own (split or not: a finished sample pins its group), cancels land late (a job may
    answer on its own after the commit that stopped it), oversample on or off: no group is ever
    dropped as too stale, and once the source runs dry every prompt is trained on, once, with
    every token generated for it (nothing wasted, no long prompt starved)."""
    cfg = LoopConfig(
        group_size=group_size,
        batch_groups=batch,
        max_staleness=eta,
        partial_rollout=True,
        oversample=oversample,
        split_groups=split,
        max_in_flight=max_in_flight,
        loop_id="sim",
    )
    eos: dict[tuple[int, int], int] = {}
    sim = Sim(cfg, rate=4, scored=scored, eos=eos, delay_cancels=True)
    training = False  # a batch taken, its version not yet committed
    fed = 0

    def trainer_takes() -> Any:
        nonlocal training
        out = sim.take()
        if isinstance(out, Handout):
            training = True
        return out

    def trainer_commits() -> None:
        nonlocal training
        sim.commit()
        training = False

    for op in ops:
        if op[0] == "prompt":
            lengths = random.Random(op[2])
            for i in range(group_size):
                eos[fed, i] = lengths.choice([op[1], op[1], max(1, op[1] // 4), max(1, op[1] // 2)])
            sim.feed(_prompt(fed, op[1]))
            fed += 1
        elif op[0] == "step":
            sim.step(op[1], stalls=random.Random(op[2]))
        elif op[0] == "take" and not training:
            trainer_takes()
        elif op[0] == "commit" and training:
            trainer_commits()
        elif op[0] == "land":
            sim.land()
        assert sim.m.totals["waste_groups_stale"] == 0, dict(sim.m.totals)
    sim.do(sim.m.source_done(sim.now))
    for _ in range(5_000):
        sim.land()
        if training:
            trainer_commits()
        if isinstance(trainer_takes(), End):
            break
        sim.step()
        assert sim.m.totals["waste_groups_stale"] == 0, dict(sim.m.totals)
    else:
        raise AssertionError("the loop never ended")
    trained = Counter(g.prompt.prompt_token_ids[0] for h in sim.handed for g in h.groups)
    assert trained == Counter(range(fed))
    wasted = {k: v for k, v in sim.m.totals.items() if k.startswith("waste_") and v}
    assert not wasted and sim.m.totals["tokens"] == sim.made_total, dict(sim.m.totals)
