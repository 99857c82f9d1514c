"""The decisions of a replay, as pure functions over coordinates, samples and digests.

Which parts of two coordinates of one sample differ (``parts_differ``), where two samples first
diverge (``first_divergence``), what replaying sample ``i`` of a result asks the fleet for or
why it cannot be asked (``replay_request``), and the outcome of comparing a replay with its
original (``judge_replay``). The trainer's client carries them out (``trainer_client.replaying``);
nothing here waits or reads a clock.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Literal, get_args

import msgspec

from rollfleet.schemas.errors import NotReplayable
from rollfleet.schemas.messages import Completion, RolloutResult
from rollfleet.schemas.replay import ReplayCoordinate, VersionDigest, prompt_digest
from rollfleet.schemas.sampling import SamplingParams
from rollfleet.schemas.seeds import sample_seed

# The parts of a coordinate a replay can find different, in the order a report names them.
Part = Literal["prompt", "sampling", "seed", "version", "version_digest", "engine_build", "deterministic"]


class ReplayRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a replay of one segment of sample ``index`` of a result asks the fleet for, at the
    segment's one version, in deterministic mode: a request of ``n`` samples, seeded
    ``sampling.seed``, prompted ``prompt`` (the original prompt and the sample's tokens before
    ``start``, forced; None where the caller's prompt was not given), whose sample ``pick`` is
    compared with the original's tokens ``[start, end)``; and what the replica should say back in
    its own coordinate (``expected``). An engine that follows the seeds rule is asked for the
    sample alone (``n`` 1, its own stream's seed); one whose samples depend on their index within
    the request (echo) is asked for the request's first ``index + 1`` samples again. A segment a
    request of its own began (``restart``: a resumed run's continuation) is asked as that
    request was: alone, its stream seeded anew at ``sample_seed(seed, index)``."""

    index: int
    version: int
    n: int
    pick: int
    sampling: SamplingParams
    expected: ReplayCoordinate
    start: int = 0
    end: int | None = None  # None: to the sample's end
    restart: bool = False
    prompt: tuple[int, ...] | None = None
    # A segment that began inside its sampled request, at an activation: its stream advanced past
    # the draws of the request's tokens before it (``RolloutPayload.stream_offset``).
    stream_offset: int = 0


class ReplayOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """A replay judged against its original sample, from their tokens and coordinates alone.

    ``matched``: every token and every log-prob identical bit for bit, and no part of the
    coordinate different. Otherwise ``first_token`` / ``first_logprob``: the first index where
    they differ (None: none does), and ``differs``: the parts of the coordinate the replay found
    different (from the original's record, from the replica that served it, or from the store)."""

    matched: bool
    index: int
    version: int
    tokens: int  # the original sample's length
    first_token: int | None = None
    first_logprob: int | None = None
    differs: tuple[str, ...] = ()
    replica: str = ""  # the replica that served the replay
    start: int = 0  # a segment's: the offset of its first token in the sample (``first_*`` count from 0)
    # A sample replayed segment by segment: each segment's outcome, in order (``first_token`` and
    # ``first_logprob`` above are then the first over all, as offsets in the sample).
    segments: tuple[ReplayOutcome, ...] = ()


def parts_differ(a: ReplayCoordinate, b: ReplayCoordinate) -> tuple[Part, ...]:
    """The parts in which two coordinates of one sample differ (the replica never counts)."""
    parts: list[Part] = []
    if a.prompt != b.prompt:
        parts.append("prompt")
    if msgspec.structs.replace(a.sampling, seed=None) != msgspec.structs.replace(b.sampling, seed=None):
        parts.append("sampling")
    if a.sampling.seed != b.sampling.seed:
        parts.append("seed")
    if [v.version for v in a.versions] != [v.version for v in b.versions]:
        parts.append("version")
    elif [v.digest for v in a.versions] != [v.digest for v in b.versions]:
        parts.append("version_digest")
    if not a.build.same_build(b.build):
        parts.append("engine_build")
    if a.build.deterministic != b.build.deterministic:
        parts.append("deterministic")
    return tuple(parts)


