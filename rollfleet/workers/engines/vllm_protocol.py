"""vLLM's generate route: the request body and what its answer says, as pure functions.

The body (``generate_body``) and the checks before a request is sent (``check_tokens``); the
answer's completions (``parse_choices``), the versions its spans may name (``check_spans``) and
its prompt-token counts (``prompt_usage``); a deterministic request's samples sent one at a time
(``sample_alone``, ``join_samples``). The route itself is described in ``vllm``'s docstring.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import Any

import msgspec

from rollfleet.schemas import Completion, RolloutPayload
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.workers.engines.base import Generation, sample_seed
from rollfleet.workers.engines.server_protocol import finish_reason, parse_spans

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def check_tokens(payload: RolloutPayload, vocab_size: int | None, max_model_len: int | None) -> None:
    """A prompt vLLM can take: token ids (it runs without a tokenizer) inside the vocabulary, and
    within the model's context with ``max_tokens``. Checked here because vLLM 0.32 without a
    tokenizer does not: an id past the vocabulary kills its engine, not just the request."""
    ids = payload.prompt_token_ids
    if ids is None:
        raise InvalidRequest("the vllm engine takes prompt_token_ids (its server runs without a tokenizer)")
    if vocab_size is not None:
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise InvalidRequest(f"token id {outside[0]} is outside the model's vocabulary of {vocab_size}")
    if max_model_len is not None and len(ids) + payload.sampling.max_tokens > max_model_len:
        raise InvalidRequest(
            f"the prompt ({len(ids)} tokens) and max_tokens ({payload.sampling.max_tokens}) exceed the "
            f"model's context of {max_model_len} tokens"
        )


def generate_body(request_id: str, payload: RolloutPayload, cache_salt: str | None) -> dict[str, Any]:
    """The generate route's body for ``payload`` (``cache_salt``: the prefix cache's namespace)."""
    s = payload.sampling
    params: dict[str, Any] = {
        "n": payload.n,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else 0,  # vLLM: 0 means no top-k cut
        "detokenize": False,
    }
    if s.logprobs:
        params["logprobs"] = 0  # the sampled token's own log-prob, no alternatives
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if payload.extra.get("ignore_eos"):
        params["ignore_eos"] = True
    if s.seed is not None:  # never a seed the job did not ask for: replicas would draw alike
        params["seed"] = s.seed
    params.update(payload.extra.get("sampling_params", {}))  # vLLM-specific pass-through
    body: dict[str, Any] = {
        "request_id": request_id,
        "token_ids": list(payload.prompt_token_ids or []),
        "sampling_params": params,
        "stream": False,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def parse_choices(
    answer: Mapping[str, Any], want_logprobs: bool, aborted: bool, max_tokens: int | None = None
) -> list[Completion]:
    """The completions of the generate route's answer, in sample order (``aborted``: the adapter
    aborted the request; ``server_protocol.finish_reason`` says how each sample ended)."""
    choices = answer.get("choices")
    if not isinstance(choices, list):
        raise EngineFailure(f"vLLM answered without choices: {str(answer)[:300]}")
    outputs = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, Mapping) else 0):
        tokens = [int(t) for t in choice.get("token_ids") or []]
        logprobs = None
        if want_logprobs:
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(entry["logprob"]) for entry in content]
            if len(logprobs) != len(tokens):
                raise EngineFailure(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens")
        said = _FINISH.get(str(choice.get("finish_reason")), "stop")
        reason = finish_reason(said, len(tokens), max_tokens, aborted)  # type: ignore[arg-type]
        outputs.append(
            Completion(
                token_ids=tokens,
                finish_reason=reason,  # type: ignore[arg-type]
                logprobs=logprobs,
                weight_versions=parse_spans(choice.get("weight_versions"), len(tokens)),
            )
        )
    return outputs


def check_spans(outputs: Sequence[Completion], sent_on: int, version: int, live: Set[int]) -> None:
    """Every version a span names must have been live here while the request ran: from ``sent_on``
    to ``version`` (the live one now), and one of ``live`` (those made live here)."""
    for out in outputs:
        for span in out.weight_versions:
            if not sent_on <= span.version <= version or span.version not in live:
                raise EngineFailure(
                    f"vLLM attributes tokens {span.start}..{span.end} to version {span.version}, but this "
                    f"replica had versions {sent_on}..{version} live while the request ran"
                )


def prompt_usage(answer: Mapping[str, Any], prompt_len: int) -> tuple[int, int]:
    """(prompt tokens, of which cached) from the answer's ``usage`` (``prompt_len`` where it has
    no count)."""
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return _count(usage.get("prompt_tokens")) or prompt_len, _count(cached)


def sample_alone(payload: RolloutPayload, i: int) -> RolloutPayload:
    """Sample ``i`` of ``payload`` as a request of its own, on its own stream (``sample_seed``)."""
    return msgspec.structs.replace(
        payload,
        n=1,
        sampling=msgspec.structs.replace(payload.sampling, seed=sample_seed(payload.sampling.seed, i)),
    )


def join_samples(parts: Sequence[Generation]) -> Generation:
    """One request's result from its samples sent alone, in order."""
    return Generation(
        [p.outputs[0] for p in parts],
        parts[0].version_start,
        parts[-1].version_end,
        prompt_tokens=parts[0].prompt_tokens,
        cached_tokens=parts[0].cached_tokens,
        cache_rebuilt=parts[0].cache_rebuilt,
    )


def config_int(model_dir: Path, key: str) -> int | None:
    """An integer of the checkpoint's config.json (None where it has none)."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
