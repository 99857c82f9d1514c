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
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rollfleet.runtime.aio import wait_event
from rollfleet.schemas import Completion, EngineBuild, RolloutPayload, SamplingParams, version_spans
from rollfleet.schemas.errors import EngineFailure, InvalidRequest, RollfleetError
from rollfleet.schemas.limits import check_payload
from rollfleet.workers.engines import _kvrows, _weights
from rollfleet.workers.engines._sampling import fresh_seed, make_generator, sample_token
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation, TokenSink, sample_seed
from rollfleet.workers.engines.session_cache import (
    DEFAULT_MAX_BYTES,
    DEFAULT_TTL_S,
    Branch,
    Lookup,
    SessionCache,
    SessionCacheStats,
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
try:
    _TRANSFORMERS_VERSION = package_version("transformers")
except PackageNotFoundError:
    _TRANSFORMERS_VERSION = ""


def _device_kind(device: torch.device) -> str:
    """``cpu``, or ``cuda:`` and the device's name (kernels, and so bits, differ between models)."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_name(device)}"


@dataclass(eq=False)
class _Seq:
    """One sample of one request."""

    req: _Request
    index: int
    tokens: list[int]  # prompt + generated
    gen: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the live version at each generated token
    finish: str | None = None
    cached: int = 0  # prompt tokens whose KV came from the session cache when it joined the batch
    kv_epoch: int = -1  # the weights epoch of the oldest KV in its batch row (-1: never had a row)


@dataclass(eq=False)
class _Request:
    rid: str
    params: SamplingParams
    stops: frozenset[int]
    prompt_len: int
    want_text: bool
    future: asyncio.Future[Generation]
    seqs: list[_Seq] = field(default_factory=list)
    session: str | None = None  # cleared by end_session: nothing is kept for it any more
    alone: bool = False  # deterministic: each sample runs alone, a batch of one, and prefills whole
    seed: int | None = None  # the seed drawn for it when it gave none (its samples: seed + index)
    lookup: Lookup | None = None  # what the session cache gave this turn (taken once)
    sink: TokenSink | None = None  # told each token as it is made (resumable jobs' checkpoints)


@dataclass
class _Batch:
    """KV-cache state owned by the step thread: which sequences the cache rows hold."""

    members: list[_Seq] = field(default_factory=list)
    cache: Any = None
    mask: torch.Tensor | None = None  # [B, width]: 1 where a column holds the KV of one of the row's tokens
    valid: bool = True  # False: the rows' KV is from other weights, rebuild every row


def own_memory(model: Any) -> None:
    """Copy every CPU tensor out of the checkpoint's memory map.

    transformers maps safetensors files on CPU, so the live weights would alias the checkpoint
    files, and the replica's in-place materialization of the next version (while we serve)
    would change them outside any pause. Tied parameters are one object, so they stay tied.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None:
                    setattr(module, name, buf.clone())


def _out_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


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
        each sample alone (a batch of one; see ``_admit``), so its bits never depend on what
        else the replica serves.

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
        self.max_batch = max_batch
        self.seed = seed
        self.deterministic = deterministic
        if deterministic:  # (CUDA's nondeterministic kernels; a no-op for what CPU runs here)
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.stop_on_eos = stop_on_eos
        self.reprefill_after_activation = reprefill_after_activation
        self.attn_implementation = attn_implementation
        self.stage_mode = stage_mode  # "swap" (fastest pause) or "scatter" (least memory)
        self.model: Any = None
        self._cache_kw = "past_key_values"
        self.tokenizer: Any = None
        self.checkpoint_dir: Path | None = None
        # Observability and test hooks.
        self.steps = 0
        self.prefills = 0  # forward passes that prefilled joining sequences
        self.prefill_tokens = 0  # tokens those passes computed (padding excluded)
        self.step_log: deque[tuple[int, int, tuple[str, ...]]] = deque(maxlen=step_log_size)
        self._live: dict[str, torch.Tensor] = {}
        self._names: list[str] = []
        self._eos: frozenset[int] = frozenset()
        self._max_len = 0
        self._vocab = 0
        self._requests: dict[str, _Request] = {}
        self._pending: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._batch = _Batch()
        self._staged: _weights.StagedUpdate | None = None
        self._epoch = 0  # bumps on every activation (staged updates must match it)
        self._kv_epoch = 0  # bumps when an activation changes tensors: KV from before is stale
        self._sessions = SessionCache(session_cache_bytes, session_ttl_s)
        self._rows = True  # whether the model's cache can be assembled from rows (set at load)
        self._seed_counter = itertools.count()
        self._running = asyncio.Event()
        self._running.set()
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-step")
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-stage")
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self._failure: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        if checkpoint_dir is None:
            raise InvalidRequest("the hf engine needs a checkpoint directory")
        self.checkpoint_dir = Path(checkpoint_dir)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load_model, self.checkpoint_dir)
        self.version = version
        self._loop_task = asyncio.create_task(self._run(), name="hf-decode-loop")

    def _load_model(self, checkpoint_dir: Path) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"dtype": self.dtype or "auto", "local_files_only": True}
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), **kwargs)
        model.to(self.device).eval()
        model.requires_grad_(False)
        if self.device.type == "cpu":
            own_memory(model)
        self.model = model
        # transformers 5.x renamed the forward's ``past_key_values`` to ``cache``; accept both.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._rows = _kvrows.supported(model.config)
        self._live = dict(model.state_dict(keep_vars=True))
        stored = list(_weights.tensor_files(checkpoint_dir))
        self._names = [n for n in stored if n in self._live] or list(self._live)
        cfg = model.config
        self._vocab = int(cfg.vocab_size)
        self._max_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self._eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        if any((checkpoint_dir / f).exists() for f in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._running.set()
        self._wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        for req in list(self._requests.values()):
            self._finish_request(req, "abort")
        async with self._step_lock:
            self._batch = _Batch()
            self._staged = None
            self.model = None
            self._live = {}
            self._sessions.clear()
        self._executor.shutdown(wait=True)
        self._stager.shutdown(wait=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def health(self) -> EngineHealth:
        loop_alive = self._loop_task is not None and not self._loop_task.done()
        ok = self.model is not None and loop_alive and not self._closed and self._failure is None
        detail = "closed" if self._closed else (self._failure or ("serving" if ok else "not started"))
        return EngineHealth(
            ok=ok,
            detail=detail,
            extra={
                "version": self.version,
                "device": str(self.device),
                "dtype": str(getattr(self.model, "dtype", self.dtype)),
                "active": len(self._active),
                "pending": len(self._pending),
                "paused": not self._running.is_set(),
                "steps": self.steps,
            },
        )

    # -- requests ----------------------------------------------------------------------------

    async def generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None = None, sink: TokenSink | None = None
    ) -> Generation:
        if self.model is None or self._closed or self._failure is not None:
            raise EngineFailure(self._failure or "the hf engine is not running")
        if request_id in self._requests:
            raise InvalidRequest(f"request {request_id!r} is already running")
        prompt = self._prompt_ids(payload)
        params = payload.sampling
        if len(prompt) + params.max_tokens > self._max_len:
            raise InvalidRequest(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self._max_len} tokens"
            )
        stops = set(params.stop_token_ids)
        if self.stop_on_eos and not payload.extra.get("ignore_eos", False):
            stops |= self._eos
        req = _Request(
            rid=request_id,
            params=params,
            stops=frozenset(stops),
            prompt_len=len(prompt),
            want_text=payload.prompt_text is not None,
            future=asyncio.get_running_loop().create_future(),
            session=session_id if self._rows and self._sessions.max_bytes > 0 else None,
            sink=sink,
            alone=self.deterministic_for(payload),
        )
        seed = params.seed
        if seed is None and params.temperature > 0:
            # One seed per request, recorded in its result (``Generation.seed``): sample i draws
            # ``sample_seed(seed, i)``, as a seeded request's does, so any sample can be drawn again.
            seed = req.seed = fresh_seed() if self.seed is None else (self.seed << 32) + next(self._seed_counter)
        for i in range(payload.n):
            gen = None
            if params.temperature > 0:  # the same stream whether sample i is sent alone or not
                gen = make_generator(sample_seed(seed, i), self.device)
            req.seqs.append(_Seq(req=req, index=i, tokens=list(prompt), gen=gen))
        self._requests[request_id] = req
        self._pending.extend(req.seqs)
        self._wake.set()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            self._finish_request(req, "abort")  # the caller went away: free its batch rows
            raise

    def deterministic_for(self, payload: RolloutPayload) -> bool:
        return self.deterministic or payload.deterministic

    def build(self, deterministic: bool) -> EngineBuild:
        return EngineBuild(
            self.name,
            _TRANSFORMERS_VERSION,
            str(torch.__version__),
            str(getattr(self.model, "dtype", self.dtype) or "").removeprefix("torch."),
            _device_kind(self.device),
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
        check_payload(payload)
        if payload.prompt_token_ids is not None:
            ids = list(payload.prompt_token_ids)
        elif self.tokenizer is None:
            raise InvalidRequest(
                "the hf engine has no tokenizer in its checkpoint dir; send prompt_token_ids instead of prompt_text"
            )
        else:
            ids = list(self.tokenizer.encode(payload.prompt_text or "", add_special_tokens=False))
            if not ids:
                raise InvalidRequest("prompt_text encodes to no tokens")
        if max(ids) >= self._vocab:
            raise InvalidRequest(f"prompt token id {max(ids)} is outside the vocabulary of {self._vocab}")
        bad = [t for t in payload.sampling.stop_token_ids if t >= self._vocab]
        if bad:
            raise InvalidRequest(f"stop token ids {bad} are outside the vocabulary of {self._vocab}")
        return ids

    async def abort(self, request_id: str) -> None:
        """Finish ``request_id`` now with 'abort' (tokens so far are kept), even while paused."""
        req = self._requests.get(request_id)
        if req is not None:
            self._finish_request(req, "abort")

    def _finish_request(self, req: _Request, reason: str) -> None:
        for seq in req.seqs:
            if seq.finish is None:
                seq.finish = reason
                if req.sink is not None:
                    req.sink.finished(seq.index, reason)
        self._complete_if_done(req)

    def _complete_if_done(self, req: _Request) -> None:
        if any(s.finish is None for s in req.seqs) or req.future.done():
            return
        self._requests.pop(req.rid, None)
        ran = [s for s in req.seqs if s.versions]
        v_start = min((s.versions[0] for s in ran), default=self.version)
        v_end = max((s.versions[-1] for s in ran), default=self.version)
        outputs = [
            Completion(
                token_ids=list(s.out),
                finish_reason=s.finish,  # type: ignore[arg-type]
                logprobs=list(s.logprobs) if req.params.logprobs else None,
                text=self.tokenizer.decode(s.out) if req.want_text and self.tokenizer is not None else None,
                weight_versions=version_spans(s.versions),
            )
            for s in req.seqs
        ]
        joined = [s.cached for s in req.seqs if s.kv_epoch >= 0]
        req.future.set_result(
            Generation(
                outputs,
                int(v_start),
                int(v_end),
                prompt_tokens=req.prompt_len,
                cached_tokens=min(joined, default=0),
                cache_rebuilt=req.lookup is not None and req.lookup.stale,
                seed=req.seed,
            )
        )

    async def end_session(self, session_id: str) -> None:
        """Free the session's cached KV; a turn of it still running keeps nothing when it ends."""
        for req in [*self._requests.values(), *(s.req for s in self._batch.members)]:
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

    # -- the decode loop ---------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._decode_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not a bad request: fail everything, report unhealthy
            self._failure = f"decode loop died: {type(exc).__name__}: {exc}"
            for req in list(self._requests.values()):
                self._fail_request(req, EngineFailure(self._failure))

    async def _decode_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            self._active = [s for s in self._active if s.finish is None]
            if not self._active and not self._pending:
                if self._batch.members:  # idle: finished rows go to their sessions now
                    async with self._step_lock:
                        await loop.run_in_executor(self._executor, self._settle)
                    continue
                self._wake.clear()
                if not await wait_event(self._wake, self._sessions.ttl_s):  # idle: sessions still expire
                    self._sessions.expire()
                continue
            await self._running.wait()
            async with self._step_lock:
                if not self._running.is_set() or self._closed:
                    continue  # paused between our check and the lock: do not step
                self._admit()
                batch = self._active[: self.max_batch]
                if not batch:
                    continue
                version = self.version
                try:
                    sampled = await loop.run_in_executor(self._executor, self._step, batch)
                except Exception as exc:  # a failed forward fails its requests, not the engine
                    self._batch = _Batch()
                    err = EngineFailure(f"hf forward failed: {type(exc).__name__}: {exc}")
                    for req in {s.req for s in batch}:
                        self._fail_request(req, err)
                    continue
                self.steps += 1
                self.step_log.append((self.steps, version, tuple(sorted({s.req.rid for s in batch}))))
                for seq, (token, logprob) in zip(batch, sampled, strict=True):
                    self._advance(seq, token, logprob, version)
            await asyncio.sleep(0)  # let abort/pause/new requests in between steps

    def _admit(self) -> None:
        """Pending sequences join the batch in their order. A deterministic one runs alone: it
        waits at the head of the queue until the batch has drained (nothing overtakes it), then
        runs as a batch of one, and nothing joins it until it is done. Alone, its prefill has no
        padding and every matmul the shape of a batch of one, so its bits are those of any other
        run of it alone (a replay's)."""
        self._active = [s for s in self._active if s.finish is None]
        if any(s.req.alone for s in self._active):
            return
        while self._pending and len(self._active) < self.max_batch:
            seq = self._pending[0]
            if seq.finish is not None:
                self._pending.popleft()
                continue
            if seq.req.alone:
                if not self._active:
                    self._active.append(self._pending.popleft())
                return
            self._active.append(self._pending.popleft())

    def _advance(self, seq: _Seq, token: int, logprob: float, version: int) -> None:
        if seq.finish is not None:  # aborted while its step ran
            return
        seq.versions.append(version)
        seq.tokens.append(token)
        seq.out.append(token)
        seq.logprobs.append(logprob)
        req = seq.req
        if token in req.stops:
            seq.finish = "stop"
        elif len(seq.out) >= req.params.max_tokens or len(seq.tokens) >= self._max_len:
            seq.finish = "length"
        if req.sink is not None:
            req.sink.token(seq.index, token, logprob, version)
            if seq.finish is not None:
                req.sink.finished(seq.index, seq.finish)
        if seq.finish is not None:
            self._complete_if_done(req)

    def _fail_request(self, req: _Request, err: RollfleetError) -> None:
        for seq in req.seqs:
            seq.finish = seq.finish or "abort"
        self._requests.pop(req.rid, None)
        if not req.future.done():
            req.future.set_exception(err)

    # -- one step (runs on the step thread) ----------------------------------------------------

    def _settle(self) -> None:
        """Nothing is active: every row leaves (to its session, if any)."""
        try:
            with torch.inference_mode():
                self._release([])
        except Exception:  # losing cached rows is harmless: the next turns prefill
            self._batch = _Batch()

    def _step(self, batch: list[_Seq]) -> list[tuple[int, float]]:
        with torch.inference_mode():
            logits = self._forward(batch)
            return [sample_token(logits[i], seq.req.params, seq.gen) for i, seq in enumerate(batch)]

    def _release(self, batch: list[_Seq]) -> _Batch:
        """Rows of sequences not in ``batch`` leave (their KV kept for their sessions); with KV of
        other weights (``valid`` false) every row leaves."""
        state = self._batch
        wanted = {id(s) for s in batch}
        members = state.members
        if all(id(s) in wanted for s in members) and state.valid:
            return state
        for i, seq in enumerate(members):
            if id(seq) not in wanted:
                self._keep_for_session(state, i, seq)
        kept = [i for i, s in enumerate(members) if id(s) in wanted] if state.valid else []
        if not kept:
            self._batch = _Batch()
            return self._batch
        state.cache, state.mask = _kvrows.select_rows(state.cache, state.mask, kept, compact=self._rows)  # type: ignore[arg-type]
        state.members = [members[i] for i in kept]
        return state

    def _forward(self, batch: list[_Seq]) -> torch.Tensor:
        """Logits of the next token of every sequence in ``batch`` (in that order)."""
        state = self._release(batch)
        rows = {id(s) for s in state.members}
        joiners = [s for s in batch if id(s) not in rows]
        if joiners and state.members and not self._rows:  # cannot merge rows: prefill everyone again
            joiners, state = batch, _Batch()
            self._batch = state
        logits: dict[int, torch.Tensor] = {}
        if state.members:
            logits.update(zip(map(id, state.members), self._decode(state), strict=True))
        if joiners:
            seqs, cache, mask, out = self._prefill(joiners)
            logits.update(zip(map(id, seqs), out, strict=True))
            if state.members:
                cache, mask = _kvrows.merge(state.cache, state.mask, cache, mask)  # type: ignore[arg-type]
            state.cache, state.mask, state.members = cache, mask, [*state.members, *seqs]
        return torch.stack([logits[id(s)] for s in batch])

    def _decode(self, state: _Batch) -> torch.Tensor:
        """One token for every row: the last token of each sequence is not in the cache yet."""
        ids = torch.tensor([[s.tokens[-1]] for s in state.members], device=self.device)
        pos = state.mask.sum(dim=1, keepdim=True)  # type: ignore[union-attr]
        mask = F.pad(state.mask, (0, 1), value=1)  # type: ignore[arg-type]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: state.cache},
        )
        state.cache, state.mask = _out_cache(out), mask
        return out.logits[:, -1, :].float()

    def _prefill(self, joiners: list[_Seq]) -> tuple[list[_Seq], Any, torch.Tensor, torch.Tensor]:
        """Prefill ``joiners`` on rows of their own: what their session cache holds is reused, the
        rest computed in one pass (samples of one request that join together share one row, copied
        afterwards). Returns the sequences in row order, their cache, mask and next-token logits."""
        groups: dict[int, list[_Seq]] = {}
        for seq in joiners:
            fresh = not seq.out  # all samples of a request start from the same prompt
            groups.setdefault(id(seq.req) if fresh else id(seq), []).append(seq)
        self._sessions.expire()  # idle sessions expire on time, even when only other traffic runs
        items = [(seqs, self._reusable(seqs[0])) for seqs in groups.values()]
        self.prefills += 1
        self.prefill_tokens += sum(len(seqs[0].tokens) - n for seqs, (_, n) in items)
        suffixes = [seqs[0].tokens[n:] for seqs, (_, n) in items]
        width = max(len(t) for t in suffixes)
        ids = torch.zeros((len(items), width), dtype=torch.long)
        in_mask = torch.zeros((len(items), width), dtype=torch.long)
        for r, tokens in enumerate(suffixes):  # right-aligned: the last column is every row's last token
            ids[r, width - len(tokens) :] = torch.tensor(tokens)
            in_mask[r, width - len(tokens) :] = 1
        ids, in_mask = ids.to(self.device), in_mask.to(self.device)
        kwargs: dict[str, Any] = {}
        mask = in_mask
        if any(n for _, (_, n) in items):
            past, past_mask = _kvrows.past([reuse for _, reuse in items], self.device)
            kwargs[self._cache_kw] = past
            mask = torch.cat([past_mask, in_mask], dim=1)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -width:]
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kwargs
        )
        cache, logits = _out_cache(out), out.logits[:, -1, :].float()
        order = [r for r, (seqs, _) in enumerate(items) for _ in seqs]
        if order != list(range(len(items))):
            cache, mask = _kvrows.select_rows(cache, mask, order, compact=self._rows)
            logits = logits[torch.tensor(order, device=logits.device)]
        seqs = [seq for group, _ in items for seq in group]
        for seq, (_, n) in zip(seqs, (items[r][1] for r in order), strict=True):
            seq.kv_epoch = self._kv_epoch
            seq.cached = seq.cached or n
        for req in {id(s.req): s.req for s in seqs}.values():
            lookup = req.lookup
            joined = all(s.kv_epoch >= 0 or s.finish is not None for s in req.seqs)
            if lookup is not None and lookup.branch is not None and joined:
                req.lookup = Lookup(cached=lookup.cached, stale=lookup.stale)  # every sample joined: free the KV
        return seqs, cache, mask, logits

    def _reusable(self, seq: _Seq) -> tuple[_kvrows.KV, int]:
        """The session KV ``seq`` can start from (and how many of its tokens it covers)."""
        req = seq.req
        if seq.out or req.session is None or req.alone:  # (alone: prefilled whole, as a replay is)
            return [], 0
        if req.lookup is None:  # once per turn: samples admitted later reuse what the first got
            req.lookup = self._sessions.take(req.session, seq.tokens, self._kv_epoch)
        branch = req.lookup.branch
        if branch is None or branch.epoch != self._kv_epoch:
            return [], 0
        return branch.kv, req.lookup.cached

    def _keep_for_session(self, state: _Batch, i: int, seq: _Seq) -> None:
        """Row ``i`` leaves the batch: keep its KV for the next turn of its session."""
        req = seq.req
        if req.session is None or seq.kv_epoch < 0 or state.mask is None:
            return
        n = int(state.mask[i].sum())
        tokens = seq.tokens[:n]
        if seq.kv_epoch != self._kv_epoch:  # computed (partly) on other weights: only say so
            self._sessions.add(req.session, Branch(tokens=(), epoch=seq.kv_epoch))
            return
        kv = _kvrows.row(state.cache, state.mask, i)
        self._sessions.add(req.session, Branch(tokens=tokens, epoch=seq.kv_epoch, kv=kv, nbytes=_kvrows.nbytes(kv)))

    # -- pause and weights ---------------------------------------------------------------------

    async def pause(self) -> None:
        self._running.clear()
        async with self._step_lock:  # wait for the step in progress, if any
            pass

    async def resume(self) -> None:
        self._running.set()
        self._wake.set()

    async def prepare_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """While serving: read ``changed`` from ``checkpoint_dir`` and stage, on the engine's device,
        the elements that differ from the live weights. ``changed`` is relative to the live version."""
        if checkpoint_dir is None or self.model is None:
            return
        names, epoch = tuple(changed), self._epoch
        _weights.live_names(names, self._live)

        def work() -> _weights.StagedUpdate:
            new = _weights.read_tensors(Path(checkpoint_dir), names)
            stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
            return _weights.stage(self._live, new, version, epoch, self.device, stream, self.stage_mode)

        self._staged = None  # a newer preparation replaces an older one
        staged = await asyncio.get_running_loop().run_in_executor(self._stager, work)
        if self._epoch == epoch:
            self._staged = staged

    async def load_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """Paused: make ``version`` live by copying only ``changed`` into the live parameters.

        Uses the staged update when it matches (same version, names and live weights), else reads
        the tensors from ``checkpoint_dir``. Everything is validated before the first byte moves.
        """
        if self.model is None:
            raise EngineFailure("the hf engine is not running")
        names = tuple(changed)
        staged = self._staged
        usable = (
            staged is not None
            and staged.version == version
            and set(staged.names) == set(names)
            and staged.epoch == self._epoch
        )
        loop = asyncio.get_running_loop()
        async with self._step_lock:
            if usable:
                await loop.run_in_executor(self._executor, self._apply_staged, staged)
            elif names:
                if checkpoint_dir is None:
                    raise InvalidRequest("load_weights needs a checkpoint dir for unstaged tensors")
                _weights.live_names(names, self._live)
                new = await loop.run_in_executor(self._stager, _weights.read_tensors, Path(checkpoint_dir), names)
                await loop.run_in_executor(self._executor, self._copy_in, new)
            self._staged = None
            self._epoch += 1
            if names:
                self._kv_epoch += 1
                self._sessions.invalidate(self._kv_epoch)  # never reuse KV of other weights
                if self.reprefill_after_activation:
                    self._batch.valid = False
            self.version = version

    def _apply_staged(self, staged: _weights.StagedUpdate) -> None:
        staged.apply()
        self._sync()

    def _copy_in(self, new: dict[str, torch.Tensor]) -> None:
        _weights.copy_into(self._live, new)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pause must include the copies it started

    # -- inspection ----------------------------------------------------------------------------

    def live_checksums(self, names: Sequence[str] | None = None, fmt: str = "xxh3-128") -> dict[str, str]:
        """Checksum of each live parameter's raw bytes under its HF name (default: every tensor
        the checkpoint stores), comparable with the policy store's per-tensor checksums."""
        wanted = list(names) if names is not None else self._names
        _weights.live_names(wanted, self._live)
        return {name: _weights.checksum(self._live[name], fmt) for name in wanted}

    def live_tensor(self, name: str) -> torch.Tensor:
        """The live parameter ``name`` (read only; for tests and benchmarks)."""
        return self._live[name].detach()

    @property
    def tensor_names(self) -> list[str]:
        """The tensor names the checkpoint stores (tied parameters under their stored name)."""
        return list(self._names)

    @property
    def staged_bytes(self) -> int:
        return self._staged.staged_bytes if self._staged is not None else 0
