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
from rollfleet.schemas.replay import ReplayCoordinate, VersionDigest
from rollfleet.schemas.sampling import SamplingParams
from rollfleet.schemas.seeds import sample_seed

# The parts of a coordinate a replay can find different, in the order a report names them.
Part = Literal["prompt", "sampling", "seed", "version", "version_digest", "engine_build", "deterministic"]


class ReplayRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a replay of sample ``index`` of a result asks the fleet for, at its one version, in
    deterministic mode: a request of ``n`` samples, seeded ``sampling.seed``, whose sample
    ``pick`` is compared with the original; and what the replica should say back in its own
    coordinate (``expected``). An engine that follows the seeds rule is asked for the sample
    alone (``n`` 1, its own stream's seed); one whose samples depend on their index within the
    request (echo) is asked for the request's first ``index + 1`` samples again."""

    index: int
    version: int
    n: int
    pick: int
    sampling: SamplingParams
    expected: ReplayCoordinate


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


def replay_request(result: RolloutResult, index: int = 0, coordinate: ReplayCoordinate | None = None) -> ReplayRequest:
    """What replaying sample ``index`` of ``result`` asks for, under ``coordinate`` (default:
    the result's own); ``NotReplayable`` where it cannot be asked (``sample_request``)."""
    coord = coordinate if coordinate is not None else result.replay
    if coord is None:
        raise NotReplayable(
            "the result carries no replay coordinate (stored by an older replica)", reason="no_coordinate"
        )
    if not 0 <= index < len(result.outputs):
        raise NotReplayable(f"the result has no sample {index}", reason="no_sample", index=index)
    resumed = bool(result.resumes or result.kept_tokens)
    return sample_request(coord, result.outputs[index], index, resumed=resumed, version=result.version_start)


def sample_request(
    coord: ReplayCoordinate, sample: Completion, index: int, *, resumed: bool = False, version: int | None = None
) -> ReplayRequest:
    """What replaying ``sample``, sample ``index`` of a request whose coordinate is ``coord``,
    asks for. Raises ``NotReplayable`` naming why it cannot be asked: a sample made in more than
    one segment (resumed, or spanning an activation: each segment would have to be replayed from
    the tokens kept before it, which this version does not do), or an unseeded random sample (its
    stream was never recorded). ``version``: where the sample has no span (no token), the
    version it ran at."""
    if resumed:
        raise NotReplayable(
            "a resumed sample is made in segments; replaying segment by segment is not supported yet",
            reason="resumed",
            index=index,
        )
    versions = sorted({span.version for span in sample.weight_versions})
    if len(sample.weight_versions) > 1:
        raise NotReplayable(
            f"sample {index} spans versions {versions} in {len(sample.weight_versions)} segments; replaying "
            "segment by segment is not supported yet",
            reason="multi_span",
            index=index,
        )
    if versions:
        at = versions[0]
    elif version is not None:
        at = version
    elif len(coord.versions) == 1:
        at = coord.versions[0].version
    else:
        raise NotReplayable(f"sample {index} names no version to replay at", reason="multi_span", index=index)
    indexed = coord.build.engine in _INDEXED_ENGINES
    seed = sample_seed(coord.sampling.seed, index)
    if seed is None and coord.sampling.temperature > 0 and not indexed:
        raise NotReplayable(
            f"sample {index} was drawn unseeded by {coord.build.engine}, which recorded no seed",
            reason="unseeded",
            index=index,
        )
    expected = sample_view(coord, index, at, deterministic=True)
    n, pick = (index + 1, index) if indexed else (1, 0)
    return ReplayRequest(index=index, version=at, n=n, pick=pick, sampling=expected.sampling, expected=expected)


def sample_view(coord: ReplayCoordinate, index: int, version: int, *, deterministic: bool) -> ReplayCoordinate:
    """Sample ``index``'s own part of a result's coordinate, as its replay's request would
    record it: its stream's seed (the request's, for an engine whose samples go by index), that
    version's digest alone, ``deterministic``."""
    digest = coord.digest_of(version)
    seed = coord.sampling.seed if coord.build.engine in _INDEXED_ENGINES else sample_seed(coord.sampling.seed, index)
    return msgspec.structs.replace(
        coord,
        sampling=msgspec.structs.replace(coord.sampling, seed=seed),
        versions=(VersionDigest(version, digest if digest is not None else b""),),
        build=msgspec.structs.replace(coord.build, deterministic=deterministic),
    )


# Engines whose samples are a pure function of their inputs and their index within the request,
# with no random stream of their own (an unseeded one is as replayable as a seeded one).
_INDEXED_ENGINES = frozenset({"echo"})


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
    differs += parts_differ(sample_view(recorded, request.index, request.version, deterministic=True), expected)
    # The replica that served the replay says what it ran: a build, a mode or a version's bytes
    # other than those asked for is named, whatever the tokens say.
    differs += ["engine_build", "deterministic"] if served is None else parts_differ(expected, served)
    if store_digest is not None and expected.versions[0].digest != store_digest:
        differs.append("version_digest")
    first_token = first_divergence(original.token_ids, replayed.token_ids)
    first_logprob = None
    if original.logprobs is not None or replayed.logprobs is not None:
        first_logprob = first_divergence(original.logprobs or [], replayed.logprobs or [])
    if (first_token is not None or first_logprob is not None) and not recorded.build.deterministic:
        differs.append("deterministic")  # the original ran batched: the likeliest cause, named
    order = {p: i for i, p in enumerate(get_args(Part))}
    parts = tuple(sorted(set(differs), key=lambda p: order.get(p, len(order))))
    return ReplayOutcome(
        matched=first_token is None and first_logprob is None and not parts,
        index=request.index,
        version=request.version,
        tokens=len(original.token_ids),
        first_token=first_token,
        first_logprob=first_logprob,
        differs=parts,
        replica=served.replica if served is not None else "",
    )
