"""What it takes to generate a sample again, bit for bit: the replay coordinate, and its rules.

A replica stamps one ``ReplayCoordinate`` on every result it stores (``RolloutResult.replay``):
one per result, not per sample, since the samples of a request share their prompt, sampling,
replica and engine build, and each sample's own part is already on its ``Completion``: its
spans (``weight_versions``) and its random stream, ``sample_seed(seed, index)`` (``seeds``).
A coordinate holds

- ``prompt``: the xxh3-64 digest of the prompt's token ids as the engine read them
  (``prompt_digest``; the prompt itself is in the job, and the digest proves a replay asks for
  the same one);
- ``sampling``: the request's sampling parameters with the seed actually used, drawn by the
  replica when the request gave none (an engine whose unseeded output is random draws one and
  says so; ``seed`` stays None only where the output does not depend on one);
- ``versions``: each version any span was generated at, with that version's content digest
  (``policy_store.digest.content_digest``: the same 8 bytes for the same tensors' bytes, from
  whichever store or chain of deltas they were read);
- ``replica`` and ``build``: which worker, and the engine's build (engine and package version,
  torch, dtype, device, and whether it ran the request in deterministic mode);
- ``restarts``: where a resumable job's samples were made by requests of their own (a run that
  continued one from the tokens kept before it, a segment of an engine that does not stream),
  each with its stream seeded anew: the boundaries a replay remakes segment by segment.

It is encoded as arrays, not maps (``array_like``), to stay small: the coordinate of a
512-token sample adds under 2 % to its result (``benchmarks/bench_replay.py``). Fields may
only be added at the end, with defaults. A result stored before coordinates existed decodes
with ``replay=None``.

Every door that hands out samples (the rollout loop's ``Sample``, the gateway's ``rollfleet``
facts, miles' ``Sample.metadata``) carries a sample's coordinate in one JSON form,
``coordinate_wire``, read back by ``coordinate_from_wire``: named fields, bytes in hex, and the
sample's index within its result (its stream is ``sample_seed(sampling.seed, index)``).

The decisions over coordinates are pure functions in ``replay_rules``: which parts of two coordinates differ
(``parts_differ``), where two samples first diverge (``first_divergence``), what a replay of a
sample asks for or why it cannot be asked (``replay_request``), and the outcome of comparing a
replay with its original (``judge_replay``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from rollfleet.schemas.sampling import SamplingParams


class EngineBuild(msgspec.Struct, frozen=True, array_like=True):
    """The engine that generated a result, as far as its output can depend on it."""

    engine: str  # "hf", "echo", "vllm", "sglang"
    version: str = ""  # its package's version (transformers for hf, rollfleet for echo)
    torch: str = ""
    dtype: str = ""  # "float32", "bfloat16"
    device: str = ""  # "cpu", or "cuda:" and the device's name
    deterministic: bool = False  # this request ran batch-invariant (alone, or fixed-order kernels)

    def same_build(self, other: EngineBuild) -> bool:
        """The same engine build, whatever the mode it ran a request in."""
        return msgspec.structs.replace(self, deterministic=other.deterministic) == other


class VersionDigest(msgspec.Struct, frozen=True, array_like=True):
    version: int
    digest: bytes  # content_digest of the version's tensors; b"" where the replica had none


class ReplayCoordinate(msgspec.Struct, frozen=True, array_like=True):
    prompt: bytes
    sampling: SamplingParams
    versions: tuple[VersionDigest, ...]
    replica: str
    build: EngineBuild
    # Per sample, the offsets at which a request of its own began its tokens, its stream seeded
    # anew at ``sample_seed(seed, i)`` (a resumed run's continuation, a non-streaming engine's
    # segment; ``SampleDelta.restarts``); samples past the end have none. ``()``: no sample was;
    # None: not recorded (a replica before this field).
    restarts: tuple[tuple[int, ...], ...] | None = None

    def digest_of(self, version: int) -> bytes | None:
        return next((v.digest for v in self.versions if v.version == version), None)

    def restarts_of(self, index: int) -> tuple[int, ...]:
        return self.restarts[index] if self.restarts is not None and index < len(self.restarts) else ()


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """xxh3-64 of the prompt's token ids, each as a little-endian signed 64-bit integer. 64 bits
    tell prompts apart by accident (a replay asked with the wrong prompt), nothing more: the
    coordinate must stay small (see the module's docstring)."""
    return xxhash.xxh3_64_digest(struct.pack(f"<{len(token_ids)}q", *token_ids))


def coordinate_wire(coord: ReplayCoordinate | None, index: int) -> dict[str, Any] | None:
    """Sample ``index``'s coordinate as every door carries it, in JSON's terms (None: the result
    has none). The one wire form: a door never writes its own."""
    if coord is None:
        return None
    return {
        "index": index,
        "prompt": coord.prompt.hex(),
        "sampling": msgspec.structs.asdict(coord.sampling),
        "versions": [[v.version, v.digest.hex()] for v in coord.versions],
        "replica": coord.replica,
        "build": msgspec.structs.asdict(coord.build),
        "restarts": None if coord.restarts is None else [list(r) for r in coord.restarts],
    }


def coordinate_from_wire(wire: Any) -> tuple[ReplayCoordinate, int]:
    """A coordinate and its sample's index from ``coordinate_wire``'s form (``ValueError`` for
    anything else), so a sample taken from any door can be replayed (``RolloutClient.replay``)."""
    try:
        coord = ReplayCoordinate(
            prompt=bytes.fromhex(wire["prompt"]),
            sampling=msgspec.convert(wire["sampling"], SamplingParams),
            versions=tuple(VersionDigest(int(v), bytes.fromhex(d)) for v, d in wire["versions"]),
            replica=str(wire["replica"]),
            build=EngineBuild(**wire["build"]),
            restarts=None
            if wire.get("restarts") is None
            else tuple(tuple(int(r) for r in rs) for rs in wire["restarts"]),
        )
        return coord, int(wire["index"])
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a replay coordinate's wire form: {exc}") from None
