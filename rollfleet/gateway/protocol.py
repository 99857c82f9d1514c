"""The gateway's HTTP contract, as pure functions: request bodies in, rollfleet requests out;
results and errors in, response bodies out. No I/O; ``gateway.server`` carries them out.

Two request shapes are read:

- SGLang's native ``POST /generate`` (what miles' rollout code sends): ``input_ids`` or
  ``text``, ``sampling_params``, ``return_logprob``, ``stream``, ``rid``;
- OpenAI's ``POST /v1/completions`` (what the official ``openai`` client sends): ``prompt`` as
  text or token ids, ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``,
  ``logprobs``, ``stream``;
- OpenAI's ``POST /v1/chat/completions``: ``messages`` (and ``tools``) rendered into the prompt
  by the served model's chat template (``gateway.chat``), the same sampling fields,
  ``logprobs: true``.

Both may carry Stitch's constraint object, ``weight_version: {"min_required_version": N,
"exact_version": N}`` (through ``extra_body`` for the ``openai`` client); without one the
gateway's default applies. Every field is checked for its type; an unknown field of
``weight_version`` or of ``sampling_params`` is refused (a misspelt constraint must never
silently mean "any version").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from rollfleet.gateway.chat import ChatTemplate, messages_of, tools_of
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams
from rollfleet.schemas.errors import InvalidRequest, RollfleetError
from rollfleet.schemas.progress import TokenChunk

Route = Literal["generate", "completions", "chat"]

# SGLang's sampling parameters (sglang.api.v1.SamplingParams, which refuses any other key). The
# gateway reads the ones rollfleet's payload has; the rest reach the engine as they are.
_SAMPLING_READ = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "n", "sampling_seed"}
_SAMPLING_PASSED = {
    "stop", "stop_regex", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "custom_params",
    "beam_width", "watermark", "choice",
}  # fmt: skip
_NO_TOP_K = 1 << 30  # SGLang's "no cut" (its default is 1073741824; -1 also means none)
_CONSTRAINT_KEYS = {"min_required_version", "exact_version"}


@dataclass(frozen=True)
class Constraint:
    """Which versions may serve: exactly one of the three, or none (the gateway's default)."""

    min_version: int | None = None
    exact_version: int | None = None
    max_staleness: int | None = None

    def as_kwargs(self) -> dict[str, int]:
        given = {
            k: v
            for k, v in (
                ("min_version", self.min_version),
                ("exact_version", self.exact_version),
                ("max_staleness", self.max_staleness),
            )
            if v is not None
        }
        return given or {"min_version": 0}


@dataclass(frozen=True)
class GatewayRequest:
    route: Route
    payload: RolloutPayload
    constraint: Constraint
    idempotency_key: str | None
    stream: bool
    logprobs: bool  # return them (the payload always asks the engine for them)
    model: str | None = None


def _int(value: Any, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"{name} must be >= {minimum}, got {value}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {type(value).__name__}")
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{name} must be a non-empty list of token ids")
    return [_int(t, f"{name}[]", minimum=0) for t in value]


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def constraint_of(body: dict[str, Any], default_max_staleness: int | None) -> Constraint:
    """Stitch's ``weight_version`` object, else the gateway's default (``max_staleness`` below
    the latest version, or any version)."""
    spec = body.get("weight_version")
    if spec is None:
        return Constraint(max_staleness=default_max_staleness)
    if not isinstance(spec, dict):
        raise InvalidRequest("weight_version must be an object with min_required_version or exact_version")
    unknown = set(spec) - _CONSTRAINT_KEYS
    if unknown:
        raise InvalidRequest(f"weight_version has unknown fields {sorted(unknown)}; known: {sorted(_CONSTRAINT_KEYS)}")
    low, exact = spec.get("min_required_version"), spec.get("exact_version")
    if low is not None and exact is not None:
        raise InvalidRequest("weight_version: give min_required_version or exact_version, not both")
    if exact is not None:
        return Constraint(exact_version=_int(exact, "weight_version.exact_version", minimum=0))
    if low is not None:
        return Constraint(min_version=_int(low, "weight_version.min_required_version", minimum=0))
    return Constraint(max_staleness=default_max_staleness)


def _key(body: dict[str, Any], header: str | None) -> str | None:
    if header is not None:
        return header
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest("rid must be a string (a list of them only for a batch of inputs)")
    return rid


MAX_BATCH = 256  # inputs in one /generate request


def _batch_keys(body: dict[str, Any], header: str | None, size: int) -> list[str | None]:
    """One idempotency key an input: ``<Idempotency-Key>/<i>``, or SGLang's list of ``rid``."""
    if header is not None:
        return [f"{header}/{i}" for i in range(size)]
    rid = body.get("rid")
    if rid is None:
        return [None] * size
    if not isinstance(rid, list) or len(rid) != size or not all(isinstance(r, str) for r in rid):
        raise InvalidRequest(f"rid must be a list of {size} strings, one an input")
    if len(set(rid)) != size:
        raise InvalidRequest("rid must not repeat within a batch")
    return list(rid)


def parse_generate(
    body: Any, *, key_header: str | None, default_max_staleness: int | None
) -> GatewayRequest | list[GatewayRequest]:
    """SGLang's ``/generate`` body: one input, or a batch (``text`` a list of strings,
    ``input_ids`` a list of lists; ``sampling_params`` one for all or a list, one an input)."""
    body = _object(body)
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise InvalidRequest("give exactly one of input_ids or text")
    params = body.get("sampling_params") or {}
    batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if not batched:
        if text is not None and not isinstance(text, str):
            raise InvalidRequest("text must be a string, or a list of strings for a batch")
        if isinstance(params, list):
            raise InvalidRequest("sampling_params may be a list only for a batch of inputs")
        return _generate_one(body, ids, text, params, _key(body, key_header), default_max_staleness)
    inputs: list[Any] = text if text is not None else ids  # type: ignore[assignment]
    if not inputs or len(inputs) > MAX_BATCH:
        raise InvalidRequest(f"a batch must have 1 to {MAX_BATCH} inputs, got {len(inputs)}")
    if _bool(body.get("stream", False), "stream"):
        raise InvalidRequest("a batch of inputs cannot be streamed: stream one input a request")
    if isinstance(params, list) and len(params) != len(inputs):
        raise InvalidRequest(f"sampling_params must be one object, or a list of {len(inputs)}, one an input")
    keys = _batch_keys(body, key_header, len(inputs))
    out = []
    for i, one in enumerate(inputs):
        if text is not None and not isinstance(one, str):
            raise InvalidRequest(f"text[{i}] must be a string")
        each = params[i] if isinstance(params, list) else params
        out.append(_generate_one(body, None if text is not None else one, one if text is not None else None, each,
                                 keys[i], default_max_staleness))  # fmt: skip
    return out


def _generate_one(
    body: dict[str, Any],
    ids: Any,
    text: str | None,
    params: Any,
    key: str | None,
    default_max_staleness: int | None,
) -> GatewayRequest:
    if not isinstance(params, dict):
        raise InvalidRequest("sampling_params must be an object")
    unknown = set(params) - _SAMPLING_READ - _SAMPLING_PASSED
    if unknown:
        raise InvalidRequest(f"sampling_params has unknown fields {sorted(unknown)} (SGLang's names are expected)")
    top_k = _int(params["top_k"], "sampling_params.top_k") if params.get("top_k") is not None else 0
    seed = params.get("sampling_seed")
    sampling = SamplingParams(
        max_tokens=_int(params.get("max_new_tokens", 128), "sampling_params.max_new_tokens", minimum=1),
        temperature=_float(params.get("temperature", 1.0), "sampling_params.temperature"),
        top_p=_float(params.get("top_p", 1.0), "sampling_params.top_p"),
        top_k=0 if top_k < 0 or top_k >= _NO_TOP_K else top_k,
        stop_token_ids=_token_ids(params["stop_token_ids"], "sampling_params.stop_token_ids")
        if params.get("stop_token_ids")
        else [],
        seed=_int(seed, "sampling_params.sampling_seed") if seed is not None else None,
        logprobs=True,
    )
    extra = {k: v for k, v in params.items() if k in _SAMPLING_PASSED and v is not None}
    if "ignore_eos" in extra:
        _bool(extra["ignore_eos"], "sampling_params.ignore_eos")
    payload = RolloutPayload(
        prompt_token_ids=_token_ids(ids, "input_ids") if ids is not None else None,
        prompt_text=text,
        sampling=sampling,
        n=_int(params.get("n", 1), "sampling_params.n", minimum=1),
        extra=extra,
    )
    return GatewayRequest(
        route="generate",
        payload=payload,
        constraint=constraint_of(body, default_max_staleness),
        idempotency_key=key,
        stream=_bool(body.get("stream", False), "stream"),
        logprobs=_bool(body.get("return_logprob", False), "return_logprob"),
    )


def _openai_sampling(body: dict[str, Any], max_tokens: Any) -> tuple[SamplingParams, dict[str, Any], int]:
    """The sampling fields OpenAI's completions and chat requests share: the parameters, what
    passes to the engine as it is (``stop``, ``ignore_eos``), and ``n``."""
    stop = body.get("stop")
    extra: dict[str, Any] = {}
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise InvalidRequest("stop must be a string or a list of strings")
        extra["stop"] = stop
    if body.get("ignore_eos") is not None:
        extra["ignore_eos"] = _bool(body["ignore_eos"], "ignore_eos")
    sampling = SamplingParams(
        max_tokens=_int(max_tokens, "max_tokens", minimum=1),
        temperature=_float(body.get("temperature", 1.0), "temperature"),
        top_p=_float(body.get("top_p", 1.0), "top_p"),
        seed=_int(body["seed"], "seed") if body.get("seed") is not None else None,
        logprobs=True,
    )
    return sampling, extra, _int(body.get("n", 1), "n", minimum=1)


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string")
    return model


def parse_completions(body: Any, *, key_header: str | None, default_max_staleness: int | None) -> GatewayRequest:
    """OpenAI's ``/v1/completions`` body (one prompt: text or token ids)."""
    body = _object(body)
    prompt = body.get("prompt")
    ids: list[int] | None = None
    text: str | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = _token_ids(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) == 1:
        one = prompt[0]
        if isinstance(one, str):
            text = one
        else:
            ids = _token_ids(one, "prompt[0]")
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids (one prompt a request)")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        _int(logprobs, "logprobs", minimum=0)
    sampling, extra, n = _openai_sampling(body, body.get("max_tokens", 16))
    return GatewayRequest(
        route="completions",
        payload=RolloutPayload(prompt_token_ids=ids, prompt_text=text, sampling=sampling, n=n, extra=extra),
        constraint=constraint_of(body, default_max_staleness),
        idempotency_key=_key(body, key_header),
        stream=_bool(body.get("stream", False), "stream"),
        logprobs=logprobs is not None,
        model=_model(body),
    )


def parse_chat(
    body: Any,
    *,
    key_header: str | None,
    default_max_staleness: int | None,
    template: ChatTemplate | None,
    now: datetime | None = None,
) -> GatewayRequest:
    """OpenAI's ``/v1/chat/completions`` body: the conversation rendered into one prompt with the
    served model's chat template (a gateway started without one refuses chat, naming the flag)."""
    body = _object(body)
    if template is None:
        raise InvalidRequest("this gateway has no chat template: start it with --tokenizer DIR (the model's files)")
    messages = messages_of(body.get("messages"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object")
    add_generation_prompt = _bool(body.get("add_generation_prompt", True), "add_generation_prompt")
    prompt = template.render(messages, tools=tools_of(body.get("tools")), add_generation_prompt=add_generation_prompt,
                             kwargs=kwargs, now=now)  # fmt: skip
    if not prompt:
        raise InvalidRequest("the chat template rendered the conversation to an empty prompt")
    top = body.get("top_logprobs")
    if top is not None:
        _int(top, "top_logprobs", minimum=0)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    sampling, extra, n = _openai_sampling(body, 128 if limit is None else limit)
    return GatewayRequest(
        route="chat",
        payload=RolloutPayload(prompt_text=prompt, sampling=sampling, n=n, extra=extra),
        constraint=constraint_of(body, default_max_staleness),
        idempotency_key=_key(body, key_header),
        stream=_bool(body.get("stream", False), "stream"),
        logprobs=_bool(body.get("logprobs", False), "logprobs"),
        model=_model(body),
    )


SESSION_HEADERS = ("X-Session-Id", "X-SMG-Routing-Key")  # (miles' router sends the second)
_MAX_SESSION_KEY = 512


def session_id_of(key: str) -> str:
    """The rollfleet session a trajectory's header names: a digest of it, so that any header
    value (a user's string, a UUID, a hash) becomes a valid, stable session id of bounded size."""
    if not key or len(key) > _MAX_SESSION_KEY:
        raise InvalidRequest(f"a session header must be 1 to {_MAX_SESSION_KEY} characters")
    return "gw-" + hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


# -- responses ---------------------------------------------------------------------------------


def _finish(reason: str, tokens: int) -> dict[str, Any]:
    # SGLang's shape: {"type": "length", "length": N} | {"type": "stop", "matched": ...} | {"type": "abort"}
    return {"type": "length", "length": tokens} if reason == "length" else {"type": reason}


def _facts(result: RolloutResult, index: int) -> dict[str, Any]:
    """rollfleet's own facts beside each shape's fields: which version made which tokens."""
    out = result.outputs[index]
    return {
        "job_id": result.job_id,
        "idempotency_key": result.idempotency_key,
        "replica": result.worker_id,
        "weight_versions": [[s.version, s.start, s.end, s.replica or result.worker_id] for s in out.weight_versions],
        "queue_wait_s": result.queue_wait_s,
        "generation_s": result.generation_s,
    }


def generate_response(result: RolloutResult, *, logprobs: bool) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's ``/generate`` answer (a list when ``n > 1``, as SGLang returns one item a sample)."""
    items = []
    for i, out in enumerate(result.outputs):
        meta: dict[str, Any] = {
            "id": f"{result.job_id}-{i}" if len(result.outputs) > 1 else result.job_id,
            "finish_reason": _finish(out.finish_reason, len(out.token_ids)),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(out.token_ids),
            "cached_tokens": result.cached_tokens,
            # What miles records per sample (SGLang reports its weight version as a string).
            "weight_version": str(result.version_end),
            "weight_version_start": result.version_start,
            "weight_version_end": result.version_end,
            "rollfleet": _facts(result, i),
        }
        if logprobs:
            lps = out.logprobs or [None] * len(out.token_ids)
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out.token_ids, strict=True)]
        items.append({"text": out.text or "", "output_ids": list(out.token_ids), "meta_info": meta})
    return items[0] if len(items) == 1 else items


def _usage(result: RolloutResult) -> dict[str, int]:
    completion_tokens = sum(len(o.token_ids) for o in result.outputs)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": result.prompt_tokens + completion_tokens,
    }


