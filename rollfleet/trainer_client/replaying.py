"""Generating a sample again, bit for bit, and saying whether it came out the same.

``replay`` carries out what the pure rules decide (``schemas.replay_rules``): it submits the
sample's prompt with its recorded sampling and its own stream's seed as one exact-version job at
the version its tokens were made at, in deterministic mode (a sample made in segments, resumed
or across an activation: one job a segment, at the segment's version, prompted with the tokens
before it), and judges each answer against the original from their tokens, log-probs and
coordinates: ``matched``, or the first token and
log-prob that diverged and which parts of the coordinate differ (the seed, the version's digest,
the engine build, the mode). A replica at that version with another build, or whose bytes of the
version differ from those recorded (a store re-created since), is named so, never a match.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from rollfleet.policy_store.materialize import store_content_digest
from rollfleet.schemas import Completion, ReplayCoordinate, RolloutPayload, RolloutResult, prompt_digest
from rollfleet.schemas.errors import NotReplayable
from rollfleet.schemas.replay_rules import (
    ReplayOutcome,
    judge_replay,
    judge_segments,
    replay_segments,
    segment_requests,
)


class ReplayHost(Protocol):
    """What a replay needs of its client (``RolloutClient`` is one): submitting a job."""

    async def submit(self, payload: RolloutPayload, **options: Any) -> Any: ...


async def replay(
    client: ReplayHost,
    target: RolloutResult | ReplayCoordinate,
    payload: RolloutPayload,
    *,
    index: int = 0,
    original: Completion | None = None,
    coordinate: ReplayCoordinate | None = None,
    store: str | Path | None = None,
    timeout: float = 120.0,
    wait_for_replica: bool = False,
) -> ReplayOutcome:
    """Replay sample ``index`` of ``target`` (a result, or a coordinate with the ``original``
    sample beside it) asked as ``payload`` (the original request: its prompt is checked against
    the coordinate's digest, its ``extra`` sent again). ``coordinate``: ask under another
    coordinate than the result's own (the outcome names where they differ). ``store``: a store
    directory whose digest of the version is compared too. Raises ``NotReplayable`` where the
    sample cannot be replayed, and what ``submit`` raises (``NoCompatibleReplica``: no replica at
    the version; ``wait_for_replica`` queues it for one)."""
    prompt = _prompt_ids(payload)
    if isinstance(target, ReplayCoordinate):
        if original is None:
            raise NotReplayable("a coordinate alone needs the original sample to compare with", reason="no_sample")
        recorded = target
        requests = segment_requests(coordinate or target, original, index, prompt=prompt)
    else:
        if target.replay is None and coordinate is None:
            raise NotReplayable("the result carries no replay coordinate", reason="no_coordinate", index=index)
        recorded = target.replay or coordinate  # type: ignore[assignment]
        requests = replay_segments(target, index, coordinate, prompt)
        original = target.outputs[index]
    if prompt_digest(prompt) != (coordinate or recorded).prompt:
        raise NotReplayable("the prompt given is not the one the coordinate digests", reason="prompt", index=index)
    outcomes = []
    for request in requests:  # (in order: a segment's prompt is the tokens before it, already checked)
        store_digest = None
        if store is not None:  # (a chain's indexes and checksums; hashed files only for a plain full version)
            store_digest = await asyncio.to_thread(store_content_digest, Path(store), request.version)
        again = msgspec.structs.replace(
            payload,
            prompt_token_ids=list(request.prompt if request.prompt is not None else prompt),
            prompt_text=None,
            n=request.n,
            sampling=request.sampling,
            deterministic=True,
            stream_offset=request.stream_offset,
        )
        handle = await client.submit(
            again, exact_version=request.version, timeout=timeout, wait_for_replica=wait_for_replica
        )
        replayed = await handle.result(timeout)
        outcomes.append(
            judge_replay(
                request, original, replayed.outputs[request.pick], replayed.replay, recorded, store_digest=store_digest
            )
        )
    return judge_segments(outcomes)


def _prompt_ids(payload: RolloutPayload) -> Sequence[int]:
    if payload.prompt_token_ids is None:
        raise NotReplayable("a replay sends the prompt's token ids; give prompt_token_ids", reason="prompt")
    return payload.prompt_token_ids
