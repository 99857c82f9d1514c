"""What a resumable job's checkpoint stores, and what a stored record may hold, as pure rules.

A checkpoint stores only what is new since the last record: each sample's tokens from how many
of them are stored on, with their log-probs (where the job asked for them), version spans and
restarts, and its finish once every token before it is stored, within a budget of tokens per
record. A stored record whose tokens were made at a version outside the job's constraint is not
the job's to continue from.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollfleet.schemas import VersionConstraint
from rollfleet.schemas.errors import CorruptCheckpoint
from rollfleet.schemas.progress import SampleDelta, SampleSoFar, TokensRecord, spans_between


def new_deltas(
    samples: Sequence[SampleSoFar],
    stored: Sequence[int],
    finish_stored: Sequence[bool],
    tokens: int,
    *,
    logprobs: bool,
) -> tuple[list[SampleDelta], list[tuple[int, int, bool]]]:
    """The samples' deltas since what is stored, ``tokens`` at most in all, and for each sample
    in them (index, tokens stored once it is, finish stored once it is)."""
    deltas, upto, room = [], [], tokens
    for i, s in enumerate(samples):
        start, have = stored[i], len(s.token_ids)
        end = min(have, start + room)
        finish = s.finish if end == have else None
        if end == start and (finish is None or finish_stored[i]):
            continue
        room -= end - start
        deltas.append(
            SampleDelta(
                index=i,
                start=start,
                token_ids=s.token_ids[start:end],
                logprobs=s.logprobs[start:end] if logprobs else None,
                spans=spans_between(s.spans, start, end),
                finish=finish,
                restarts=[r for r in s.restarts if start <= r < end],
            )
        )
        upto.append((i, end, finish is not None))
    return deltas, upto


def check_versions(record: TokensRecord, constraint: VersionConstraint) -> None:
    """``CorruptCheckpoint`` where a stored token was made at a version ``constraint`` refuses."""
    for delta in record.samples:
        for span in delta.spans:
            if not constraint.allows(span.version):
                raise CorruptCheckpoint(
                    f"stored tokens at version {span.version}, outside the job's constraint {constraint}"
                )
