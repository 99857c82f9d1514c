"""The hf engine: transformers + torch on CPU or CUDA, serving a host-local checkpoint dir.

One background decode loop advances every active sequence by one token per iteration, as
one left-padded batch with a KV cache. The forward pass runs on a dedicated worker thread
so the event loop (NATS heartbeats) stays responsive. A pause lands between steps: the
loop checks the pause flag under the step lock, so ``pause()`` returns once the current
step finished and no step runs until ``resume()``.

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
from pathlib import Path
from typing import Any

import torch

from rollfleet.schemas import Completion, RolloutPayload, SamplingParams, version_spans
from rollfleet.schemas.errors import EngineFailure, InvalidRequest, RollfleetError
from rollfleet.schemas.limits import check_payload
from rollfleet.workers.engines import _weights
from rollfleet.workers.engines._sampling import make_generator, sample_token
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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


@dataclass(eq=False)
class _Request:
    rid: str
    params: SamplingParams
    stops: frozenset[int]
    prompt_len: int
    want_text: bool
    future: asyncio.Future[Generation]
    seqs: list[_Seq] = field(default_factory=list)


@dataclass
class _Batch:
    """KV-cache state owned by the step thread: which sequences the cache rows hold."""

    members: list[_Seq] = field(default_factory=list)
    cache: Any = None
    mask: torch.Tensor | None = None  # [B, cached_len]
    next_pos: torch.Tensor | None = None  # [B] position of the next input token
    valid: bool = False


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

    def __init__(
        self,
        device: str = "auto",
        dtype: str | None = None,
        max_batch: int = 32,
        seed: int = 0,
        *,
        stop_on_eos: bool = True,
        reprefill_after_activation: bool = True,
        attn_implementation: str | None = None,
        step_log_size: int = 4096,
        stage_mode: str = "swap",
    ) -> None:
        super().__init__()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch = max_batch
        self.seed = seed
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
        self.rebuilds = 0
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
        self._epoch = 0  # bumps on every change of the live weights
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

    async def generate(self, request_id: str, payload: RolloutPayload, session_id: str | None = None) -> Generation:
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
        )
        for i in range(payload.n):
            gen = None
            if params.temperature > 0:
                base = params.seed if params.seed is not None else (self.seed << 32) + next(self._seed_counter)
                gen = make_generator(base * 1_000_003 + i, self.device)
            req.seqs.append(_Seq(req=req, index=i, tokens=list(prompt), gen=gen))
        self._requests[request_id] = req
        self._pending.extend(req.seqs)
        self._wake.set()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            self._finish_request(req, "abort")  # the caller went away: free its batch rows
            raise

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
        req.future.set_result(Generation(outputs, int(v_start), int(v_end), prompt_tokens=req.prompt_len))

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
                self._wake.clear()
                await self._wake.wait()
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
        self._active = [s for s in self._active if s.finish is None]
        while self._pending and len(self._active) < self.max_batch:
            seq = self._pending.popleft()
            if seq.finish is None:
                self._active.append(seq)

    def _advance(self, seq: _Seq, token: int, logprob: float, version: int) -> None:
        if seq.finish is not None:  # aborted while its step ran
            return
        seq.versions.append(version)
        seq.tokens.append(token)
        seq.out.append(token)
        seq.logprobs.append(logprob)
        params = seq.req.params
        if token in seq.req.stops:
            seq.finish = "stop"
        elif len(seq.out) >= params.max_tokens or len(seq.tokens) >= self._max_len:
            seq.finish = "length"
        if seq.finish is not None:
            self._complete_if_done(seq.req)

    def _fail_request(self, req: _Request, err: RollfleetError) -> None:
        for seq in req.seqs:
            seq.finish = seq.finish or "abort"
        self._requests.pop(req.rid, None)
        if not req.future.done():
            req.future.set_exception(err)

    # -- one step (runs on the step thread) ----------------------------------------------------

    def _step(self, batch: list[_Seq]) -> list[tuple[int, float]]:
        with torch.inference_mode():
            logits = self._forward(batch)
            return [sample_token(logits[i], seq.req.params, seq.gen) for i, seq in enumerate(batch)]

    def _forward(self, batch: list[_Seq]) -> torch.Tensor:
        state = self._batch
        keep: list[int] | None = None
        if state.valid and len(batch) <= len(state.members):
            rows = {id(s): i for i, s in enumerate(state.members)}
            keep = [rows.get(id(s), -1) for s in batch]
            # Reusable only if every member is cached and in the same order (rows only drop out).
            if -1 in keep or keep != sorted(keep):
                keep = None
        if keep is None:
            return self._prefill(batch)
        if keep != list(range(len(state.members))):
            idx = torch.tensor(keep, device=self.device)
            state.cache.batch_select_indices(idx)
            state.mask = state.mask.index_select(0, idx)  # type: ignore[union-attr]
            state.next_pos = state.next_pos.index_select(0, idx)  # type: ignore[union-attr]
            state.members = list(batch)
        ids = torch.tensor([[s.tokens[-1]] for s in batch], device=self.device)
        one = torch.ones((len(batch), 1), dtype=torch.long, device=self.device)
        mask = torch.cat([state.mask, one], dim=1)  # type: ignore[list-item]
        pos = state.next_pos.unsqueeze(1)  # type: ignore[union-attr]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: state.cache},
        )
        state.cache, state.mask = _out_cache(out), mask
        state.next_pos = state.next_pos + 1  # type: ignore[operator]
        return out.logits[:, -1, :].float()

    def _prefill(self, batch: list[_Seq]) -> torch.Tensor:
        """Rebuild the KV cache for ``batch`` from scratch (membership grew or weights changed)."""
        self.rebuilds += 1
        width = max(len(s.tokens) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):  # left padding: the next token is always the last column
            ids[i, width - len(s.tokens) :] = torch.tensor(s.tokens)
            mask[i, width - len(s.tokens) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        self._batch = _Batch(
            members=list(batch), cache=_out_cache(out), mask=mask, next_pos=mask.sum(dim=1), valid=True
        )
        return out.logits[:, -1, :].float()

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
            if self.reprefill_after_activation and names:
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
