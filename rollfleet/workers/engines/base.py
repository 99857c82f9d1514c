"""The engine interface: what a worker needs from an inference server.

Three adapters implement it: ``echo`` (no model), ``hf`` (transformers + torch) and
``sglang`` (HTTP to an SGLang server). The worker owns versions and the job loop; an
engine only generates and swaps weights when told.
"""

from __future__ import annotations

import abc
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from rollfleet.schemas import Completion, EngineBuild, RolloutPayload
from rollfleet.schemas.errors import NotReplayable
from rollfleet.schemas.replay_rules import STREAM_ADVANCING_ENGINES
from rollfleet.schemas.seeds import sample_seed as sample_seed  # (the rule lives with the contract)
from rollfleet.workers.engines.session_cache import SessionCacheStats


def fresh_seed() -> int:
    """A seed for a job that names none: from the OS's entropy, so replicas, restarts and
    re-runs never share a random stream (a seed derived from a counter or from torch's
    default generator would be the same on every replica). 62 bits: a sample's stream,
    ``seed + index``, stays within the unsigned 64-bit integers a result's MessagePack holds."""
    return secrets.randbits(62)


def with_drawn_seed(payload: RolloutPayload, seed: int | None = None) -> tuple[RolloutPayload, int | None]:
    """``payload`` with a seed drawn for it where it samples and gives none, and that seed (None:
    none drawn). An engine server sends it and records it (``Generation.seed``), so any sample
    can be drawn again; from the OS, so replicas never draw alike. (A server that seeds every
    unseeded request alike, as SGLang's deterministic inference does with 42, would otherwise
    make ``n`` copies of one sample.) ``seed``: the one to give it instead of a fresh draw (a
    resumable job's own, ``schemas.seeds.job_seed``)."""
    if payload.sampling.seed is not None or payload.sampling.temperature <= 0:
        return payload, None
    drawn = fresh_seed() if seed is None else seed
    return msgspec.structs.replace(payload, sampling=msgspec.structs.replace(payload.sampling, seed=drawn)), drawn


@dataclass
class Generation:
    """What one request produced, with the versions active at its first and last step."""

    outputs: list[Completion]
    version_start: int
    version_end: int
    prompt_tokens: int = 0
    # Sessions: prompt tokens whose KV came from the session's cache instead of a prefill, and
    # whether that cache was from older weights (an activation since the last turn) and rebuilt.
    cached_tokens: int = 0
    cache_rebuilt: bool = False
    # The seed the engine drew for a request that gave none (sample ``i`` drew the stream
    # ``sample_seed(seed, i)``), so the result's replay coordinate can record it; None where the
    # request gave one, or the engine's output does not depend on one.
    seed: int | None = None
    # A resumable job's: per sample, the offsets at which a request of its own began its tokens
    # (``SampleDelta.restarts``); None for a generation made by one request.
    restarts: list[list[int]] | None = None


class TokenSink:
    """Where an engine that ``streams_tokens`` reports each token of a running request as it
    makes it (on the worker's event loop): a resumable job's checkpoints are written from it."""

    def token(self, index: int, token: int, logprob: float | None, version: int) -> None:
        """Sample ``index`` of the request made ``token`` at ``version``."""

    def finished(self, index: int, reason: str) -> None:
        """Sample ``index`` ended (``stop``, ``length`` or ``abort``)."""


@dataclass
class EngineHealth:
    ok: bool
    detail: str = ""
    extra: dict[str, object] = field(default_factory=dict)


class Engine(abc.ABC):
    """One inference engine. All methods are coroutines safe to call from the worker's loop.

    Lifecycle: ``start`` -> any number of ``generate`` calls, interleaved with
    ``pause`` -> ``load_weights`` -> ``resume`` activations -> ``close``.
    """

    name: str = "engine"
    # Whether ``generate`` reports tokens to a ``sink`` as it makes them. A resumable job on an
    # engine that does not is run in segments of ``checkpoint_tokens`` (a request each), which
    # an engine with a prefix cache prefills cheaply (``workers.progress``).
    streams_tokens: bool = False
    # How long ``health()`` may take before the engine counts as hung (an HTTP engine sets its
    # own: it judges its server by that bound, and the worker must not judge it sooner).
    health_timeout_s: float = 5.0

    def __init__(self) -> None:
        self.version = 0  # the version whose weights are live

    @abc.abstractmethod
    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        """Load ``checkpoint_dir`` (None for engines without weights) as ``version``."""

    @abc.abstractmethod
    async def generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None = None, sink: TokenSink | None = None
    ) -> Generation:
        """Generate for one request; must report the version at start and at end. ``session_id``
        names the multi-turn session the request belongs to: an engine may keep state for it (a
        prefix cache) until ``end_session``; engines without session state ignore it. An engine
        that ``streams_tokens`` reports every token to ``sink``; others ignore it."""

    def prompt_ids(self, payload: RolloutPayload) -> list[int] | None:
        """The prompt's token ids as this engine reads it (a resumed generation prefills them
        with the tokens kept so far); None where the engine cannot tell (a text prompt and no
        tokenizer here)."""
        return list(payload.prompt_token_ids) if payload.prompt_token_ids is not None else None

    def detokenize(self, token_ids: list[int]) -> str | None:
        """Text of output tokens (a resumed generation's whole output), where the engine can."""
        return None

    async def end_session(self, session_id: str) -> None:
        """Drop whatever the engine keeps for ``session_id`` (closed or expired)."""
        return None

    def session_cache_stats(self) -> SessionCacheStats | None:
        """Figures of the engine's own session prefix cache (entries, bytes, hits, misses,
        evictions, ...); None where the engine keeps none in this process."""
        return None

    async def prepare_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """Optional, while still serving: stage ``changed`` tensors of ``version`` (e.g. on the
        GPU) so that ``load_weights`` during the pause only has to swap them in."""
        return None

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop advancing requests between steps; in-flight requests stay and continue later."""

    @abc.abstractmethod
    async def load_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """While paused: make ``version`` live, reloading only the ``changed`` tensors."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue generation (on whatever weights are now live)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop one request; its ``generate`` returns with finish_reason 'abort'."""

    def deterministic_for(self, payload: RolloutPayload) -> bool:
        """Whether this engine serves ``payload`` batch-invariant: the same request gives the same
        tokens and log-probs again, bit for bit, whatever else it runs beside it. An engine that
        cannot says False even when the request asks (its replay coordinate then says so)."""
        return False

    def build(self, deterministic: bool) -> EngineBuild:
        """What a replay coordinate records of this engine: its name and what it knows of its
        build (package and torch versions, dtype, device), and the mode a request ran in."""
        return EngineBuild(self.name, deterministic=deterministic)

    def live_checksums(self) -> dict[str, str] | None:
        """Per-tensor checksums (xxh3-128) of the live weights under HF names, where the engine
        can read them (None otherwise); lets a replica prove it serves the trainer's bytes."""
        return None

    @abc.abstractmethod
    async def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


def check_engine_takes(engine: Engine, payload: RolloutPayload) -> None:
    """Refuse, before it runs, what ``engine`` would not honour: a ``stream_offset`` (a replay's
    segment begun inside a sampled request) where it cannot advance its streams (``NotReplayable``,
    ``multi_span``: its samples would start their streams over, and be another sample)."""
    if payload.stream_offset and engine.name not in STREAM_ADVANCING_ENGINES:
        raise NotReplayable(
            f"the {engine.name} engine cannot advance a sample's stream past {payload.stream_offset} draws "
            "(stream_offset)",
            reason="multi_span",
        )
