"""A model-free engine: deterministic output after a configurable latency.

Used for queue benchmarks and tests of the request path. Output token ``i`` is
``(sum(prompt) + i) % vocab``; log-probs are 0.0 so callers can exercise the full result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from rollfleet.schemas import Completion, RolloutPayload, VersionSpan, version_spans
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation


class EchoEngine(Engine):
    name = "echo"

    def __init__(self, latency_s: float = 0.0, per_token_s: float = 0.0, vocab: int = 32_000) -> None:
        super().__init__()
        self.latency_s = latency_s
        self.per_token_s = per_token_s
        self.vocab = vocab
        self._running = asyncio.Event()
        self._running.set()
        self._aborted: set[str] = set()
        self._closed = False

    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        self.version = version

    async def generate(self, request_id: str, payload: RolloutPayload) -> Generation:
        await self._running.wait()
        if payload.prompt_token_ids is not None:
            prompt = list(payload.prompt_token_ids)
        else:
            prompt = list((payload.prompt_text or "").encode())
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if not self.per_token_s and self._running.is_set() and request_id not in self._aborted:
            # Nothing can pause or abort it between steps (no step awaits): every token is made
            # at once, at the live version; the same outputs as the step loop below.
            base = sum(prompt)
            samples = [self._sample_at_once(base + sample, payload) for sample in range(payload.n)]
            return Generation(samples, self.version, self.version, prompt_tokens=len(prompt))
        outputs: list[Completion] = []
        stops = set(payload.sampling.stop_token_ids)
        for sample in range(payload.n):
            tokens: list[int] = []
            versions: list[int] = []
            finish = "length"
            for i in range(payload.sampling.max_tokens):
                if not self._running.is_set():
                    await self._running.wait()  # a pause lands between steps, as in a real engine
                if request_id in self._aborted:
                    finish = "abort"
                    break
                if self.per_token_s:
                    await asyncio.sleep(self.per_token_s)
                tok = (sum(prompt) + sample + i) % self.vocab
                tokens.append(tok)
                versions.append(self.version)
                if tok in stops:
                    finish = "stop"
                    break
            text = bytes(t % 256 for t in tokens).decode("latin-1") if payload.prompt_text is not None else None
            outputs.append(
                Completion(
                    token_ids=tokens,
                    finish_reason=finish,  # type: ignore[arg-type]
                    logprobs=[0.0] * len(tokens) if payload.sampling.logprobs else None,
                    text=text,
                    weight_versions=version_spans(versions),
                )
            )
        self._aborted.discard(request_id)
        ran = [c.weight_versions for c in outputs if c.weight_versions]
        version_start = min((w[0].version for w in ran), default=self.version)
        version_end = max((w[-1].version for w in ran), default=self.version)
        return Generation(outputs, version_start, version_end, prompt_tokens=len(prompt))

    def _sample_at_once(self, base: int, payload: RolloutPayload) -> Completion:
        """One sample (``base``: the prompt's sum plus the sample's index) with no step boundary
        to honour: the same tokens, versions and finish as the step loop, computed in one go."""
        vocab = self.vocab
        tokens = [(base + i) % vocab for i in range(payload.sampling.max_tokens)]
        finish = "length"
        stops = set(payload.sampling.stop_token_ids)
        if stops:
            hit = next((i for i, tok in enumerate(tokens) if tok in stops), None)
            if hit is not None:
                tokens, finish = tokens[: hit + 1], "stop"
        text = bytes(t % 256 for t in tokens).decode("latin-1") if payload.prompt_text is not None else None
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
        self.version = version

    async def resume(self) -> None:
        self._running.set()

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=not self._closed, detail="echo")

    async def close(self) -> None:
        self._closed = True
        self._running.set()
