"""The hf engine: transformers + torch on CPU or CUDA, serving a host-local checkpoint dir.

One background decode loop advances every active sequence by one token per iteration, as
one batch with one KV cache. The forward pass runs on a dedicated worker thread so the event
loop (NATS heartbeats) stays responsive. A pause lands between steps: the loop checks the
pause flag under the step lock, so ``pause()`` returns once the current step finished and no
step runs until ``resume()``.

The batch's KV cache is assembled from per-sequence rows (``_kvrows``): a sequence that joins
is prefilled on its own rows (only the part of its prompt not already cached) and its rows are
merged into the running batch, whose members keep their KV; a sequence that leaves gives its
row back. A mask says which columns of a row hold its tokens' KV, so rows of different lengths
and reused prefixes line up without recomputing anyone. Sessions (``generate(session_id=...)``):
when a turn finishes, its rows' KV is kept in a ``SessionCache`` (bounded by bytes and idle time,
LRU); the session's next turn, whose prompt starts with those tokens, prefills only the rest.
KV is tagged with the weights it was computed on and never reused across an activation: the
turn after one rebuilds its session's cache on the new weights and reports ``cache_rebuilt``.

Activation copies only the changed tensors into the live parameters. ``prepare_weights``
(while serving) reads them, uploads them to the device and keeps only the elements that
differ from the live weights; ``load_weights`` (paused) then does device-side copies of
those elements only. By default the KV cache is rebuilt after an activation, so every token
sampled after it, and its log-prob, comes from the new weights given the whole context.

Log-probabilities follow ``_sampling``'s rule: ``log_softmax(logits / T)`` of the sampled
token, before top-k/top-p truncation (``T = 1`` for greedy).

``HFEngine`` is the engine interface over its parts, each in a module of its own:
``hf_loading`` (model and tokenizer from the checkpoint dir), ``hf_requests`` (a request's
samples and the pure rules over them), ``hf_scheduler`` (the request table: waiting, running,
finished), ``hf_decode_loop`` (the loop and its pause), ``hf_batch`` (the forward passes and the
batch's KV rows, on the step thread) and ``hf_live_weights`` (the live parameters and the staged
update).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rollfleet.schemas import EngineBuild, RolloutPayload
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.workers.engines import hf_requests
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation, TokenSink, fresh_seed
from rollfleet.workers.engines.hf_batch import BatchStepper
from rollfleet.workers.engines.hf_decode_loop import DecodeLoop
from rollfleet.workers.engines.hf_live_weights import LiveWeights
from rollfleet.workers.engines.hf_loading import TRANSFORMERS_VERSION, device_kind, load_model
from rollfleet.workers.engines.hf_requests import HFRequest
from rollfleet.workers.engines.hf_scheduler import RequestScheduler
from rollfleet.workers.engines.session_cache import DEFAULT_MAX_BYTES, DEFAULT_TTL_S, SessionCache, SessionCacheStats


class HFEngine(Engine):
    name = "hf"
    streams_tokens = True

    def __init__(
        self,
        device: str = "auto",
        dtype: str | None = None,
        max_batch: int = 32,
        seed: int | None = None,
        *,
        stop_on_eos: bool = True,
        reprefill_after_activation: bool = True,
        attn_implementation: str | None = None,
        step_log_size: int = 4096,
        stage_mode: str = "swap",
        session_cache_bytes: int = DEFAULT_MAX_BYTES,
        session_ttl_s: float = DEFAULT_TTL_S,
        deterministic: bool = False,
    ) -> None:
        """``deterministic``: every request runs as a request with ``deterministic`` set does,
        each sample alone (a batch of one; see ``hf_requests.admit``), so its bits never depend
        on what else the replica serves.

        ``session_cache_bytes`` and ``session_ttl_s`` bound the KV kept for sessions between
        turns (on the engine's device); ``session_cache_bytes=0`` keeps none.

        ``seed``: None (the default, and what workers use) draws each unseeded job's samples
        from fresh entropy. An int makes this engine's unseeded jobs reproducible, for tests of
        one engine only: replicas given the same one draw the same samples. A job's own
        ``SamplingParams.seed`` is reproducible either way."""
        super().__init__()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = dtype
        self.seed = seed
        self.deterministic = deterministic
        if deterministic:  # (CUDA's nondeterministic kernels; a no-op for what CPU runs here)
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.stop_on_eos = stop_on_eos
        self.reprefill_after_activation = reprefill_after_activation
        self.attn_implementation = attn_implementation
        self.stage_mode = stage_mode  # "swap" (fastest pause) or "scatter" (least memory)
        self.model: Any = None
        self.tokenizer: Any = None
        self.checkpoint_dir: Path | None = None
        self._eos: frozenset[int] = frozenset()
        self._max_len = 0
        self._vocab = 0
        self._queue = RequestScheduler(lambda req: hf_requests.generation(req, self.version, self.tokenizer))
        self._sessions = SessionCache(session_cache_bytes, session_ttl_s)
        self._stepper = BatchStepper(self.device, self._sessions)  # used on the step thread only
        self._weights = LiveWeights(self.device)
        self._seed_counter = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-step")
        parts = (self._queue, self._stepper, self._sessions, self._executor)
        self._loop = DecodeLoop(self, *parts, max_batch=max_batch, step_log_size=step_log_size)
        self._closed = False

    @property
    def max_batch(self) -> int:
        return self._loop.max_batch

    @property
    def steps(self) -> int:
        """Forward passes of the batch so far (observability and test hooks, with ``step_log``)."""
        return self._loop.steps

    @property
    def step_log(self) -> deque[tuple[int, int, tuple[str, ...]]]:
        """Recent steps: (step, the live version, the ids of the requests in the batch)."""
        return self._loop.step_log

    @property
    def prefills(self) -> int:
        """Forward passes that prefilled joining sequences."""
        return self._stepper.prefills

    @property
    def prefill_tokens(self) -> int:
        """Tokens those passes computed (padding excluded)."""
        return self._stepper.prefill_tokens

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        if checkpoint_dir is None:
            raise InvalidRequest("the hf engine needs a checkpoint directory")
        self.checkpoint_dir = Path(checkpoint_dir)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load_model, self.checkpoint_dir)
        self.version = version
        self._loop.start()

    def _load_model(self, checkpoint_dir: Path) -> None:
        loaded = load_model(checkpoint_dir, self.device, self.dtype, self.attn_implementation)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self._stepper.load(loaded.model, loaded.cache_kw, loaded.rows)
        self._weights.attach(loaded.model, loaded.stored)
        self._vocab, self._max_len, self._eos = loaded.vocab, loaded.max_len, loaded.eos
        self._loop.max_len = loaded.max_len

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._loop.stop()
        for req in list(self._queue.requests.values()):
            self._queue.finish(req, "abort")
        async with self._loop.step_lock:
            self._stepper.reset()
            self._weights.clear()
            self.model = None
            self._sessions.clear()
        self._executor.shutdown(wait=True)
        self._weights.shutdown()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def health(self) -> EngineHealth:
        failure = self._loop.failure
        ok = self.model is not None and self._loop.alive and not self._closed and failure is None
        detail = "closed" if self._closed else (failure or ("serving" if ok else "not started"))
        return EngineHealth(
            ok=ok,
            detail=detail,
            extra={
                "version": self.version,
                "device": str(self.device),
                "dtype": str(getattr(self.model, "dtype", self.dtype)),
                "active": len(self._queue.active),
                "pending": len(self._queue.pending),
                "paused": not self._loop.running.is_set(),
                "steps": self.steps,
            },
        )

    # -- requests ----------------------------------------------------------------------------

    async def generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None = None, sink: TokenSink | None = None
    ) -> Generation:
        if self.model is None or self._closed or self._loop.failure is not None:
            raise EngineFailure(self._loop.failure or "the hf engine is not running")
        if request_id in self._queue.requests:
            raise InvalidRequest(f"request {request_id!r} is already running")
        req = self._new_request(request_id, payload, session_id, sink)
        self._queue.add(req)
        self._loop.wake.set()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            self._queue.finish(req, "abort")  # the caller went away: free its batch rows
            raise

    def _new_request(
        self, request_id: str, payload: RolloutPayload, session_id: str | None, sink: TokenSink | None
    ) -> HFRequest:
        prompt = self._prompt_ids(payload)
        return hf_requests.new_request(
            request_id,
            payload,
            prompt,
            max_len=self._max_len,
            eos=self._eos if self.stop_on_eos and not payload.extra.get("ignore_eos", False) else frozenset(),
            draw_seed=self._draw_seed,
            session=session_id if self._stepper.rows and self._sessions.max_bytes > 0 else None,
            alone=self.deterministic_for(payload),
            sink=sink,
            device=self.device,
        )

    def _draw_seed(self) -> int:
        return fresh_seed() if self.seed is None else (self.seed << 32) + next(self._seed_counter)

    def deterministic_for(self, payload: RolloutPayload) -> bool:
        return self.deterministic or payload.deterministic

    def build(self, deterministic: bool) -> EngineBuild:
        return EngineBuild(
            self.name,
            TRANSFORMERS_VERSION,
            str(torch.__version__),
            str(getattr(self.model, "dtype", self.dtype) or "").removeprefix("torch."),
            device_kind(self.device),
            deterministic,
        )

    def prompt_ids(self, payload: RolloutPayload) -> list[int] | None:
        try:
            return self._prompt_ids(payload)
        except InvalidRequest:
            return None

    def detokenize(self, token_ids: list[int]) -> str | None:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else None

    def _prompt_ids(self, payload: RolloutPayload) -> list[int]:
        return hf_requests.prompt_ids(payload, self.tokenizer, self._vocab)

    async def abort(self, request_id: str) -> None:
        """Finish ``request_id`` now with 'abort' (tokens so far are kept), even while paused."""
        req = self._queue.requests.get(request_id)
        if req is not None:
            self._queue.finish(req, "abort")

    async def end_session(self, session_id: str) -> None:
        """Free the session's cached KV; a turn of it still running keeps nothing when it ends."""
        for req in [*self._queue.requests.values(), *(s.req for s in self._stepper.batch.members)]:
            if req.session == session_id:
                req.session = None
        try:
            # On the step thread, after any step in progress: a turn that ended just before
            # cannot add its rows back behind our back.
            await asyncio.get_running_loop().run_in_executor(self._executor, self._sessions.drop, session_id)
        except RuntimeError:  # closed: the step thread takes no more work
            self._sessions.drop(session_id)

    def session_cache_stats(self) -> SessionCacheStats:
        return self._sessions.stats()

    # -- pause and weights ---------------------------------------------------------------------

    async def pause(self) -> None:
        await self._loop.pause()

    async def resume(self) -> None:
        self._loop.resume()

    async def prepare_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """While serving: read ``changed`` from ``checkpoint_dir`` and stage, on the engine's device,
        the elements that differ from the live weights. ``changed`` is relative to the live version."""
        if checkpoint_dir is None or self.model is None:
            return
        await self._weights.prepare(Path(checkpoint_dir), changed, version, self.stage_mode)

    async def load_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """Paused: make ``version`` live by copying only ``changed`` into the live parameters.

        Uses the staged update when it matches (same version, names and live weights), else reads
        the tensors from ``checkpoint_dir``. Everything is validated before the first byte moves.
        """
        if self.model is None:
            raise EngineFailure("the hf engine is not running")
        names = tuple(changed)
        staged = self._weights.staged_for(names, version)
        loop = asyncio.get_running_loop()
        async with self._loop.step_lock:
            if staged is not None:
                await loop.run_in_executor(self._executor, self._weights.apply_staged, staged)
            elif names:
                if checkpoint_dir is None:
                    raise InvalidRequest("load_weights needs a checkpoint dir for unstaged tensors")
                new = await self._weights.read(Path(checkpoint_dir), names)
                await loop.run_in_executor(self._executor, self._weights.copy_in, new)
            self._weights.activated()
            if names:
                self._stepper.kv_epoch += 1
                self._sessions.invalidate(self._stepper.kv_epoch)  # never reuse KV of other weights
                if self.reprefill_after_activation:
                    self._stepper.batch.valid = False
            self.version = version

    # -- inspection ----------------------------------------------------------------------------

    def live_checksums(self, names: Sequence[str] | None = None, fmt: str = "xxh3-128") -> dict[str, str]:
        """Checksum of each live parameter's raw bytes under its HF name (default: every tensor
        the checkpoint stores), comparable with the policy store's per-tensor checksums."""
        return self._weights.checksums(names, fmt)

    def live_tensor(self, name: str) -> torch.Tensor:
        """The live parameter ``name`` (read only; for tests and benchmarks)."""
        return self._weights.live[name].detach()

    @property
    def tensor_names(self) -> list[str]:
        """The tensor names the checkpoint stores (tied parameters under their stored name)."""
        return list(self._weights.names)

    @property
    def staged_bytes(self) -> int:
        return self._weights.staged_bytes
