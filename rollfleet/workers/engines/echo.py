"""A model-free engine: deterministic output after a configurable latency.

Used for queue benchmarks and tests of the request path. Output token ``i`` is
``(sum(prompt) + i) % vocab``; log-probs are 0.0 so callers can exercise the full result.
With ``keyed=True`` each token is instead a function of the weights the engine holds (read
from its checkpoint at start and at every activation), the context and the sample's stream
(``engines.keyed``), so that the reliability oracle can tell which weights served a label.

Sessions, so routing tests and benchmarks can observe affinity without a model: with
``prefill_s_per_token``, a request first sleeps that long per prompt token it would have to
prefill. A turn of a session keeps its tokens (what a real engine would hold the KV of: the
prompt and all output tokens but the last) in a ``SessionCache`` like the hf engine's, charged 4
bytes a token; the session's next turn pays only for the prompt tokens past the common prefix
and reports them in ``cached_tokens``. An activation makes the cache stale (``cache_rebuilt``).

With ``startup_s``, ``start`` takes that long, as a GPU server's start does (loading weights,
capturing graphs: tens of seconds), so that benchmarks of the fleet's size see replicas that are
not serving the moment they are launched. The worker is registered ``starting`` meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

import numpy as np

from rollfleet.policy_store import CheckpointLayout, tensor_checksum
from rollfleet.schemas import Completion, EngineBuild, RolloutPayload, VersionSpan, version_spans
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation, TokenSink
from rollfleet.workers.engines.keyed import VOCAB, context_state, keyed_token, keyed_tokens, weights_key
from rollfleet.workers.engines.session_cache import DEFAULT_TTL_S, Branch, Lookup, SessionCache, SessionCacheStats

_TOKEN_BYTES = 4
try:
    _ROLLFLEET_VERSION = package_version("rollfleet")
except PackageNotFoundError:  # (run from a checkout that was never installed)
    _ROLLFLEET_VERSION = ""


class EchoEngine(Engine):
    name = "echo"

    def __init__(
        self,
        latency_s: float = 0.0,
        per_token_s: float = 0.0,
        vocab: int = VOCAB,
        *,
        prefill_s_per_token: float = 0.0,
        session_cache_bytes: int = 64 * 1024**2,
        session_ttl_s: float = DEFAULT_TTL_S,
        streams_tokens: bool = True,
        keyed: bool = False,
        startup_s: float = 0.0,
    ) -> None:
        super().__init__()
        if not startup_s >= 0:
            raise InvalidRequest(f"the echo engine's start-up delay must be >= 0 seconds, got {startup_s}")
        self.startup_s = startup_s
        # False: behaves as an HTTP engine that answers whole requests (resumable jobs run in segments)
        self.streams_tokens = streams_tokens
        self.latency_s = latency_s
        self.per_token_s = per_token_s
        self.vocab = vocab
        self.prefill_s_per_token = prefill_s_per_token
        self.prefill_tokens = 0  # prompt tokens "prefilled" (not served from a session's cache)
        self._sessions = SessionCache(session_cache_bytes, session_ttl_s)
        self._running = asyncio.Event()
        self._running.set()
        self._aborted: set[str] = set()
        self._active: set[str] = set()  # the requests generating now (what an abort can reach)
        self._closed = False
        self._weights: dict[str, bytes] = {}  # every tensor's bytes, when started on a checkpoint
        self.keyed = keyed
        self._key = b""  # keyed: weights_key of ``_weights``, recomputed whenever they change

    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        if self.keyed and checkpoint_dir is None:
            raise InvalidRequest("a keyed echo engine needs weights to key its tokens: --store or --model-dir")
        self.version = version
        if self.startup_s:
            await asyncio.sleep(self.startup_s)
        if checkpoint_dir is not None:
            self._weights = await asyncio.to_thread(_read_tensors, checkpoint_dir, None)
            if self.keyed:
                self._key = await asyncio.to_thread(weights_key, self._weights)

    async def generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None = None, sink: TokenSink | None = None
    ) -> Generation:
        self._active.add(request_id)
        try:
            return await self._generate(request_id, payload, session_id, sink)
        finally:
            self._active.discard(request_id)
            self._aborted.discard(request_id)

    async def _generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None, sink: TokenSink | None
    ) -> Generation:
        await self._running.wait()
        prompt = self.prompt_ids(payload)
        if not self.streams_tokens:
            sink = None
        lookup = None
        if session_id is not None and self._sessions.max_bytes > 0:
            lookup = self._sessions.take(session_id, prompt, self.version)
        cached = lookup.cached if lookup else 0
        self.prefill_tokens += len(prompt) - cached
        if self.latency_s or self.prefill_s_per_token:
            await asyncio.sleep(self.latency_s + self.prefill_s_per_token * (len(prompt) - cached))
        if not self.per_token_s and self._running.is_set() and request_id not in self._aborted:
            # Nothing can pause or abort it between steps (no step awaits): every token is made
            # at once, at the live version; the same outputs as the step loop below.
            base = sum(prompt)
            outputs = [self._sample_at_once(base + sample, payload, prompt, sample) for sample in range(payload.n)]
            for i, out in enumerate(outputs if sink is not None else ()):
                for tok in out.token_ids:
                    sink.token(i, tok, 0.0, self.version)
                sink.finished(i, out.finish_reason)
        else:
            outputs = await self._step(request_id, prompt, payload, sink)
        return self._finish(outputs, prompt, session_id, lookup)

    def prompt_ids(self, payload: RolloutPayload) -> list[int]:
        if payload.prompt_token_ids is not None:
            return list(payload.prompt_token_ids)
        return list((payload.prompt_text or "").encode())

    def detokenize(self, token_ids: list[int]) -> str:
        return bytes(t % 256 for t in token_ids).decode("latin-1")

    async def _step(
        self, request_id: str, prompt: list[int], payload: RolloutPayload, sink: TokenSink | None
    ) -> list[Completion]:
        outputs: list[Completion] = []
        stops = set(payload.sampling.stop_token_ids)
        for sample in range(payload.n):
            tokens: list[int] = []
            versions: list[int] = []
            context = context_state(prompt) if self.keyed else b""  # keyed: the prompt and the tokens so far
            finish = "length"
            for i in range(payload.sampling.max_tokens):
                if not self._running.is_set():
                    await self._running.wait()  # a pause lands between steps, as in a real engine
                if request_id in self._aborted:
                    finish = "abort"
                    break
                if self.per_token_s:
                    await asyncio.sleep(self.per_token_s)
                if self.keyed:
                    tok = keyed_token(
                        self._key,
                        context,
                        seed=payload.sampling.seed,
                        sample=sample,
                        first=not tokens,
                        vocab=self.vocab,
                    )
                    context = context_state((tok,), context)
                else:
                    tok = (sum(prompt) + sample + i) % self.vocab
                tokens.append(tok)
                versions.append(self.version)
                if sink is not None:
                    sink.token(sample, tok, 0.0, self.version)
                if tok in stops:
                    finish = "stop"
                    break
            if sink is not None:
                sink.finished(sample, finish)
            text = self.detokenize(tokens) if payload.prompt_text is not None else None
            outputs.append(
                Completion(
                    token_ids=tokens,
                    finish_reason=finish,  # type: ignore[arg-type]
                    logprobs=[0.0] * len(tokens) if payload.sampling.logprobs else None,
                    text=text,
                    weight_versions=version_spans(versions),
                )
            )
        return outputs

    def _finish(
        self, outputs: list[Completion], prompt: list[int], session_id: str | None, lookup: Lookup | None
    ) -> Generation:
        ran = [c.weight_versions for c in outputs if c.weight_versions]
        version_start = min((w[0].version for w in ran), default=self.version)
        version_end = max((w[-1].version for w in ran), default=self.version)
        if lookup is not None and session_id is not None:
            for c in outputs:  # "computed" on the version of its last token, as a real engine's KV
                held = prompt + c.token_ids[:-1]
                epoch = c.weight_versions[-1].version if c.weight_versions else self.version
                self._sessions.add(session_id, Branch(tokens=held, epoch=epoch, nbytes=_TOKEN_BYTES * len(held)))
        return Generation(
            outputs,
            version_start,
            version_end,
            prompt_tokens=len(prompt),
            cached_tokens=lookup.cached if lookup else 0,
            cache_rebuilt=lookup is not None and lookup.stale,
        )

    async def end_session(self, session_id: str) -> None:
        self._sessions.drop(session_id)

    def deterministic_for(self, payload: RolloutPayload) -> bool:
        return True  # every token is a pure function of the prompt, the seed and the weights held

    def build(self, deterministic: bool) -> EngineBuild:
        return EngineBuild(self.name, _ROLLFLEET_VERSION, deterministic=deterministic)

    def session_cache_stats(self) -> SessionCacheStats:
        return self._sessions.stats()

    def _sample_at_once(self, base: int, payload: RolloutPayload, prompt: list[int], sample: int) -> Completion:
        """One sample (``base``: the prompt's sum plus the sample's index) with no step boundary
        to honour: the same tokens, versions and finish as the step loop, computed in one go."""
        vocab, count = self.vocab, payload.sampling.max_tokens
        if self.keyed:
            tokens = keyed_tokens(self._key, prompt, count, seed=payload.sampling.seed, sample=sample, vocab=vocab)
        else:
            tokens = [(base + i) % vocab for i in range(count)]
        finish = "length"
        stops = set(payload.sampling.stop_token_ids)
        if stops:
            hit = next((i for i, tok in enumerate(tokens) if tok in stops), None)
            if hit is not None:
                tokens, finish = tokens[: hit + 1], "stop"
        text = self.detokenize(tokens) if payload.prompt_text is not None else None
        return Completion(
            token_ids=tokens,
            finish_reason=finish,  # type: ignore[arg-type]
            logprobs=[0.0] * len(tokens) if payload.sampling.logprobs else None,
            text=text,
            weight_versions=[VersionSpan(version=self.version, start=0, end=len(tokens))] if tokens else [],
        )

    async def pause(self) -> None:
        self._running.clear()

    async def load_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        if checkpoint_dir is not None and self._weights and changed:
            self._weights.update(await asyncio.to_thread(_read_tensors, checkpoint_dir, set(changed)))
            if self.keyed:  # the key follows the bytes now held, whatever the version is called
                self._key = await asyncio.to_thread(weights_key, self._weights)
        self.version = version
        self._sessions.invalidate(version)

    def live_checksums(self) -> dict[str, str] | None:
        if not self._weights:
            return None
        return {name: tensor_checksum(np.frombuffer(b, np.uint8), "xxh3-128") for name, b in self._weights.items()}

    async def resume(self) -> None:
        self._running.set()

    async def abort(self, request_id: str) -> None:
        # Only a request generating now, as real engines do: a mark left for one that ended (or
        # had not begun) aborted the next run of the same job on this replica at once, and a
        # resumable job was answered with an empty "abort" sample (campaign 9, seed 389).
        if request_id in self._active:
            self._aborted.add(request_id)

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=not self._closed, detail="echo")

    async def close(self) -> None:
        self._closed = True
        self._running.set()


def _read_tensors(checkpoint_dir: Path, names: set[str] | None) -> dict[str, bytes]:
    """The raw bytes of the checkpoint's tensors (``names`` only, when given)."""
    out: dict[str, bytes] = {}
    for name, loc in CheckpointLayout.read(checkpoint_dir).tensors.items():
        if names is None or name in names:
            with open(loc.file, "rb") as f:
                f.seek(loc.offset)
                out[name] = f.read(loc.nbytes)
    return out