def first_divergence(a: Sequence[int | float], b: Sequence[int | float]) -> int | None:
    """The first index where two sequences differ (a float compared by its bits, so -0.0 and 0.0
    differ and NaN equals itself); the shorter one's length if one is a prefix of the other;
    None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if isinstance(x, float) and isinstance(y, float):
            if _bits(x) != _bits(y):
                return i
        elif x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def replay_request(
    result: RolloutResult,
    index: int = 0,
    coordinate: ReplayCoordinate | None = None,
    prompt: Sequence[int] | None = None,
) -> ReplayRequest:
    """What replaying sample ``index`` of ``result`` (made in one segment) asks for, under
    ``coordinate`` (default: the result's own); ``NotReplayable`` where it cannot be asked
    (``segment_requests``), or where it was made in more than one segment."""
    return _one_segment(replay_segments(result, index, coordinate, prompt), index)


def _one_segment(requests: list[ReplayRequest], index: int) -> ReplayRequest:
    """The one request of a sample made in one segment; ``NotReplayable`` (``multi_span``) else."""
    if len(requests) > 1:
        raise NotReplayable(
            f"sample {index} was made in {len(requests)} segments; replay it segment by segment (replay_segments)",
            reason="multi_span",
            index=index,
        )
    return requests[0]


def replay_segments(
    result: RolloutResult,
    index: int = 0,
    coordinate: ReplayCoordinate | None = None,
    prompt: Sequence[int] | None = None,
) -> list[ReplayRequest]:
    """The requests that replay sample ``index`` of ``result``, one a segment (``segment_requests``)."""
    coord = coordinate if coordinate is not None else result.replay
    if coord is None:
        raise NotReplayable(
            "the result carries no replay coordinate (stored by an older replica)", reason="no_coordinate"
        )
    if not 0 <= index < len(result.outputs):
        raise NotReplayable(f"the result has no sample {index}", reason="no_sample", index=index)
    resumed = bool(result.resumes or result.kept_tokens)
    return segment_requests(
        coord, result.outputs[index], index, resumed=resumed, version=result.version_start, prompt=prompt
    )


def sample_request(
    coord: ReplayCoordinate, sample: Completion, index: int, *, resumed: bool = False, version: int | None = None
) -> ReplayRequest:
    """``segment_requests`` of a sample made in one segment (``NotReplayable``, ``multi_span``,
    for one made in more)."""
    return _one_segment(segment_requests(coord, sample, index, resumed=resumed, version=version), index)


def _versions_from(coord: ReplayCoordinate, sample: Completion, index: int, version: int | None) -> dict[int, int]:
    """The version each of the sample's spans began at, by its first token; a sample with no
    span (no token) ran at ``version``, or at the coordinate's one version."""
    spans = [s for s in sample.weight_versions if s.end > s.start]
    if spans:
        return {s.start: s.version for s in spans}
    if version is not None:
        return {0: version}
    if len(coord.versions) == 1:
        return {0: coord.versions[0].version}
    raise NotReplayable(f"sample {index} names no version to replay at", reason="multi_span", index=index)


def _across_activation(index: int, start: int, version: int, began: int, engine: str) -> NotReplayable:
    return NotReplayable(
        f"sample {index}'s tokens from {start} were made at version {version} by the request that began at "
        f"{began}, its random stream running on across the activation; replaying them needs the engine's "
        f"stream advanced past {start - began} tokens' draws, which {engine} does not take",
        reason="multi_span",
        index=index,
    )


def segment_requests(
    coord: ReplayCoordinate,
    sample: Completion,
    index: int,
    *,
    resumed: bool = False,
    version: int | None = None,
    prompt: Sequence[int] | None = None,
) -> list[ReplayRequest]:
    """What replaying ``sample``, sample ``index`` of a request whose coordinate is ``coord``,
    asks for: one request a segment. A segment begins where the sample's version changes (a
    span) or where a request of its own began its tokens (``coord.restarts``: a resumed run's
    continuation, a non-streaming engine's segment). Each is asked at its own version, prompted
    with ``prompt`` and the sample's tokens before it, for its own tokens; one that begins
    mid-request, at an activation, of a sampled (temperature > 0) request, with its request's
    stream advanced past the draws of the tokens that request made before it (``stream_offset``;
    a greedy one needs none).

    Raises ``NotReplayable`` naming why: a resumed sample whose coordinate recorded no restarts
    (``resumed``: a replica before they were recorded); a segment that begins mid-request, at an
    activation, of a sampled request of an engine that cannot advance its stream (``multi_span``:
    vLLM, SGLang, echo, whose tokens there are keyed by their place in the request); an
    unseeded random sample (``unseeded``: its stream was never recorded; a resumed run's
    continuations, each its own request, drew seeds of their own that no record keeps); a later
    segment with no ``prompt`` given (``prompt``). ``version``: where the sample has no
    span (no token), the version it ran at."""
    if resumed and coord.restarts is None:
        raise NotReplayable(
            "a resumed sample is made in segments, and this coordinate recorded no restarts (an older replica)",
            reason="resumed",
            index=index,
        )
    tokens = sample.token_ids
    restarts = [r for r in coord.restarts_of(index) if r <= len(tokens)]
    version_at = _versions_from(coord, sample, index, version)
    starts = sorted({0, *restarts, *version_at})
    seed = _stream_seed(coord, index, continued=bool(restarts))
    requests: list[ReplayRequest] = []
    current = version_at.get(0, 0)
    for k, a in enumerate(starts):
        b = starts[k + 1] if k + 1 < len(starts) else len(tokens)
        current = version_at.get(a, current)
        if a == b and (a > 0 or k + 1 < len(starts)):
            continue  # (a request that made nothing: nothing to remake)
        restart = a in restarts
        offset = 0 if restart else _draws_before(coord, index, a, current, restarts)
        if a > 0 and prompt is None:
            raise NotReplayable(
                f"sample {index}'s segment from token {a} is replayed after the prompt; give the prompt's token ids",
                reason="prompt",
                index=index,
            )
        last = k + 1 == len(starts)
        forced = None if prompt is None else (*prompt, *tokens[:a])
        made = _segment(coord, index, current, a, b, last=last, restart=restart, seed=seed, forced=forced)
        requests.append(msgspec.structs.replace(made, stream_offset=offset) if offset else made)
    return requests


def _stream_seed(coord: ReplayCoordinate, index: int, *, continued: bool) -> int | None:
    """The seed of sample ``index``'s stream; ``NotReplayable`` (``unseeded``) for a random sample
    whose engine recorded none (``continued``: runs of its own continued it, each drawing a seed
    that no record keeps)."""
    seed = sample_seed(coord.sampling.seed, index)
    if seed is None and coord.sampling.temperature > 0 and coord.build.engine not in _INDEXED_ENGINES:
        why = "; the runs that continued it drew seeds of their own that no record keeps" if continued else ""
        raise NotReplayable(
            f"sample {index} was drawn unseeded by {coord.build.engine}, which recorded no seed{why}",
            reason="unseeded",
            index=index,
        )
    return seed


def _draws_before(coord: ReplayCoordinate, index: int, a: int, version: int, restarts: list[int]) -> int:
    """How many draws the stream of the request that made token ``a`` (at ``version``) had made
    before it: 0 where that request began there, or draws nothing (greedy); else the tokens it
    made before, on an engine that can advance its stream (``multi_span`` on one that cannot)."""
    indexed = coord.build.engine in _INDEXED_ENGINES
    if a == 0 or not (coord.sampling.temperature > 0 or indexed):
        return 0
    # Begun at an activation inside a sampled request: asked as that request was, its stream
    # advanced past the draws of its tokens before this one.
    began = max((r for r in restarts if r < a), default=0)
    if indexed or coord.build.engine not in STREAM_ADVANCING_ENGINES:
        raise _across_activation(index, a, version, began, coord.build.engine)
    return a - began


def _segment(
    coord: ReplayCoordinate,
    index: int,
    version: int,
    a: int,
    b: int,
    *,
    last: bool,
    restart: bool,
    seed: int | None,
    forced: tuple[int, ...] | None,
) -> ReplayRequest:
    """The request that remakes tokens ``[a, b)`` of sample ``index`` at ``version``: prompted
    with ``forced`` (the prompt and the tokens before ``a``), seeded as its original request was
    (a request of its own, ``restart`` or of an engine that does not index samples: one sample,
    its stream ``seed``; else the original's first ``index + 1`` samples, picking the last)."""
    indexed = coord.build.engine in _INDEXED_ENGINES
    max_tokens = coord.sampling.max_tokens - a if last else b - a
    view = sample_view(coord, index, version, deterministic=True)
    if restart or not indexed:
        n, pick, stream = 1, 0, seed
    else:
        n, pick, stream = index + 1, index, coord.sampling.seed
    expected = msgspec.structs.replace(
        view,
        prompt=view.prompt if forced is None or a == 0 else prompt_digest(forced),
        sampling=msgspec.structs.replace(view.sampling, seed=stream, max_tokens=max_tokens),
        restarts=(),
    )
    return ReplayRequest(
        index=index, version=version, n=n, pick=pick, sampling=expected.sampling, expected=expected,
        start=a, end=b, restart=restart, prompt=forced,
    )  # fmt: skip


def sample_view(coord: ReplayCoordinate, index: int, version: int, *, deterministic: bool) -> ReplayCoordinate:
    """Sample ``index``'s own part of a result's coordinate, as its replay's request would
    record it: its stream's seed (the request's, for an engine whose samples go by index), that
    version's digest alone, ``deterministic``, no restarts (a replay is one request)."""
    digest = coord.digest_of(version)
    seed = coord.sampling.seed if coord.build.engine in _INDEXED_ENGINES else sample_seed(coord.sampling.seed, index)
    return msgspec.structs.replace(
        coord,
        sampling=msgspec.structs.replace(coord.sampling, seed=seed),
        versions=(VersionDigest(version, digest if digest is not None else b""),),
        build=msgspec.structs.replace(coord.build, deterministic=deterministic),
        restarts=(),
    )


def segment_view(coord: ReplayCoordinate, request: ReplayRequest) -> ReplayCoordinate:
    """``coord``'s part for the segment ``request`` replays, as that request would record it:
    ``request.expected`` where ``coord`` is the coordinate it was asked under (so a coordinate
    other than the one asked under names where it differs)."""
    view = sample_view(coord, request.index, request.version, deterministic=True)
    indexed = coord.build.engine in _INDEXED_ENGINES
    stream = coord.sampling.seed if indexed and not request.restart else sample_seed(coord.sampling.seed, request.index)
    prompt = view.prompt
    if request.prompt is not None and request.start > 0:
        asked = request.prompt[: len(request.prompt) - request.start]
        if prompt_digest(asked) == coord.prompt:  # (else the prompts differ, and stay named)
            prompt = prompt_digest(request.prompt)
    sampling = msgspec.structs.replace(view.sampling, seed=stream, max_tokens=request.sampling.max_tokens)
    return msgspec.structs.replace(view, prompt=prompt, sampling=sampling)


# Engines whose samples are a pure function of their inputs and their index within the request,
# with no random stream of their own (an unseeded one is as replayable as a seeded one).
_INDEXED_ENGINES = frozenset({"echo"})
# Engines that take ``stream_offset`` (the hf engine's ``_sampling.advance_stream``): a segment
# begun at an activation inside a sampled request is replayable on them. vLLM and SGLang seed a
# request's stream at its start and take no offset. The one table: what the replay rules ask and
# what a worker refuses (``workers.engines.base.check_engine_takes``) both read it.
STREAM_ADVANCING_ENGINES = frozenset({"hf"})


def judge_replay(
    request: ReplayRequest,
    original: Completion,
    replayed: Completion,
    served: ReplayCoordinate | None,
    recorded: ReplayCoordinate,
    *,
    store_digest: bytes | None = None,
) -> ReplayOutcome:
    """A replay's outcome. ``served``: the replay result's own coordinate (None: the replica
    stamped none, so nothing of it can be vouched for); ``recorded``: the original result's
    coordinate (a replay asked under another, an altered seed say, names where they differ);
    ``store_digest``: the version's content digest read from the store now, where the caller
    read it (a store re-created since names ``version_digest``)."""
    expected = request.expected
    differs: list[str] = []
    # Asked under another coordinate than the result's own: say where.
    differs += parts_differ(segment_view(recorded, request), expected)
    # The replica that served the replay says what it ran: a build, a mode or a version's bytes
    # other than those asked for is named, whatever the tokens say.
    differs += ["engine_build", "deterministic"] if served is None else parts_differ(expected, served)
    if store_digest is not None and expected.versions[0].digest != store_digest:
        differs.append("version_digest")
    end = len(original.token_ids) if request.end is None else request.end
    first_token = first_divergence(original.token_ids[request.start : end], replayed.token_ids)
    first_logprob = None
    if original.logprobs is not None or replayed.logprobs is not None:
        first_logprob = first_divergence((original.logprobs or [])[request.start : end], replayed.logprobs or [])
    if (first_token is not None or first_logprob is not None) and not recorded.build.deterministic:
        differs.append("deterministic")  # the original ran batched: the likeliest cause, named
    order = {p: i for i, p in enumerate(get_args(Part))}
    parts = tuple(sorted(set(differs), key=lambda p: order.get(p, len(order))))
    return ReplayOutcome(
        matched=first_token is None and first_logprob is None and not parts,
        index=request.index,
        version=request.version,
        tokens=end - request.start,
        first_token=first_token,
        first_logprob=first_logprob,
        differs=parts,
        replica=served.replica if served is not None else "",
        start=request.start,
    )


def judge_segments(outcomes: Sequence[ReplayOutcome]) -> ReplayOutcome:
    """A sample replayed segment by segment, judged whole: matched where every segment matched;
    its first diverging token and log-prob the first of any segment, as offsets in the sample."""
    if len(outcomes) == 1:
        return outcomes[0]
    first = outcomes[0]

    def earliest(field: str) -> int | None:
        found = [o.start + getattr(o, field) for o in outcomes if getattr(o, field) is not None]
        return min(found) if found else None

    order = {p: i for i, p in enumerate(get_args(Part))}
    parts = tuple(sorted({p for o in outcomes for p in o.differs}, key=lambda p: order.get(p, len(order))))
    return ReplayOutcome(
        matched=all(o.matched for o in outcomes),
        index=first.index,
        version=first.version,
        tokens=sum(o.tokens for o in outcomes),
        first_token=earliest("first_token"),
        first_logprob=earliest("first_logprob"),
        differs=parts,
        replica=outcomes[-1].replica,
        segments=tuple(outcomes),
    )