def _openai_finish(reason: str) -> str:
    return "length" if reason == "length" else reason


def _text_logprobs(token_ids: list[int], logprobs: list[float] | None) -> dict[str, Any]:
    """A completion's ``logprobs`` object (tokens named by their ids: exact, never re-tokenized)."""
    return {"tokens": [str(t) for t in token_ids], "token_logprobs": list(logprobs or []), "top_logprobs": None,
            "text_offset": None}  # fmt: skip


def _chat_logprobs(token_ids: list[int], logprobs: list[float] | None) -> dict[str, Any]:
    """A chat choice's ``logprobs.content``: one entry a generated token."""
    lps = logprobs or [None] * len(token_ids)
    return {"content": [{"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(token_ids, lps, strict=True)]}  # fmt: skip


def _openai_answer(result: RolloutResult, kind: str, model: str, created: int, choices: list[Any]) -> dict[str, Any]:
    """The envelope both OpenAI shapes share, with the versions that served the answer."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {
        "id": f"{prefix}-{result.job_id}",
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(result),
        "weight_version_start": result.version_start,
        "weight_version_end": result.version_end,
    }


def _openai_choice(result: RolloutResult, i: int, **shape: Any) -> dict[str, Any]:
    out = result.outputs[i]
    return {"index": i, **shape, "finish_reason": _openai_finish(out.finish_reason),
            "token_ids": list(out.token_ids),  # exact tokens: a trainer never re-tokenizes
            "rollfleet": _facts(result, i)}  # fmt: skip


def completions_response(result: RolloutResult, *, model: str, created: int, logprobs: bool) -> dict[str, Any]:
    choices = [
        _openai_choice(
            result, i, text=out.text or "", logprobs=_text_logprobs(out.token_ids, out.logprobs) if logprobs else None
        )
        for i, out in enumerate(result.outputs)
    ]
    return _openai_answer(result, "text_completion", model, created, choices)


def chat_response(result: RolloutResult, *, model: str, created: int, logprobs: bool) -> dict[str, Any]:
    choices = [
        _openai_choice(
            result,
            i,
            message={"role": "assistant", "content": out.text or ""},
            logprobs=_chat_logprobs(out.token_ids, out.logprobs) if logprobs else None,
        )
        for i, out in enumerate(result.outputs)
    ]
    return _openai_answer(result, "chat.completion", model, created, choices)


def stream_event(req: GatewayRequest, chunk: TokenChunk, *, job_id: str, model: str, created: int) -> dict[str, Any]:
    """One server-sent event: sample ``chunk.index``'s tokens from offset ``chunk.start`` (a
    delta, with the versions that made them). Text comes whole in the last event (the gateway
    holds no tokenizer; the tokens are exact)."""
    spans = [[s.version, s.start, s.end, s.replica] for s in chunk.spans]
    ids = list(chunk.token_ids)
    if req.route == "generate":
        meta: dict[str, Any] = {"id": job_id, "finish_reason": None, "weight_versions": spans}
        if req.logprobs:
            lps = chunk.logprobs or [None] * len(ids)
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        return {"index": chunk.index, "start": chunk.start, "output_ids": ids, "meta_info": meta}
    facts = {"start": chunk.start, "weight_versions": spans}
    if req.route == "chat":
        logprobs = _chat_logprobs(ids, chunk.logprobs) if req.logprobs else None
        choice = {"index": chunk.index, "delta": {"role": "assistant", "content": ""}, "token_ids": ids,
                  "logprobs": logprobs, "finish_reason": None, "rollfleet": facts}  # fmt: skip
        return {"id": f"chatcmpl-{job_id}", "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}  # fmt: skip
    logprobs = _text_logprobs(ids, chunk.logprobs) if req.logprobs else None
    choice = {"index": chunk.index, "text": "", "token_ids": ids, "logprobs": logprobs, "finish_reason": None,
              "rollfleet": facts}  # fmt: skip
    return {"id": f"cmpl-{job_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}  # fmt: skip


def answer(req: GatewayRequest, result: RolloutResult, *, model: str, created: int) -> Any:
    """The whole answer, in the route's own shape."""
    if req.route == "generate":
        return generate_response(result, logprobs=req.logprobs)
    shape = chat_response if req.route == "chat" else completions_response
    return shape(result, model=model, created=created, logprobs=req.logprobs)


def final_event(req: GatewayRequest, result: RolloutResult, *, model: str, created: int) -> Any:
    """The last event of a stream before ``[DONE]``: the whole answer, less what came as deltas
    (a completion's tokens and log-probs; its text and finish reason come now)."""
    if req.route == "generate":
        return answer(req, result, model=model, created=created)
    if req.route == "chat":
        whole = chat_response(result, model=model, created=created, logprobs=False)
        whole["object"] = "chat.completion.chunk"
        for choice in whole["choices"]:
            choice["delta"] = choice.pop("message")
            choice["token_ids"] = []
        return whole
    whole = completions_response(result, model=model, created=created, logprobs=False)
    for choice in whole["choices"]:
        choice["token_ids"] = []
    return whole


@dataclass(frozen=True)
class ErrorReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def error_reply(exc: RollfleetError) -> ErrorReply:
    """The HTTP status a client can act on: 409 with ``Retry-After`` when no replica can serve
    the constraint now, 504 past the deadline, 400 for bad input, 503 for other retryable
    errors, 500 otherwise; the body carries the error's code and ``retryable`` flag."""
    code = exc.code
    status = {
        "no_compatible_replica": 409,
        "expired": 504,
        "invalid_request": 400,
        "unsupported_schema": 400,
        "idempotency_conflict": 422,
        "cancelled": 499,
        "unauthorized": 401,
        "session_conflict": 409,  # (a turn of the trajectory still running, or other settings)
        "unknown_session": 404,
    }.get(code, 503 if exc.retryable else 500)
    headers = {"Retry-After": "1"} if status in (409, 503) else {}
    body = {"error": {"code": code, "message": exc.message, "retryable": exc.retryable, "type": type(exc).__name__}}
    return ErrorReply(status, body, headers)
