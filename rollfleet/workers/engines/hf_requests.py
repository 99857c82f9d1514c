"""The hf engine's requests and their samples, and the rules over them.

A request (``HFRequest``) is ``n`` samples (``HFSeq``), each a sequence that joins the decode
batch, advances one token per step and finishes (stop token, length, abort). Everything here is
plain data and pure rules: which prompt a payload means (``prompt_ids``), what a request is made
of (``new_request``: its stop tokens, seed and samples' random streams), which pending samples
join the batch next (``admit``), when a sample is done (``finish_reason``) and what a finished
request answers (``generation``). The engine (``hf.py``) carries them out.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollfleet.schemas import Completion, RolloutPayload, SamplingParams, version_spans
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.limits import check_payload
from rollfleet.workers.engines._sampling import make_generator
from rollfleet.workers.engines.base import Generation, TokenSink, sample_seed
from rollfleet.workers.engines.session_cache import Lookup


@dataclass(eq=False)
class HFSeq:
    """One sample of one request."""

    req: HFRequest
    index: int
    tokens: list[int]  # prompt + generated
    gen: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the live version at each generated token
    finish: str | None = None
    cached: int = 0  # prompt tokens whose KV came from the session cache when it joined the batch
    kv_epoch: int = -1  # the weights epoch of the oldest KV in its batch row (-1: never had a row)
    skip_draws: int = 0  # draws its stream is advanced past before its first token (``stream_offset``)


@dataclass(eq=False)
class HFRequest:
    rid: str
    params: SamplingParams
    stops: frozenset[int]
    prompt_len: int
    want_text: bool
    future: asyncio.Future[Generation]
    seqs: list[HFSeq] = field(default_factory=list)
    session: str | None = None  # cleared by end_session: nothing is kept for it any more
    alone: bool = False  # deterministic: each sample runs alone, a batch of one, and prefills whole
    seed: int | None = None  # the seed drawn for it when it gave none (its samples: seed + index)
    lookup: Lookup | None = None  # what the session cache gave this turn (taken once)
    sink: TokenSink | None = None  # told each token as it is made (resumable jobs' checkpoints)


def prompt_ids(payload: RolloutPayload, tokenizer: Any, vocab: int) -> list[int]:
    """The prompt's token ids (encoded with ``tokenizer`` when the payload sends text); raises
    ``InvalidRequest`` for a prompt or stop token outside a vocabulary of ``vocab``."""
    check_payload(payload)
    if payload.prompt_token_ids is not None:
        ids = list(payload.prompt_token_ids)
    elif tokenizer is None:
        raise InvalidRequest(
            "the hf engine has no tokenizer in its checkpoint dir; send prompt_token_ids instead of prompt_text"
        )
    else:
        ids = list(tokenizer.encode(payload.prompt_text or "", add_special_tokens=False))
        if not ids:
            raise InvalidRequest("prompt_text encodes to no tokens")
    if max(ids) >= vocab:
        raise InvalidRequest(f"prompt token id {max(ids)} is outside the vocabulary of {vocab}")
    bad = [t for t in payload.sampling.stop_token_ids if t >= vocab]
    if bad:
        raise InvalidRequest(f"stop token ids {bad} are outside the vocabulary of {vocab}")
    return ids


def new_request(
    request_id: str,
    payload: RolloutPayload,
    prompt: list[int],
    *,
    max_len: int,
    eos: frozenset[int],
    draw_seed: Callable[[], int],
    session: str | None,
    alone: bool,
    sink: TokenSink | None,
    device: torch.device,
) -> HFRequest:
    """The request for ``payload``, with its ``n`` samples (each with its random stream), ready to
    queue. ``eos``: the stop tokens it gets besides its own; ``draw_seed``: a seed for a request
    that samples and names none; ``max_len``: the model's context, in tokens."""
    params = payload.sampling
    if len(prompt) + params.max_tokens > max_len:
        raise InvalidRequest(
            f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the model's context of {max_len} tokens"
        )
    req = HFRequest(
        rid=request_id,
        params=params,
        stops=frozenset(set(params.stop_token_ids) | eos),
        prompt_len=len(prompt),
        want_text=payload.prompt_text is not None,
        future=asyncio.get_running_loop().create_future(),
        session=session,
        sink=sink,
        alone=alone,
    )
    seed = params.seed
    if seed is None and params.temperature > 0:
        # One seed per request, recorded in its result (``Generation.seed``): sample i draws
        # ``sample_seed(seed, i)``, as a seeded request's does, so any sample can be drawn again.
        seed = req.seed = draw_seed()
    for i in range(payload.n):
        gen = None
        if params.temperature > 0:  # the same stream whether sample i is sent alone or not
            gen = make_generator(sample_seed(seed, i), device)
        skip = payload.stream_offset if gen is not None else 0
        req.seqs.append(HFSeq(req=req, index=i, tokens=list(prompt), gen=gen, skip_draws=skip))
    return req


def admit(active: list[HFSeq], pending: deque[HFSeq], max_batch: int) -> list[HFSeq]:
    """The batch's sequences after pending ones joined it (taken from ``pending``), in their order.

    A deterministic one runs alone: it waits at the head of the queue until the batch has drained
    (nothing overtakes it), then runs as a batch of one, and nothing joins it until it is done.
    Alone, its prefill has no padding and every matmul the shape of a batch of one, so its bits
    are those of any other run of it alone (a replay's)."""
    active = [s for s in active if s.finish is None]
    if any(s.req.alone for s in active):
        return active
    while pending and len(active) < max_batch:
        seq = pending[0]
        if seq.finish is not None:
            pending.popleft()
            continue
        if seq.req.alone:
            if not active:
                active.append(pending.popleft())
            return active
        active.append(pending.popleft())
    return active


def finish_reason(seq: HFSeq, token: int, max_len: int) -> str | None:
    """Why ``seq`` is done now that ``token`` was appended to it (None: it goes on)."""
    if token in seq.req.stops:
        return "stop"
    if len(seq.out) >= seq.req.params.max_tokens or len(seq.tokens) >= max_len:
        return "length"
    return None


def generation(req: HFRequest, version: int, tokenizer: Any) -> Generation:
    """What a request whose samples all finished answers (``version``: the live one, for a request
    none of whose samples made a token)."""
    ran = [s for s in req.seqs if s.versions]
    v_start = min((s.versions[0] for s in ran), default=version)
    v_end = max((s.versions[-1] for s in ran), default=version)
    outputs = [
        Completion(
            token_ids=list(s.out),
            finish_reason=s.finish,  # type: ignore[arg-type]
            logprobs=list(s.logprobs) if req.params.logprobs else None,
            text=tokenizer.decode(s.out) if req.want_text and tokenizer is not None else None,
            weight_versions=version_spans(s.versions),
        )
        for s in req.seqs
    ]
    joined = [s.cached for s in req.seqs if s.kv_epoch >= 0]
    return Generation(
        outputs,
        int(v_start),
        int(v_end),
        prompt_tokens=req.prompt_len,
        cached_tokens=min(joined, default=0),
        cache_rebuilt=req.lookup is not None and req.lookup.stale,
        seed=req.seed,
    )
