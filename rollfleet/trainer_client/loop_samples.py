"""A loop's samples across runs, decided without I/O: the jobs that first ask for a group's
samples and the continuation of a stopped one from its tokens (rule 4, pieces and seeds), and a
sample joined from its runs, judged by the oldest version that made a token of its last run
(rule 6). The rules are numbered as in ``loop_machine``'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from rollfleet.schemas import RolloutPayload, RolloutResult, VersionSpan
from rollfleet.schemas.seeds import sample_seed
from rollfleet.trainer_client.loop_types import Sample, SampleRun


def judged_version(spans: Sequence[VersionSpan], continued_from: int, fallback: int) -> int:
    """Rule 6: the oldest version that made a token at or after ``continued_from`` (zero-width
    spans never count); ``fallback`` (the version its last run started at) when it made none."""
    versions = [s.version for s in spans if s.end > s.start and s.end > continued_from]
    return min(versions) if versions else fallback


def continuable(base: RolloutPayload) -> bool:
    """Whether a stopped sample of this prompt can go on from its tokens (a token-id prompt)."""
    return bool(base.prompt_token_ids)


def first_pieces(base: RolloutPayload, group_size: int, split: bool) -> list[tuple[tuple[int, ...], RolloutPayload]]:
    """Rule 4: a group's first jobs, with the samples each makes."""
    if not split:
        return [(tuple(range(group_size)), msgspec.structs.replace(base, n=group_size))]
    return [((i,), _alone(base, i, base.prompt_token_ids, base.sampling.max_tokens)) for i in range(group_size)]


def continuation(base: RolloutPayload, index: int, prefix: Sequence[int], left: int) -> RolloutPayload:
    """Rule 4: sample ``index`` going on from its tokens so far, for the ``left`` it has left."""
    return _alone(base, index, [*(base.prompt_token_ids or []), *prefix], left)


def _alone(base: RolloutPayload, index: int, prompt: list[int] | None, max_tokens: int) -> RolloutPayload:
    sampling = msgspec.structs.replace(
        base.sampling, max_tokens=max_tokens, seed=sample_seed(base.sampling.seed, index)
    )
    return msgspec.structs.replace(base, prompt_token_ids=prompt, sampling=sampling, n=1)


def result_tokens(result: RolloutResult) -> int:
    return sum(len(o.token_ids) for o in result.outputs)


def run_sample(result: RolloutResult, out: Any, prefix: Sample | None, index: int = 0) -> Sample:
    """A sample from output ``index`` of an answer, after ``prefix`` (what earlier runs made of
    it): tokens, log-probs, spans and runs joined (spans shifted past the earlier tokens; a span
    going on at the same version and replica merges with the one before it; zero-width spans
    dropped)."""
    tokens = list(out.token_ids)
    run = SampleRun(len(prefix.tokens) if prefix else 0, result.idempotency_key, index, result.replay)
    spans = [s for s in out.weight_versions if s.end > s.start] if out.weight_versions else []
    if tokens and not spans:  # (an engine that cannot tell: the run's first version bounds it)
        spans = [VersionSpan(version=result.version_start, start=0, end=len(tokens))]
    logprobs = list(out.logprobs) if out.logprobs is not None else ([] if not tokens else None)
    if prefix is None:
        oldest = min((s.version for s in spans), default=result.version_start)
        judged = judged_version(spans, 0, result.version_start)
        return Sample(tokens, logprobs, spans, out.finish_reason, oldest, result.version_end, 0.0, 0, judged, (run,))
    shift = len(prefix.tokens)
    joined = list(prefix.spans)
    for sp in spans:
        last = joined[-1] if joined else None
        if last is not None and (last.version, last.replica, last.end) == (sp.version, sp.replica, sp.start + shift):
            joined[-1] = VersionSpan(version=sp.version, start=last.start, end=sp.end + shift, replica=sp.replica)
        else:
            joined.append(
                VersionSpan(version=sp.version, start=sp.start + shift, end=sp.end + shift, replica=sp.replica)
            )
    both = None if prefix.logprobs is None or logprobs is None else [*prefix.logprobs, *logprobs]
    oldest = min((s.version for s in joined), default=result.version_start)
    judged = judged_version(joined, shift, result.version_start)
    runs = (*prefix.replay, run)
    return Sample(
        [*prefix.tokens, *tokens], both, joined, out.finish_reason, oldest, result.version_end, 0.0, shift, judged, runs
    )
