"""The rollout loop's decisions: a state machine fed events, returning actions.

Everything that decides what the rollout loop does lives in this file and the ``loop_*`` modules
it draws on (below), and nothing in them awaits, reads a clock or touches the client: time
(``now``), the trainer's version and whether a replica serves it are arguments. ``loop.py``
(``RolloutLoop``) is the driver: it reads the prompt source, carries out the actions (submit,
cancel, score), and feeds back what happened (a prompt arrived, a job answered or failed, a
version was seen, a timer ticked, the trainer took a batch, close).
``tests/test_loop_machine.py`` drives it as sequences of events.

Where each part lives (the rules and types are re-exported here, so ``loop_machine.X`` finds them):
``loop_types`` (what crosses the boundary: samples, groups, actions, ``take``'s decisions),
``loop_config`` (``LoopConfig``), ``loop_prompts`` (rule 1; rule 5's ``owns``; rule 10:
``PromptBook``), ``loop_admission`` (rules 2 and 3: ``Admission``), ``loop_samples`` (rules 4 and
6), ``loop_keys`` (rule 5), ``loop_groups`` (a group in flight and its jobs: ``GroupInFlight``,
``InFlight``), ``loop_continuations`` (an answer's samples, finished or going on),
``loop_refresh`` (rule 7), ``loop_consume`` (rules 6 and 8 at consume time), ``loop_failures``
(rule 9: ``FailureLog``) and ``loop_ledger`` (rule 11: ``TokenLedger``). This file holds the
machine, which owns their state and carries each event through them, and the rules too small for
a file of their own (deadlines, rewards, utilization).

The rules (each written once, in the function or method named):

1. **Prompts** (``prompt_payload``). The source's items are numbered as they arrive. An item is a
   list of token ids, a text, or a ``RolloutPayload``; an empty prompt or anything else is reported
   failed at once (``InvalidRequest``) and never submitted. The source is read only while
   admission has room for what it gives, by a task of the driver's own: nothing waits on it.
2. **Admission** (``admission_room``, AReaL's bound counted in batches): groups admitted and not
   complete plus groups complete and not yet handed out never exceed ``(max_staleness + 1) *
   batch_groups`` while the next batch will be judged at the latest version (the trainer asks for
   it, or has taken none since the last commit), and ``max_staleness * batch_groups`` while the
   trainer trains on a batch of the latest version (it may commit before it asks again). So a
   group admitted now is handed out within ``max_staleness`` commits, as AReaL's ``(steps +
   max_staleness + 1) * batch_groups`` less what was accepted keeps it when the trainer commits once
   a batch; a trainer taking several batches per version is never blocked (each ask frees room).
   Nothing is admitted beyond the bound, ``oversample`` or not: every group held may complete at
   once, and with one group more than the batches left before its last chance can take, one
   would go stale. ``max_in_flight`` caps the groups in flight.
3. **Floors** (``submit_floor``). New jobs ask for the trainer's latest version once a replica is
   at or preparing it; until then admission waits, for at most ``activation_grace_s``, then asks
   ``max_staleness`` below it. The request is written ``max_staleness=latest - floor``, so its
   fingerprint does not move with the version: a restarted loop asks the same request.
4. **Pieces and seeds** (``first_pieces``, ``continuation``). A group is one job of ``group_size``
   samples, or (``split_groups``) ``group_size`` jobs of one; a continuation is a job of one
   sample. Sample ``i`` of a group seeded ``s`` draws ``sample_seed(s, i)`` however it is sent:
   the whole group's job is seeded ``s``, a job of sample ``i`` alone ``sample_seed(s, i)``.
5. **Keys** (``job_key``). A job's idempotency key is a function of the loop's id, the prompt's
   number, its attempt, the piece's round and samples, and its floor's distance below latest: a
   loop restarted with the same client id, loop id and prompts asks for the same jobs, and the
   client hands it its predecessor's jobs and stored answers instead of running them again.
6. **Staleness, as the tokens make it** (``judged_version``, ``staleness``). A sample is judged by
   the oldest version that made any token of its last run: every token of a sample never
   continued (or that had finished before a stop), the tokens made since its last continuation
   for a continued one (its earlier tokens are the context the newer policy was conditioned on;
   their spans keep their versions, to mask or weight). Zero-width spans never count. A group is
   judged by its oldest-judged sample; at consume time its staleness is the trainer's version
   minus that, and past ``max_staleness`` the ``stale`` policy decides.
7. **Refresh: partial rollouts and tails** (``must_refresh``, ``tails``). A running job is stopped
   and its samples continued from their tokens so far, at a fresher floor: with
   ``partial_rollout``, once a commit puts it at risk (``at_risk``: two batches at most could still
   take it); a tail (a group a whole batch of later-admitted groups overtook, or at risk; at most
   ``oversample`` a batch, oldest first) when a batch is handed out; a group a batch waits for
   (rule 8). Only when the floor it would go on at is fresher than its own (a fleet with no
   replica at latest has nothing stopped, and nothing is stopped twice for one version), not once
   a finished sample of its group pins the group's judged version at or below its own, and only
   for prompts given as token ids. Nothing is thrown
   away: a sample that had finished is kept, a stopped job that made nothing is asked again whole,
   an aborted sample goes on from its tokens. A long prompt is never restarted, so never starved.
8. **Consume** (``next_to_consume``, ``wait_for_in_flight``). The ready group judged from the
   oldest version goes first (earliest last chance first). A batch has ``batch_groups`` groups; a
   short one only when nothing more can come; and when failures were reported after the last
   group, a last batch with no groups carries them (a run in which every group failed does not
   end as a dry source does). A batch waits for a group still in flight whose last chance it is
   (counted as the oldest version the group can still be judged from: a finished sample's, a
   job's floor, which a stop not yet landed leaves as it is) where taking the ready groups instead
   would leave more groups than the batches before their last chance can take; such a group is
   first continued at the fresh floor where rule 7 may stop it (``partial_rollout`` or
   ``oversample``), so the trainer waits only for what cannot be continued: a group a finished
   sample pins, or a job whose stop has not landed. (``stale="keep"``: no wait.)

   Why nothing goes stale, when the trainer commits one version per batch and the fleet serves
   each version as it is committed (``tests/test_loop_machine.py`` checks it as a property): a
   group's last chance is the version it is judged from plus ``max_staleness``, and it is never
   earlier than the floor of a job of its plus ``max_staleness`` (tokens are made at the floor or
   newer; a continued sample is judged by its last run). At each ask at version ``v``, at most
   ``(k + 1) * batch_groups`` groups held have a last chance at or before ``v + k``: admission
   keeps it for ``v + max_staleness`` (rule 2, every group held has its last chance by then), a
   stop only moves a last chance later, and each batch, by the wait above, leaves at most ``k *
   batch_groups`` of them for the batches after it. So no group is past its last chance when a
   batch is made. What can still go stale: groups of a trainer whose version moves more than once
   a batch, and groups asked for below the latest version after the fresh version's grace (rule 3)
   while the next batch is already at a newer one.
9. **Failures** (``on_failure``, ``check_rewards``). A job that fails fails its group whole: its
   other jobs are cancelled and, once every one has answered, the prompt goes back
   (``on_failure="requeue"``, until ``max_attempts``) or is reported. A group past
   ``group_deadline_s`` is stopped and failed alike. Rewards that are not finite numbers, one per
   sample, fail the group. Dynamic sampling drops a group whose rewards are all equal.
10. **A source that raises.** The next ``take`` raises its error, once, whether or not groups are
    in flight; every group ready or in flight is kept and handed over by the calls after it, as
    after a source that ran dry.
11. **Accounting** (``LoopMachine.totals``). Every token of every answer the loop receives
    (``generated_tokens``) is at every moment exactly one of: trained (``tokens``), held (in a
    group in flight, being scored or ready: ``held_tokens``), or waste with a cause
    (``waste_tokens_<cause>``): ``stale``, ``filtered``, ``failed`` and ``deadline`` (every round
    of the group), ``closed`` (in flight at close), ``unused`` (complete at close), ``orphaned``
    (an answer under the loop's keys no group waits for: a predecessor's job it will not ask for
    again, a job answered after its cancel gave up).
12. **Close.** Nothing more is admitted; every job is cancelled; complete groups are ``unused``,
    groups in flight ``closed`` once their jobs have answered.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollfleet.schemas import RolloutResult
from rollfleet.schemas.errors import Cancelled, InvalidRequest
from rollfleet.trainer_client.loop_admission import Admission, admission_room, submit_floor
from rollfleet.trainer_client.loop_config import LoopConfig, is_number
from rollfleet.trainer_client.loop_consume import (
    judge_ready,
    must_wait_for,
    next_to_consume,
    on_stale,
    pick_batch,
    stale_note,
    staleness,
    too_stale,
    wait_for_in_flight,
)
from rollfleet.trainer_client.loop_continuations import take_outputs
from rollfleet.trainer_client.loop_failures import FailureLog, failure_note, failure_reason, on_failure, stop_jobs
from rollfleet.trainer_client.loop_groups import GroupInFlight, InFlight
from rollfleet.trainer_client.loop_keys import job_key, key_owner
from rollfleet.trainer_client.loop_ledger import TokenLedger
from rollfleet.trainer_client.loop_prompts import PromptBook, prompt_payload
from rollfleet.trainer_client.loop_refresh import at_risk, batch_tails, must_refresh, refresh_stops, tails
from rollfleet.trainer_client.loop_samples import (
    continuable,
    continuation,
    first_pieces,
    judged_version,
    result_tokens,
    run_sample,
)
from rollfleet.trainer_client.loop_types import (
    WASTE_CAUSES,
    Action,
    Cancel,
    Decision,
    End,
    FailedGroup,
    FailurePolicy,
    Group,
    Handout,
    Note,
    Raise,
    Sample,
    SampleRun,
    Score,
    StalePolicy,
    StopCause,
    Submit,
    Wait,
    WasteCause,
    Wasted,
)

__all__ = [
    "WASTE_CAUSES", "Action", "Cancel", "Decision", "End", "FailedGroup", "FailurePolicy", "Group", "Handout",
    "LoopConfig", "LoopMachine", "Note", "Raise", "Sample", "SampleRun", "Score", "StalePolicy", "StopCause",
    "Submit", "Wait", "WasteCause", "Wasted", "admission_room", "at_risk", "check_rewards", "continuable",
    "continuation", "first_pieces", "job_key", "judged_version", "key_owner", "must_refresh", "next_to_consume",
    "on_failure", "on_stale", "past_deadline", "prompt_payload", "result_tokens", "run_sample", "staleness",
    "submit_floor", "tails", "too_stale", "uninformative", "utilization", "wait_for_in_flight",
]  # fmt: skip

# -- the rules, as functions ------------------------------------------------------------------------


def past_deadline(admitted_at: float, now: float, deadline_s: float | None) -> bool:
    return deadline_s is not None and now - admitted_at > deadline_s


def uninformative(rewards: Sequence[float], tol: float = 1e-12) -> bool:
    """Dynamic sampling's filter: every sample of the group scored the same (no advantage)."""
    return len(rewards) > 0 and max(rewards) - min(rewards) <= tol


