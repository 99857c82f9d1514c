"""The rollout loop's invariants (the lane of ``reliability.adversary.loop_load``), judged from raw facts.

Sources: each loop life's records in the trainer's journal (its plan; each batch as the trainer
received it: every group's prompt, seed and ``max_tokens`` from the source's own item, every
sample's tokens and spans; the trainer's version when it asked; the loop's ``totals`` after
``close()``), the answers the wiretap saw published under the loop's client id, what the results
stream held at the end, and the trainer's weights, from which every token is recomputed. The loop's
own labels (a batch's version, a group's staleness or ``continued_at``, its ``totals``) are read
only to be compared with those facts, never to judge by.

- ``loop-group``: every trained group is whole: ``group_size`` samples, each with the tokens it
  was asked for (``max_tokens``, or fewer ending at a stop) and finished (not ``abort``), its spans
  tiling its tokens; and a seeded group's samples draw distinct streams: the streams one request
  of ``group_size`` samples seeded ``s`` draws (sample ``i``: ``sample_seed(s, i)``, the rule of
  every engine), each once, however the loop split or continued the group. Which stream a sample
  drew is read from its tokens (below), never from what the loop says it sent.
- ``served``: every token of every trained sample is the token the trainer's weights at its
  span's version make, from the prompt, the tokens before it and the sample's stream (one of the
  group's: each is tried). A continued sample is one chain of tokens from its prompt, whatever
  versions and jobs made its parts.
- ``loop-staleness``: where the loop drops or requeues stale groups, every trained sample's
  staleness is at most ``max_staleness``: the trainer's version when it asked for the batch minus
  the oldest version that made a token of the sample's last run (spans of at least one token:
  ``served`` proves them). A sample's last run is all of it unless it was continued (a partial
  rollout, a refreshed tail): then its tokens since its last continuation, whose job the wiretap
  heard stored (or saw delivered) with the prompt followed by the sample's tokens so far (its
  earlier tokens are the context the newer policy was conditioned on). A sample that had finished
  before its group was stopped is judged by all its tokens. Where a job of the loop was answered
  whose prompt the wiretap never saw (nor heard stored, nor saw delivered), or the wiretap was
  away, a sample found too stale may have been continued unseen: not verifiable.
- ``loop-tokens``: after ``close()``, the tokens the workers generated for the loop (for each of
  its jobs, the first answer the results stream stored, as read from the stream at the end: a
  result, a stopped job's partial answer, a failure's none) equal the tokens handed to the trainer
  (summed from the batches it received) plus the waste the loop reports by cause
  (``totals["waste_tokens_<cause>"]``); and the loop's own count of trained tokens
  (``totals["trained_tokens"]`` or ``totals["tokens"]``) is the batches'. A life during which a
  store loss took answers (or, for a run kept before the stream's answers were counted, the
  wiretap was away) and whose sums differ is counted not verifiable.
- ``loop-ran``: the loop neither raised (``loop_error``) nor hung (a ``next_batch`` or ``close``
  that did not return within its bound, ``loop_hang``).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from reliability.adversary.journal import prefix_digests
from rollfleet.workers.engines.keyed import VOCAB, context_state, keyed_token

WHOLE = ("length", "stop")  # a sample's finish reasons that say it was made to its end
STALE_POLICIES = ("drop", "requeue")  # the policies that never train a stale group
# (``loop-staleness``'s reasons not to judge a sample found too stale: a continuation may be unseen)
AWAY = "loop-staleness: the wiretap away (a continuation's job unseen)"
UNSEEN = "loop-staleness: a job of the loop answered whose prompt the wiretap never saw"


class Judge(Protocol):
    """What the oracle gives each invariant: a check to count (and to fail), and what it cannot see."""

    unverified: dict[str, int]

    def check(self, name: str, ok: bool, key: str | None, message: str, defect: str | None = None) -> bool: ...


@dataclass
class LoopLife:
    """One ``RolloutLoop`` of the trainer, as its journal tells it."""

    lid: str
    inc: int
    client_id: str
    plan: dict[str, Any]
    opened: float
    batches: list[dict[str, Any]] = field(default_factory=list)
    closed: dict[str, Any] | None = None
    troubles: list[dict[str, Any]] = field(default_factory=list)  # loop_error, loop_hang


@dataclass(frozen=True)
class Answer:
    """An answer the wiretap saw published: its client id (from the subject), its job, when, and its
    tokens (None: not known, a chunked answer the wiretap could not put together)."""

    client: str
    job_id: str
    t: float
    ntokens: int | None
    digest: str


def asked_prompts(
    deliveries: Iterable[Any], stored: Mapping[str, Sequence[Any]]
) -> tuple[dict[str, set[str]], set[str]]:
    """What each client asked for, as the wiretap saw it: client id -> the prompt digests of its
    jobs, and the ids of the jobs whose prompt it saw. A job is heard as its client stores it
    (``stored``: job id -> [client id, prompt digest], ``Tap.job_prompts``), whoever it is then
    delivered to; a delivery the wiretap saw says it too (``deliveries``: ``Tap.Delivery``s)."""
    prompts: dict[str, set[str]] = defaultdict(set)
    jobs: set[str] = set()
    for job_id, (client, digest) in stored.items():
        if client and digest:
            prompts[str(client)].add(str(digest))
            jobs.add(str(job_id))
    for d in deliveries:
        if d.client_id and getattr(d, "prompt", None):
            prompts[d.client_id].add(d.prompt)
            if d.job_id:
                jobs.add(d.job_id)
    return dict(prompts), jobs


def lives_of(records: Sequence[dict[str, Any]]) -> list[LoopLife]:
    out: dict[str, LoopLife] = {}
    for r in records:
        ev, lid = r.get("ev"), r.get("loop")
        if ev == "loop_open":
            out[lid] = LoopLife(lid, int(r.get("inc", 0)), r["client_id"], dict(r["plan"]), float(r["t"]))
        elif lid in out and ev == "loop_batch":
            out[lid].batches.append(r)
        elif lid in out and ev == "loop_close":
            out[lid].closed = r
        elif lid in out and ev in ("loop_error", "loop_hang"):
            out[lid].troubles.append(r)
    return list(out.values())


# -- a sample's tokens ------------------------------------------------------------------------------


def made(spans: Sequence[Sequence[Any]]) -> list[tuple[int, int, int, Any]]:
    """The spans that made at least one token, in order: (version, start, end, replica)."""
    out = [(int(s[0]), int(s[1]), int(s[2]), s[3] if len(s) > 3 else None) for s in spans]
    return sorted((s for s in out if s[2] > s[1]), key=lambda s: s[1])


def tiles(spans: Sequence[Sequence[Any]], length: int) -> bool:
    """Whether the spans that made tokens cover ``[0, length)`` once each, in order."""
    at = 0
    for _, start, end, _ in made(spans):
        if start != at:
            return False
        at = end
    return at == length


def streams(seed: int | None, n: int) -> list[tuple[int | None, int]]:
    """The streams a group of ``n`` samples may draw, as ``keyed_token``'s (seed, sample) pairs: a
    seeded group's sample ``i`` draws ``sample_seed(seed, i)`` (sent alone as that seed's sample 0,
    or as sample ``i`` of a request of ``n``: the same stream); an unseeded group's sample ``i``
    differs from sample 0 by its first token only."""
    if seed is None:
        return [(None, i) for i in range(n)]
    return [(seed + i, 0) for i in range(n)]


Stream = tuple[int | None, int]


def drawn_streams(runs: Sequence[Sequence[Any]]) -> Callable[[int], Stream | None] | None:
    """For a sample of an unseeded group: the stream its replica drew for the run that made the
    token at a position (a seed drawn for an unseeded request, recorded in the run's replay
    coordinate; sample ``i`` of it draws ``sample_seed(seed, i)``), None where that run drew none.
    None when no run of it drew one (``runs``: the journal's ``[start, index, seed]`` per run)."""
    # (In the order they ran: a run that made nothing, aborted before its first token, is
    # followed by one that starts at the same offset, which made the tokens.)
    drawn = [(int(start), int(index), seed) for start, index, seed in runs]
    if not any(seed is not None for _, _, seed in drawn):
        return None

    def stream_at(position: int) -> Stream | None:
        run = [r for r in drawn if r[0] <= position]
        if not run or run[-1][2] is None:
            return None
        _, index, seed = run[-1]
        return int(seed) + index, 0

    return stream_at


def span_misfits(
    key_of: Callable[[int], bytes],
    prompt: Sequence[int],
    tokens: Sequence[int],
    spans: Sequence[Sequence[Any]],
    stream: Stream,
    keyed: Callable[[Any], bool],
    drawn: Callable[[int], Stream | None] | None = None,
) -> list[int | None]:
    """Per span that made tokens (``made``'s order), for one sample drawing ``stream``: its first
    token that is not what its version's weights make from the context before it (-1: every one
    is; None: a span of an engine that is not keyed, not recomputed). ``drawn``: the stream a
    replica drew for the run that made a token, where it drew one (``drawn_streams``)."""
    out: list[int | None] = []
    ctx = context_state(prompt)
    at = 0
    for v, start, end, replica in made(spans):
        if start > at:  # (tokens no span made: their context still counts)
            ctx = context_state([int(t) for t in tokens[at:start]], ctx)
        first: int | None = -1 if keyed(replica) else None
        key = key_of(v) if first is not None else b""
        for j in range(start, min(end, len(tokens))):
            tok = int(tokens[j])
            if first == -1:
                # (per token: one span of a version may join the tail of one run to the next run)
                seed, index = (drawn(j) if drawn is not None else None) or stream
                want = keyed_token(key, ctx, seed=seed, sample=index, first=j == 0, vocab=VOCAB)
                # (an unseeded sample sent alone before its first token is made as sample 0 is)
                alone = seed is None and j == 0 and keyed_token(key, ctx, seed=None, sample=0, first=True,
                                                               vocab=VOCAB) == tok  # fmt: skip
                if want != tok and not alone:
                    first = j
            ctx = context_state((tok,), ctx)
        at = max(at, end)
        out.append(first)
    return out


def _stream_name(stream: tuple[int | None, int]) -> int:
    """A stream as the engines name it: a seeded sample's own seed, an unseeded one's index."""
    seed, index = stream
    return index if seed is None else seed


def distinct_streams(fits: Sequence[set[int]]) -> bool:
    """Whether each sample can be given a stream it fits, no stream twice (``fits``: per sample,
    the indices of the group's streams its tokens fit)."""
    if not fits:
        return True
    width = max((max(f) for f in fits if f), default=-1) + 1
    if width < len(fits):
        return False
    return any(all(p[i] in f for i, f in enumerate(fits)) for p in itertools.permutations(range(width), len(fits)))


# -- the invariants ---------------------------------------------------------------------------------


def judge_group(
    judge: Judge,
    life: LoopLife,
    batch: dict[str, Any],
    group: dict[str, Any],
    *,
    key_of: Callable[[int], bytes],
    keyed: Callable[[Any], bool],
    seen_prompts: set[str],
    blind: str | None = None,
) -> None:
    """``loop-group``, ``served`` and ``loop-staleness`` for one trained group. ``seen_prompts``: the
    prompt digests of the jobs the wiretap saw the loop's client ask for (``blind``: why it may
    have missed some, if it may)."""
    plan = life.plan
    n, seed, want = int(plan["group_size"]), group.get("seed"), int(group["max_tokens"])
    where = f"{life.lid} step {batch.get('step')}"
    label = f"loop {life.lid}"
    samples = group.get("samples") or []
    # -- whole
    broken: list[str] = []
    if len(samples) != n:
        broken.append(f"{len(samples)} samples, not group_size {n}")
    for i, s in enumerate(samples):
        length = len(s["tokens"])
        if s.get("finish") not in WHOLE:
            broken.append(f"sample {i} finished {s.get('finish')!r} after {length} of {want} tokens")
        elif length > want or (s.get("finish") == "length" and length != want):
            broken.append(f"sample {i} has {length} tokens, {want} asked, finished {s.get('finish')!r}")
        if not tiles(s.get("spans") or [], length):
            broken.append(f"sample {i}'s spans {s.get('spans')} do not tile its {length} tokens")
    # -- served, and which stream each sample drew
    candidates = streams(seed, n)
    fits: list[set[int]] = []
    misfits: list[str] = []
    recomputed = 0
    for i, s in enumerate(samples):
        tokens, spans = [int(t) for t in s["tokens"]], s.get("spans") or []
        runs = made(spans)
        try:
            drawn = drawn_streams(s.get("runs") or []) if seed is None else None
            per_stream = [span_misfits(key_of, group["prompt"], tokens, spans, c, keyed, drawn) for c in candidates]
        except Exception as exc:  # (a version the trainer never had: no weights to key)
            misfits.append(f"sample {i}: its spans name a version with no weights ({exc!r:.80})")
            fits.append(set())
            continue
        keyed_runs = [k for k in range(len(runs)) if per_stream and per_stream[0][k] is not None]
        recomputed += sum(runs[k][2] - runs[k][1] for k in keyed_runs)
        whole = {c for c, got in enumerate(per_stream) if all(got[k] == -1 for k in keyed_runs)}
        fits.append(whole)
        if whole or not keyed_runs:
            continue
        by_run = {k: {c for c, got in enumerate(per_stream) if got[k] == -1} for k in keyed_runs}
        wrong = [k for k in keyed_runs if not by_run[k]]
        if wrong:  # tokens that no stream of the group makes at the version their span names
            k = wrong[0]
            bad = min(int(got[k]) for got in per_stream if got[k] is not None and got[k] >= 0)
            misfits.append(
                f"sample {i}: token {bad} (labelled v{runs[k][0]}, in span {list(runs[k][:3])}) is not what the "
                f"trainer's weights make for any of the group's {len(candidates)} streams"
            )
        else:  # each part is some stream's, not all the same one: the sample changed streams
            parts = ", ".join(
                f"[{runs[k][1]}, {runs[k][2]}) stream {sorted(_stream_name(candidates[c]) for c in by_run[k])}"
                for k in keyed_runs
            )
            broken.append(f"sample {i} changes streams: {parts} (a continued sample must keep its own)")
    if recomputed == 0 and not misfits:
        judge.unverified["served: no token of a trained sample made by a keyed engine"] += 1
    else:
        judge.check("served", not misfits, label, f"{where}: {'; '.join(misfits)[:600]}")
    if seed is not None and not misfits and all(fits) and not distinct_streams(fits):
        drew = [sorted(_stream_name(candidates[k]) for k in f) for f in fits]
        broken.append(
            f"seeded {seed}: its {len(samples)} samples do not draw {len(samples)} distinct streams "
            f"(each fits only {drew}: copies)"
        )
    judge.check(
        "loop-group",
        not broken,
        label,
        f"{where}, prompt {group['prompt'][:4]}..., seed {seed}, split {plan.get('split_groups')}, "
        f"partial {plan.get('partial_rollout')}: {'; '.join(broken)[:600]}",
    )
    # -- staleness, from the tokens
    if plan.get("stale") not in STALE_POLICIES:
        return
    version = batch.get("version_before")
    version = int(version) if version is not None else 0
    judged = [(judged_from(group["prompt"], s, seen_prompts), i) for i, s in enumerate(samples)]
    worst = [(version - v, i, cut) for (v, cut), i in judged if v is not None]
    staleness, sample, cut = max(worst, default=(0, None, 0))
    bound = int(plan["max_staleness"])
    if staleness > bound and blind:
        judge.unverified[blind] += 1
        return
    run = f"its tokens from {cut} on (its last continuation)" if cut else "its tokens (never continued)"
    judge.check(
        "loop-staleness",
        staleness <= bound,
        label,
        f"{where}: sample {sample} was trained at version {version} (the trainer's, when it asked) with "
        f"{run} made at v{version - staleness}: staleness {staleness} > max_staleness {bound} "
        f"(stale: {plan.get('stale')})",
    )


def judged_from(prompt: Sequence[int], sample: dict[str, Any], seen_prompts: set[str]) -> tuple[int | None, int]:
    """(the version a sample is judged by, where its last run began): the oldest version that made
    a token of its last run. Its last run begins where its last continuation did: the longest
    prefix of its tokens that, after the prompt, was the prompt of a job the wiretap saw delivered
    for the loop (a continuation is sent as the prompt followed by the sample's tokens so far); a
    sample never continued is its tokens all. Spans of no token never count."""
    tokens = sample["tokens"]
    digests = prefix_digests(prompt, tokens)
    cut = next((c for c in range(len(tokens) - 1, 0, -1) if digests[c] in seen_prompts), 0)
    versions = [v for v, start, end, _ in made(sample.get("spans") or []) if end > cut]
    return (min(versions) if versions else None), cut


def judge_tokens(
    judge: Judge,
    life: LoopLife,
    answers: Sequence[Answer],
    *,
    blind: bool,
) -> None:
    """``loop-tokens`` for a closed life: ``answers`` are the stored answers of its jobs, one per
    job; ``blind``: the wiretap may have missed some (a gap, a store loss, during the life)."""
    assert life.closed is not None
    totals = life.closed.get("totals") or {}
    trained = sum(len(s["tokens"]) for b in life.batches for g in b.get("groups") or [] for s in g["samples"])
    waste = {k[len("waste_tokens_") :]: int(v) for k, v in totals.items() if k.startswith("waste_tokens_") and v}
    reported = totals.get("trained_tokens", totals.get("tokens"))
    unknown = [a.job_id for a in answers if a.ntokens is None]
    generated = sum(a.ntokens or 0 for a in answers)
    wrong: list[str] = []
    if reported is not None and int(reported) != trained:
        wrong.append(f"the loop counts {reported} tokens trained, its batches handed the trainer {trained}")
    if generated != trained + sum(waste.values()):
        own = f" (it counts {totals['generated_tokens']} generated)" if "generated_tokens" in totals else ""
        wrong.append(
            f"the workers generated {generated} tokens for it ({len(answers)} jobs answered){own}, but it handed "
            f"out {trained} and reports {sum(waste.values())} wasted {dict(sorted(waste.items()))}: "
            f"{generated - trained - sum(waste.values())} unaccounted"
        )
    if wrong and (blind or unknown):
        why = "the wiretap away during the life" if blind else "an answer's tokens not seen whole"
        judge.unverified[f"loop-tokens: {why}"] += 1
        return
    judge.check("loop-tokens", not wrong, f"loop {life.lid}", "; ".join(wrong))


def judge_loops(
    judge: Judge,
    records: Sequence[dict[str, Any]],
    answers: Sequence[Answer],
    *,
    stored: dict[str, set[str]],
    submitted: dict[str, float],
    key_of: Callable[[int], bytes],
    keyed: Callable[[Any], bool],
    blind: Callable[[float, float], bool],
    killed: set[int],
    prompts: dict[str, set[str]] | None = None,
    away: Callable[[float, float], bool] = lambda t0, t1: False,
    asked: set[str] | None = None,
) -> dict[str, int]:
    """Every invariant above over a run's loop lives. ``stored``: job id -> the digests of its
    answers the results stream held at the end; ``submitted``: job id -> when its client stored it
    (from the wiretap's deliveries); ``blind(t0, t1)``: whether an answer stored in [t0, t1] may be
    missing from ``answers`` (a store loss took it); ``killed``: the trainer incarnations
    SIGKILLed; ``prompts``: client id -> the prompt digests of its jobs the wiretap saw asked
    (``asked_prompts``); ``away(t0, t1)``: whether the wiretap was away meanwhile (it may have
    missed a job); ``asked``: the ids of the jobs whose prompt it saw (None: not known). Returns
    notes."""
    lives = lives_of(records)
    notes: dict[str, int] = defaultdict(int)
    # When each client's jobs whose prompt the wiretap never saw were stored (their answers say
    # they were asked): a sample continued then may have been continued by one of them.
    unseen: dict[str, list[float]] = defaultdict(list)
    if asked is not None:
        for a in answers:
            if a.job_id not in asked:
                unseen[a.client].append(submitted.get(a.job_id, a.t))
    by_client: dict[str, list[LoopLife]] = defaultdict(list)
    for life in lives:
        by_client[life.client_id].append(life)
        notes["loop_lives"] += 1
        judge.check(
            "loop-ran",
            not life.troubles,
            f"loop {life.lid}",
            "; ".join(
                f"{t['ev']} at {t.get('where')}: {t.get('cls') or ''} {t.get('message') or ''}"
                f"{' after ' + str(t.get('waited_s')) + ' s' if t.get('waited_s') is not None else ''}"
                for t in life.troubles
            )[:600],
        )
        for batch in life.batches:
            notes["loop_batches"] += 1
            for group in batch.get("groups") or []:
                notes["loop_groups_trained"] += 1
                notes["loop_seeded_groups"] += group.get("seed") is not None
                seen = (prompts or {}).get(life.client_id, set())
                until = float(batch.get("t") or life.opened)
                missed = AWAY if away(life.opened, until) else None
                if missed is None and any(life.opened <= t <= until for t in unseen.get(life.client_id, [])):
                    missed = UNSEEN
                judge_group(judge, life, batch, group, key_of=key_of, keyed=keyed, seen_prompts=seen, blind=missed)
    # Each job's stored answer, attributed to the life of its client that was open when it was stored.
    chosen: dict[str, Answer] = {}
    for a in sorted(answers, key=lambda a: a.t):
        if a.client not in by_client:
            continue
        kept = stored.get(a.job_id)
        if a.job_id not in chosen or (kept and a.digest in kept and chosen[a.job_id].digest not in kept):
            chosen[a.job_id] = a
    of_life: dict[str, list[Answer]] = defaultdict(list)
    for a in chosen.values():
        mine = sorted(by_client[a.client], key=lambda life: life.opened)
        at = submitted.get(a.job_id, a.t)
        life = next((lf for lf in reversed(mine) if lf.opened <= at), mine[0])
        of_life[life.lid].append(a)
    for life in lives:
        if life.closed is None and not life.batches and any(t.get("where") == "construct" for t in life.troubles):
            continue  # (never made: nothing submitted, ``loop-ran`` says why)
        if life.closed is None:
            why = "cut short by the trainer's SIGKILL" if life.inc in killed else "never closed"
            judge.unverified[f"loop-tokens: {why}"] += 1
            continue
        end = float(life.closed.get("t", life.opened))
        judge_tokens(judge, life, of_life.get(life.lid, []), blind=blind(life.opened, end + 1.0))
    return dict(notes)
