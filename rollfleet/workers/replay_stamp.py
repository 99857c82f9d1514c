"""The replay coordinate a replica stamps on each result it stores (``schemas.replay``).

Everything in it is what this replica knows as it answers: the prompt as its engine read it,
the job's sampling with the seed its engine drew where the job gave none, the content digest
of each version the samples' spans name (as this replica materialized it; ``b""`` where it
never did: a replica without a store, or a span another replica made before it resumed the
job), itself, and its engine's build in the mode the request ran in.
"""

from __future__ import annotations

import msgspec

from rollfleet.schemas import EngineBuild, ReplayCoordinate, RolloutPayload, VersionDigest, prompt_digest
from rollfleet.workers.engines import Engine, Generation


def stamp(
    payload: RolloutPayload, generation: Generation, engine: Engine, digests: dict[int, bytes], replica: str
) -> ReplayCoordinate:
    """The coordinate of a result generated as ``generation`` for ``payload``; ``digests``: the
    content digest of each version this replica materialized (``ServedVersion.content_digests``)."""
    prompt = engine.prompt_ids(payload)
    sampling = payload.sampling
    if sampling.seed is None and generation.seed is not None:
        sampling = msgspec.structs.replace(sampling, seed=generation.seed)
    versions = sorted({s.version for out in generation.outputs for s in out.weight_versions})
    if not versions:  # (no token made: the versions it ran at bound it)
        versions = sorted({generation.version_start, generation.version_end})
    build: EngineBuild = engine.build(engine.deterministic_for(payload))
    restarts = [tuple(r) for r in generation.restarts or ()]
    while restarts and not restarts[-1]:
        restarts.pop()  # (samples past the end have none: the common case costs one byte)
    return ReplayCoordinate(
        prompt=prompt_digest(prompt) if prompt is not None else b"",
        sampling=sampling,
        versions=tuple(VersionDigest(v, digests.get(v, b"")) for v in versions),
        replica=replica,
        build=build,
        restarts=tuple(restarts),
    )