def check_rewards(rewards: Sequence[Any], samples: int) -> str | None:
    """Why ``rewards`` cannot be used for a group of ``samples`` samples (None: they can): one
    finite number per sample."""
    if len(rewards) != samples:
        return f"reward gave {len(rewards)} values for {samples} samples"
    for i, r in enumerate(rewards):
        if not is_number(r) or not math.isfinite(r):
            return f"reward of sample {i} is {r!r}, not a finite number"
    return None


def utilization(busy: Sequence[int], capacity: Sequence[int]) -> float | None:
    """Busy fraction of the fleet's slots (None when the fleet has none)."""
    total = sum(capacity)
    return min(1.0, sum(busy) / total) if total > 0 else None


class LoopMachine:
    """The loop's state; each event method returns the actions it decides (see the module's rules)."""

    def __init__(self, config: LoopConfig, *, loop_id: str, first_version: int, scored: bool = False) -> None:
        """``scored``: complete groups are scored (a ``Score`` action) before they are ready."""
        self.config = config
        self.scored_groups = scored
        self.loop_id = loop_id
        self.first_version = first_version
        self.admission = Admission(config, first_version)
        self.prompts = PromptBook()
        self.flight = InFlight(loop_id)
        self._ready: list[Group] = []
        self.closed = False
        self._step = 0
        self.ledger = TokenLedger()
        self.totals = self.ledger.totals  # (rule 11; the ledger's own counter, never replaced)
        self.failures = FailureLog(self.totals)
        self.failed = self.failures.failed  # (the log's own list, never replaced)

    # -- what the driver reads -------------------------------------------------------------------
    @property
    def latest(self) -> int:
        """The trainer's latest version, as last seen."""
        return self.admission.latest

    @property
    def fresh(self) -> bool:
        """Whether a replica is at or preparing ``latest``, as last seen."""
        return self.admission.fresh

    @property
    def in_flight(self) -> int:
        """Groups admitted and not yet complete (generating, stopping, or being scored)."""
        return len(self.flight.groups)

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def held_tokens(self) -> int:
        """Tokens generated for groups not yet trained on nor wasted (rule 11)."""
        return sum(g.generated for g in self.flight.groups.values()) + sum(g.tokens for g in self._ready)

    def room(self) -> int:
        return self.admission.room(ready=len(self._ready), in_flight=len(self.flight.groups))

    def wants_prompts(self) -> int:
        """How many more items the source may be read for now (never more than there is room)."""
        if self.closed or self.prompts.source != "open":
            return 0
        return max(0, self.room() - len(self.prompts.pending))

    def owns(self, key: str) -> bool:
        """Whether an answer under ``key`` that no job of this loop waits for is this loop's to
        count as orphaned now: a key of this loop (rule 5) whose prompt was read and is past the
        attempt it names (a group of that attempt will never ask for it), or any of its keys once
        closed. A key of a prompt not yet read may still be asked (a restarted loop reclaims it)."""
        return self.prompts.owns(key, self.loop_id, self.closed, self.flight)

    # -- events ----------------------------------------------------------------------------------
    def version_seen(self, now: float, latest: int, fresh_served: bool) -> list[Action]:
        """The trainer's latest version, and whether a replica is at or preparing it."""
        self.admission.version_seen(now, latest, fresh_served)
        return self._decide(now)

    def tick(self, now: float) -> list[Action]:
        """Time passed: deadlines, refreshes, admission."""
        return self._decide(now)

    def prompt(self, now: float, item: Any) -> list[Action]:
        """The source gave ``item``."""
        no = self.prompts.number()
        payload = prompt_payload(item, self.config)
        if isinstance(payload, InvalidRequest):
            self.failures.report(FailedGroup(item, f"InvalidRequest: {payload.message}", 0, payload))
            return [Note("loop_prompt_refused", {"prompt_no": no, "reason": payload.message})]
        self.prompts.add(no, item, payload)
        return self._decide(now)

    def source_done(self, now: float) -> list[Action]:
        self.prompts.source = "dry"
        return self._decide(now)

    def source_failed(self, now: float, error: BaseException) -> list[Action]:
        self.prompts.source, self.prompts.source_error = "failed", error
        return [Note("loop_source_failed", {"error": f"{type(error).__name__}: {error}"}), *self._decide(now)]

    def submitted(self, key: str, floor: int) -> None:
        """The job under ``key`` is stored (or was found stored) asking for ``floor``."""
        piece = self.flight.pieces.get(key)
        if piece is not None:
            piece.floor = floor

    def answered(self, now: float, key: str, result: RolloutResult) -> list[Action]:
        settled = self.flight.settle(key)
        if settled is None:  # nobody here waits for it
            return self.orphan(key, result)
        piece, g = settled
        g.generated += self.ledger.answered(key, result)
        g.results.append(result)
        if g.stop is not None:
            return self._settle_stopped(now, g)
        going_on, error = take_outputs(g, piece, result, self.admission.floor(now))
        asks: list[Action] = [
            self.flight.ask(g, (c.index,), piece.round + 1, c.payload, c.floor, self.latest) for c in going_on
        ]
        if error is not None:
            g.error = error
            return self._stop_group(now, g, "failed")
        return [*asks, *self._maybe_complete(now, g)]

    def job_failed(self, now: float, key: str, error: BaseException) -> list[Action]:
        settled = self.flight.settle(key)
        if settled is None:
            return []
        piece, g = settled
        if g.stop is not None:
            return self._settle_stopped(now, g)
        if piece.stopping == "refresh" and isinstance(error, Cancelled):
            # Stopped before it made anything: the same samples asked again, at the fresher floor.
            return [self.flight.ask(g, piece.indices, piece.round + 1, piece.payload, piece.refresh_floor, self.latest)]
        g.error = error
        return self._stop_group(now, g, "failed")

    def scored(self, now: float, group_no: int, rewards: Sequence[Any]) -> list[Action]:
        g = self.flight.groups.get(group_no)
        if g is None or g.scoring is None or g.stop is not None:
            return []
        why = check_rewards(rewards, len(g.scoring.samples))
        if why is not None:
            return self.score_failed(now, group_no, InvalidRequest(why))
        group = g.scoring
        group.samples = [_rewarded(s, float(r)) for s, r in zip(group.samples, rewards, strict=True)]
        return self._accept(now, g, group)

    def score_failed(self, now: float, group_no: int, error: BaseException) -> list[Action]:
        g = self.flight.groups.get(group_no)
        if g is None or g.scoring is None or g.stop is not None:
            return []
        g.scoring, g.error = None, error
        return self._stop_group(now, g, "failed")

    def orphan(self, key: str, outcome: Any) -> list[Action]:
        """An answer under this loop's key that no job waits for (``owns(key)`` said so); the very
        answer it already received for the key is no new token (``TokenLedger.orphaned``)."""
        tokens, repeated = self.ledger.orphaned(key, outcome)
        if repeated:
            return [Note("loop_answer_repeated", {"key": key, "tokens": tokens})]
        return [self.ledger.waste(tokens, "orphaned", groups=0), Note("loop_orphan", {"key": key, "tokens": tokens})]

    def take(self, now: float) -> tuple[Decision, list[Action]]:
        """The trainer asks for its next batch, at version ``self.latest``."""
        error = self.prompts.error_to_raise()
        if error is not None:
            return Raise(error), []
        if self.closed:
            return End(), []
        cfg, groups = self.config, self.flight.groups
        self.admission.next_at_latest = True  # it asks at this version (rule 2)
        actions = self._judge_ready(now)
        more = self.prompts.source == "open" or bool(self.prompts.pending) or bool(groups)
        if len(self._ready) < cfg.batch_groups and more:
            return Wait(), actions
        if not self._ready and not self.failures.since:
            return End(), actions
        if cfg.stale != "keep":
            waited = must_wait_for(self._ready, groups.values(), self.latest, cfg.max_staleness, cfg.batch_groups)
            if waited is not None:
                if cfg.partial_rollout or cfg.oversample:  # (rule 7: it goes on at the fresh floor)
                    actions += self._refresh(now, waited)
                return Wait(), actions
        taken = pick_batch(self._ready, cfg.batch_groups)
        for g in taken:
            self.prompts.resolve(g.prompt_no)
        self._step += 1
        self.admission.next_at_latest = False
        waste_tokens, waste_groups = self.ledger.handed_out(taken)
        staleness_counts = dict(sorted(Counter(g.staleness for g in taken).items()))
        failed = self.failures.handed_out()
        out = Handout(self._step, self.latest, taken, failed, waste_tokens, waste_groups, staleness_counts)
        admitted = [g.admitted for g in taken]
        tail = batch_tails(groups.values(), admitted, self.latest, cfg.max_staleness, cfg.oversample)
        actions += self._refresh(now, tail)
        actions += self._admit(now)
        return out, actions

    def close(self, now: float) -> list[Action]:
        """Admit nothing more; cancel every job (rule 12)."""
        if self.closed:
            return []
        self.closed = True
        self.prompts.pending.clear()
        actions: list[Action] = [self.ledger.waste(group.tokens, "unused") for group in self._ready]
        self._ready.clear()
        for g in list(self.flight.groups.values()):
            if g.scoring is not None:
                del self.flight.groups[g.no]
                actions.append(self.ledger.waste(g.generated, "unused"))
            elif g.stop is None:
                actions += self._stop_group(now, g, "closed")
        self.prompts.unresolved.clear()
        return actions

    # -- decisions -------------------------------------------------------------------------------
    def _decide(self, now: float) -> list[Action]:
        if self.closed:
            return []
        actions: list[Action] = []
        for g in list(self.flight.groups.values()):
            if g.running and past_deadline(g.admitted_at, now, self.config.group_deadline_s):
                g.error = Cancelled("past the group's deadline")
                actions += self._stop_group(now, g, "deadline")
        if self.config.partial_rollout:
            actions += self._refresh(now, set())
        return actions + self._admit(now)

    def _admit(self, now: float) -> list[Action]:
        cfg = self.config
        floor = self.admission.floor(now)
        actions: list[Action] = []
        while not self.closed and self.prompts.pending and floor is not None and self.room() > 0:
            p = self.prompts.pending.popleft()
            p.attempts += 1
            g = self.flight.admit(p, now, cfg.group_size)
            self.totals["admitted"] += 1
            for indices, payload in first_pieces(p.payload, cfg.group_size, cfg.split_groups):
                actions.append(self.flight.ask(g, indices, 0, payload, floor, self.latest))
        return actions

    def _refresh(self, now: float, tail: set[int]) -> list[Action]:
        """Rule 7, for every running group (partial rollouts) and the tails given."""
        fresh_floor = self.admission.floor(now)
        if fresh_floor is None:
            return []
        cfg = self.config
        cancels, continued = refresh_stops(
            self.flight.groups.values(), tail, fresh_floor, self.latest, cfg.max_staleness, cfg.partial_rollout
        )
        if continued:
            self.totals["continued"] += continued
        return list(cancels)

    def _judge_ready(self, now: float) -> list[Action]:
        """Rule 6 at consume time, for every ready group at the trainer's version."""
        cfg = self.config
        actions: list[Action] = []
        self._ready, too_stale_groups = judge_ready(self._ready, self.latest, cfg.max_staleness, cfg.stale)
        for group in too_stale_groups:
            action = on_stale(cfg.stale)
            actions += [self.ledger.waste(group.tokens, "stale"), stale_note(group, self.latest, action)]
            if self.prompts.requeue_or_resolve(group.prompt_no, action == "requeue"):
                self.totals["requeued"] += 1
        return actions + self._admit(now)

    def _maybe_complete(self, now: float, g: GroupInFlight) -> list[Action]:
        group = g.complete()
        if group is None:
            return []
        if self.scored_groups:
            g.scoring = group
            return [Score(g.no, group)]
        return self._accept(now, g, group)

    def _accept(self, now: float, g: GroupInFlight, group: Group) -> list[Action]:
        del self.flight.groups[g.no]
        if self.config.dynamic_sampling and uninformative(group.rewards):
            self.prompts.resolve(g.prompt.no)
            return [self.ledger.waste(g.generated, "filtered"), *self._admit(now)]
        self.totals["completed"] += 1
        self._ready.append(group)
        return self._admit(now)

    def _stop_group(self, now: float, g: GroupInFlight, cause: StopCause) -> list[Action]:
        """Stop the whole group for ``cause`` (``stop_jobs``); settled once every job has answered."""
        return [*stop_jobs(g, cause), *self._settle_stopped(now, g)]

    def _settle_stopped(self, now: float, g: GroupInFlight) -> list[Action]:
        if g.pieces:
            return []  # (every job answers: a cancel settles it)
        cause = g.stop
        assert cause is not None
        del self.flight.groups[g.no]
        actions: list[Action] = [self.ledger.waste(g.generated, cause)]
        verdict = on_failure(self.config.on_failure, cause, g.prompt.attempts, self.config.max_attempts)
        if verdict == "forget":
            return actions
        reason = failure_reason(cause, g.error)
        actions.append(failure_note(g, cause, reason, verdict))
        if verdict == "requeue" and not self.closed:
            self.prompts.requeue(g.prompt)
            self.totals["requeued"] += 1
        else:
            self.prompts.resolve(g.prompt.no)
            self.failures.report(FailedGroup(g.prompt.item, reason, g.prompt.attempts, g.error))
        return actions + self._admit(now)


def _rewarded(s: Sample, reward: float) -> Sample:
    return dataclasses.replace(s, reward=reward)
