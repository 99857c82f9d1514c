"""The gateway's HTTP contract, as pure functions: request bodies and headers in, rollfleet
requests out; results and errors in, response bodies and statuses out. No I/O; ``gateway.app``
carries them out, and ``gateway.request_state`` decides what becomes of each request.

Three request shapes are read:

- SGLang's native ``POST /generate`` (what miles' rollout code sends): ``input_ids`` or
  ``text``, ``sampling_params``, ``return_logprob``, ``stream``, ``rid``;
- OpenAI's ``POST /v1/completions`` (what the official ``openai`` client sends): ``prompt`` as
  text or token ids, ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``, ``logprobs``
  (0: the sampled tokens' own), ``stream``;
- OpenAI's ``POST /v1/chat/completions``: ``messages`` (and ``tools``) rendered into the prompt
  by the served model's chat template (``gateway.chat``), the same sampling fields,
  ``logprobs: true``.

Each may carry Stitch's constraint object, ``weight_version: {"min_required_version": N}`` or
``{"exact_version": N}`` (through ``extra_body`` for the ``openai`` client); without one the
gateway's default applies. The object may also say ``"wait_for_replica": true``: a request no
replica serves now is then queued and waits within its deadline for one to start (the fleet's
autoscaler hears the demand and starts a replica held at an old version) instead of a 409. It
lives in the constraint because it is the constraint's alternative to a refusal (which versions,
and what if none is served), one object every route already carries, where a top-level field
would add a name to tables that mirror SGLang's and OpenAI's own.

What is not honoured is refused, never dropped: every field a route may be sent is in one table
(``FIELDS``, ``SAMPLING_FIELDS``): read into rollfleet's payload (every engine honours those),
passed to the engine as SGLang's own text options, a hint that changes nothing generated, or
accepted only at the value that changes nothing (a penalty of 0, no ``logit_bias``; any other
value is a 400 naming the field: the payload has no field for it, and the gateway cannot choose
a replica whose engine would honour it). An unknown field is a 400 naming it; a field of the
wrong type too; a body with a key twice is refused whole.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import msgspec

from rollfleet.gateway.chat import ChatTemplate, messages_of, tools_of
from rollfleet.schemas import DEFAULT_LIMITS, RolloutPayload, RolloutResult, SamplingParams, coordinate_wire
from rollfleet.schemas.asked import ANY_VERSION, AskedConstraint
from rollfleet.schemas.bounded_json import load_json
from rollfleet.schemas.errors import InvalidRequest, RollfleetError
from rollfleet.schemas.progress import TokenChunk

Route = Literal["generate", "completions", "chat"]

_NO_TOP_K = 1 << 30  # SGLang's "no cut" (its default is 1073741824; -1 also means none)
_VERSION_KEYS = ("min_required_version", "exact_version")
_CONSTRAINT_KEYS = {*_VERSION_KEYS, "wait_for_replica"}


class RefusedField(InvalidRequest):
    """A field the gateway does not honour at the value given (or at all): a 400 naming it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.field = name


class ModelNotFound(InvalidRequest):
    """The request names a model this gateway does not serve (OpenAI's ``model_not_found``, 404)."""

    code = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.field = "model"


# -- what each field gets ----------------------------------------------------------------------

Check = Callable[[Any], bool]


def _is_none(v: Any) -> bool:
    return v is None


def _number_is(want: float) -> Check:
    return lambda v: v is None or (not isinstance(v, bool) and isinstance(v, int | float) and v == want)


def _false(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or v == "" or v == [] or v == {}


# Honoured only at the value that changes nothing generated (``None`` always means "not given").
# SGLang's sampling fields that rollfleet's payload has no field for: each changes which tokens come back.
_NEUTRAL_SAMPLING: dict[str, tuple[Check, str]] = {
    "stop": (_empty, "stop strings are not honoured (no engine of the fleet is told them): use stop_token_ids"),
    "stop_regex": (_empty, "stop_regex is not honoured"),
    "min_p": (_number_is(0), "min_p is not honoured: only 0"),
    "frequency_penalty": (_number_is(0), "frequency_penalty is not honoured: only 0"),
    "presence_penalty": (_number_is(0), "presence_penalty is not honoured: only 0"),
    "repetition_penalty": (_number_is(1), "repetition_penalty is not honoured: only 1"),
    "min_new_tokens": (_number_is(0), "min_new_tokens is not honoured: only 0"),
    "json_schema": (_is_none, "constrained decoding (json_schema) is not honoured"),
    "regex": (_is_none, "constrained decoding (regex) is not honoured"),
    "ebnf": (_is_none, "constrained decoding (ebnf) is not honoured"),
    "structural_tag": (_is_none, "constrained decoding (structural_tag) is not honoured"),
    "logit_bias": (_empty, "logit_bias is not honoured"),
    "custom_params": (_is_none, "custom_params (a custom logit processor's) are not honoured"),
    "beam_width": (_number_is(1), "beam search is not honoured"),
    "watermark": (_is_none, "watermark is not honoured"),
    "choice": (_empty, "choice is not honoured"),
}
# SGLang's options for the answer's text (not its tokens or log-probs): passed to the engine as
# rollfleet's miles integration passes them (``extra["sampling_params"]``, which the SGLang engine
# hands to SGLang), typed as SGLang types them.
_TEXT_OPTIONS: dict[str, Check] = {
    "skip_special_tokens": lambda v: isinstance(v, bool),
    "spaces_between_special_tokens": lambda v: isinstance(v, bool),
    "no_stop_trim": lambda v: isinstance(v, bool),
    "stream_interval": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
}
# Read into the payload (``_sampling``): SGLang's names.
_SAMPLING_READ = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "n", "sampling_seed",
                  "ignore_eos"}  # fmt: skip
SAMPLING_FIELDS = _SAMPLING_READ | set(_TEXT_OPTIONS) | set(_NEUTRAL_SAMPLING)

# The top level of each route's body: read, hints (accepted: they change nothing generated, as
# routing, priority, labels or an end-user id), and neutral only; OpenAI's routes also take
# SGLang's sampling names there, as SGLang's own OpenAI server does (``top_k``, ``ignore_eos``, ...).
_GENERATE_READ = {"input_ids", "text", "sampling_params", "return_logprob", "stream", "rid", "weight_version"}
_GENERATE_HINTS = {"bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
                   "routed_dp_rank", "disagg_prefill_dp_rank", "extra_key", "priority", "routing_key",
                   "custom_labels", "kv_hints", "routed_experts_start_len"}  # fmt: skip
_GENERATE_NEUTRAL: dict[str, tuple[Check, str]] = {
    "logprob_start_len": (lambda v: v is None or v == -1, "input log-probs (logprob_start_len) are not returned"),
    "top_logprobs_num": (_number_is(0), "top-k log-probs are not returned: the engines give the sampled token's own"),
    "token_ids_logprob": (_is_none, "log-probs of chosen token ids are not returned"),
    "return_hidden_states": (_false, "hidden states are not returned"),
    "return_text_in_logprobs": (_false, "log-probs carry token ids, not text"),
    "return_prompt_token_ids": (_false, "prompt token ids are not returned"),
    "return_sampling_mask": (_false, "sampling masks are not returned"),
    "return_routed_experts": (_false, "routed experts are not returned"),
    "return_indexer_topk": (_false, "indexer top-k is not returned"),
    "require_reasoning": (_false, "require_reasoning is not honoured"),
    "image_data": (_is_none, "images are not accepted"),
    "video_data": (_is_none, "video is not accepted"),
    "audio_data": (_is_none, "audio is not accepted"),
    "mm_hashes": (_is_none, "multimodal inputs are not accepted"),
    "modalities": (_is_none, "multimodal inputs are not accepted"),
    "images_config": (_is_none, "images are not accepted"),
    "lora_path": (_is_none, "LoRA adapters are not served"),
    "custom_logit_processor": (_is_none, "custom logit processors are not honoured"),
    "session_params": (_is_none, "SGLang's session_params are not honoured: name the trajectory with X-Session-Id"),
    "session_id": (_is_none, "SGLang's session_id is not honoured: name the trajectory with X-Session-Id"),
    "max_thinking_tokens": (_is_none, "max_thinking_tokens is not honoured"),
    "cache_salt": (_is_none, "cache_salt is not honoured (each replica salts its own cache)"),
}
_OPENAI_READ = {"model", "max_tokens", "n", "seed", "stream", "temperature", "top_p", "weight_version", "rid",
                "user", "stream_options"}  # fmt: skip
_OPENAI_HINTS = {"user", "safety_identifier", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                 "prompt_cache_options"}  # fmt: skip
_COMPLETIONS_READ = _OPENAI_READ | {"prompt", "logprobs", "best_of"}
_COMPLETIONS_NEUTRAL: dict[str, tuple[Check, str]] = {
    "echo": (_false, "echo is not honoured: the answer never repeats the prompt"),
    "suffix": (_empty, "suffix (insertion) is not honoured"),
}
_CHAT_READ = _OPENAI_READ | {"messages", "tools", "logprobs", "top_logprobs", "max_completion_tokens",
                             "chat_template_kwargs", "add_generation_prompt"}  # fmt: skip
_CHAT_NEUTRAL: dict[str, tuple[Check, str]] = {
    "tool_choice": (lambda v: v is None or v == "auto", "tool_choice other than auto is not honoured"),
    "parallel_tool_calls": (lambda v: v is None or v is True, "parallel_tool_calls: false is not honoured"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "response_format other than text is refused"),
    "reasoning_effort": (_is_none, "reasoning_effort is not honoured"),
    "verbosity": (_is_none, "verbosity is not honoured"),
    "audio": (_is_none, "audio output is not served"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is served"),
    "prediction": (_is_none, "predicted outputs are not honoured"),
    "web_search_options": (_is_none, "web search is not served"),
    "functions": (_is_none, "functions (deprecated) are not rendered: send tools"),
    "function_call": (lambda v: v is None or v == "auto", "function_call is not honoured"),
    "store": (_false, "store is not honoured: nothing is kept for later retrieval"),
    "moderation": (_is_none, "moderation is not served"),
}


def known_fields(route: Route) -> set[str]:
    """Every top-level field a route's body may carry; any other is refused as unknown."""
    if route == "generate":
        return _GENERATE_READ | _GENERATE_HINTS | set(_GENERATE_NEUTRAL)
    own, neutral = (_COMPLETIONS_READ, _COMPLETIONS_NEUTRAL) if route == "completions" else (_CHAT_READ, _CHAT_NEUTRAL)
    return own | _OPENAI_SAMPLING | _OPENAI_HINTS | set(neutral)


def check_fields(body: dict[str, Any], read: set[str], hints: set[str], neutral: dict[str, tuple[Check, str]],
                 *, where: str = "") -> None:  # fmt: skip
    """Every field known, and each one honoured only at a value it is honoured at; otherwise a
    ``RefusedField`` naming it."""
    for name, value in body.items():
        if name in read or name in hints:
            continue
        if name in neutral:
            ok, why = neutral[name]
            if not ok(value):
                raise RefusedField(where + name, f"{where}{name}: {why}")
            continue
        raise RefusedField(where + name, f"unknown field {where}{name}")


def _sampling_extras(params: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The sampling fields the payload does not read: refused unless neutral, and SGLang's text
    options, typed, to be passed to the engine."""
    extra: dict[str, Any] = {}
    for name, value in params.items():
        if name in _SAMPLING_READ or value is None:
            continue
        if name in _TEXT_OPTIONS:
            if not _TEXT_OPTIONS[name](value):
                raise RefusedField(where + name, f"{where}{name} has the wrong type or value: {type(value).__name__}")
            extra[name] = value
        elif name in _NEUTRAL_SAMPLING:
            ok, why = _NEUTRAL_SAMPLING[name]
            if not ok(value):
                raise RefusedField(where + name, f"{where}{name}: {why}")
    return extra


def _int(value: Any, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RefusedField(name, f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise RefusedField(name, f"{name} must be >= {minimum}, got {value}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RefusedField(name, f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise RefusedField(name, f"{name} must be true or false, got {type(value).__name__}")
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise RefusedField(name, f"{name} must be a non-empty list of token ids")
    return [_int(t, f"{name}[]", minimum=0) for t in value]


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# -- headers, body and keys ---------------------------------------------------------------------

IDEMPOTENCY_HEADER = "Idempotency-Key"
SESSION_HEADERS = ("X-Session-Id", "X-SMG-Routing-Key")  # (miles' router sends the second)
_MAX_SESSION_KEY = 512


def header_text(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value as text, or None when absent. aiohttp hands over bytes that are not UTF-8
    as lone surrogates: such a value, or one with control characters, is a 400 naming the header
    (never its value: it may be a secret)."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"the {name} header is not UTF-8 text") from None
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidRequest(f"the {name} header has control characters")
    return value


def authorized(headers: Mapping[str, str], api_key: str) -> bool:
    """Whether ``Authorization: Bearer <api_key>`` was sent (compared in constant time; a value
    that is not text is simply not the key, and is never echoed or logged)."""
    given = headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {api_key}".encode())


def read_body(raw: bytes, max_bytes: int) -> Any:
    """The request body as JSON: bounded in size and depth, and refused whole when an object
    has a key twice (which value a client meant is not ours to guess)."""
    return load_json(raw, what="the request body", max_bytes=max_bytes, refuse_duplicate_keys=True)


def _key(body: dict[str, Any], header: str | None) -> str | None:
    """The client's idempotency key: ``Idempotency-Key``, or SGLang's ``rid``; both given, they
    must agree."""
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RefusedField("rid", "rid must be a string (a list of them only for a batch of inputs)")
    if header is not None and rid is not None and rid != header:
        raise RefusedField("rid", f"rid and the {IDEMPOTENCY_HEADER} header name different keys: give one, or the same")
    key, source = (header, IDEMPOTENCY_HEADER) if header is not None else (rid, "rid")
    if key is not None and not 1 <= len(key) <= DEFAULT_LIMITS.max_key_chars:
        raise RefusedField(source, f"{source}: an idempotency key has 1 to {DEFAULT_LIMITS.max_key_chars} characters")
    return key


def session_id_of(key: str) -> str:
    """The rollfleet session a trajectory's header names: a digest of it, so that any header
    value (a user's string, a UUID, a hash) becomes a valid, stable session id of bounded size."""
    if not key or len(key) > _MAX_SESSION_KEY:
        raise InvalidRequest(f"a session header must be 1 to {_MAX_SESSION_KEY} characters")
    return "gw-" + hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def session_of(headers: Mapping[str, str]) -> str | None:
    """The rollfleet session of a request that names its trajectory (``X-Session-Id``, or miles'
    ``X-SMG-Routing-Key``), or None."""
    for name in SESSION_HEADERS:
        value = header_text(headers, name)
        if value is not None:
            return session_id_of(value)
    return None


@dataclass(frozen=True)
class GatewayRequest:
    route: Route
    payload: RolloutPayload
    constraint: AskedConstraint  # which versions may serve it, as Stitch's object or the default says
    idempotency_key: str | None  # the client's (None: it gave none)
    stream: bool
    logprobs: bool  # return them (the payload always asks the engine for them)
    model: str | None = None
    user: str | None = None  # OpenAI's end-user id: logged with the request, changes nothing generated
    # A request no replica serves now waits for one (``submit(..., wait_for_replica=True)``) rather
    # than taking ``NoCompatibleReplica``.
    wait_for_replica: bool = False


def constraint_of(body: dict[str, Any], default_max_staleness: int | None) -> tuple[AskedConstraint, bool]:
    """Stitch's ``weight_version`` object (exactly one of its two version fields, an integer, and
    optionally ``wait_for_replica``, true or false), else the gateway's default (``max_staleness``
    below the latest version, or any version); and whether it waits for a replica."""
    spec = body.get("weight_version")
    if spec is None:
        if default_max_staleness is None:
            return ANY_VERSION, False
        return AskedConstraint("staleness", default_max_staleness), False
    one_of = "weight_version: give exactly one of min_required_version or exact_version"
    if not isinstance(spec, dict):
        raise RefusedField("weight_version", f"{one_of}, in an object")
    unknown = set(spec) - _CONSTRAINT_KEYS
    if unknown:
        raise RefusedField("weight_version", f"{one_of} (and wait_for_replica); unknown fields {sorted(unknown)}")
    wait = spec.get("wait_for_replica")
    if wait is not None and not isinstance(wait, bool):
        name = "weight_version.wait_for_replica"
        raise RefusedField(name, f"{name} must be true or false, got {type(wait).__name__}")
    given = {k: spec[k] for k in _VERSION_KEYS if spec.get(k) is not None}
    if len(given) != 1:  # ({} or nulls would mean "any version": that is said by leaving the object out)
        raise RefusedField("weight_version", one_of)
    ((name, value),) = given.items()
    version = _int(value, f"weight_version.{name}", minimum=0)
    return AskedConstraint("exact" if name == "exact_version" else "min", version), wait is True


def check_turn(parsed: GatewayRequest | list[GatewayRequest]) -> None:
    """What a trajectory's turn (a request naming its session, ``X-Session-Id``) may not be: a
    batch of inputs, or a request that waits for a replica (its session places each turn on the
    replica holding its context, and answers one no replica serves at once)."""
    if isinstance(parsed, list):
        raise InvalidRequest("a batch of inputs cannot be one session's turn: send the turns one by one")
    if parsed.wait_for_replica:
        raise RefusedField("weight_version.wait_for_replica",
                           "weight_version.wait_for_replica is not honoured for a session's turn: send it without "
                           "X-Session-Id, or without wait_for_replica")  # fmt: skip


def _model(body: dict[str, Any], served: str | None) -> str | None:
    """The ``model`` asked for: absent, or the one this gateway serves (OpenAI's 404
    ``model_not_found`` otherwise; the answer names the served model, never an echo)."""
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise RefusedField("model", "model must be a string")
    if served is not None and model != served:
        raise ModelNotFound(f"this gateway serves the model {served!r} only (GET /v1/models)")
    return model


def _user(body: dict[str, Any]) -> str | None:
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise RefusedField("user", "user must be a string of at most 256 characters")
    return user


MAX_BATCH = 256  # inputs in one /generate request


def _batch_keys(body: dict[str, Any], header: str | None, size: int) -> list[str | None]:
    """One idempotency key an input: ``<Idempotency-Key>/<i>``, or SGLang's list of ``rid`` (both
    given, they must agree)."""
    rid = body.get("rid")
    derived = None if header is None else [f"{header}/{i}" for i in range(size)]
    if rid is None:
        return list(derived) if derived is not None else [None] * size
    if not isinstance(rid, list) or len(rid) != size or not all(isinstance(r, str) and r for r in rid):
        raise RefusedField("rid", f"rid must be a list of {size} strings, one an input")
    if len(set(rid)) != size:
        raise RefusedField("rid", "rid must not repeat within a batch")
    if derived is not None and rid != derived:
        raise RefusedField("rid", "rid and the Idempotency-Key header name different keys: give one, or the same")
    return list(rid)


def parse_generate(
    body: Any, *, key_header: str | None, default_max_staleness: int | None, model_name: str | None = None
) -> GatewayRequest | list[GatewayRequest]:
    """SGLang's ``/generate`` body: one input, or a batch (``text`` a list of strings,
    ``input_ids`` a list of lists; ``sampling_params`` one for all or a list, one an input)."""
    body = _object(body)
    check_fields(body, _GENERATE_READ, _GENERATE_HINTS, _GENERATE_NEUTRAL)
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise InvalidRequest("give exactly one of input_ids or text")
    params = {} if body.get("sampling_params") is None else body["sampling_params"]
    batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if not batched:
        if text is not None and not isinstance(text, str):
            raise RefusedField("text", "text must be a string, or a list of strings for a batch")
        if isinstance(params, list):
            raise RefusedField("sampling_params", "sampling_params may be a list only for a batch of inputs")
        return _generate_one(body, ids, text, params, _key(body, key_header), default_max_staleness)
    inputs: list[Any] = text if text is not None else ids  # type: ignore[assignment]
    if not inputs or len(inputs) > MAX_BATCH:
        raise InvalidRequest(f"a batch must have 1 to {MAX_BATCH} inputs, got {len(inputs)}")
    if _bool(body.get("stream", False), "stream"):
        raise RefusedField("stream", "a batch of inputs cannot be streamed: stream one input a request")
    if isinstance(params, list) and len(params) != len(inputs):
        raise RefusedField("sampling_params", f"sampling_params must be an object, or a list of {len(inputs)}")
    keys = _batch_keys(body, key_header, len(inputs))
    out = []
    for i, one in enumerate(inputs):
        if text is not None and not isinstance(one, str):
            raise RefusedField(f"text[{i}]", f"text[{i}] must be a string")
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
        raise RefusedField("sampling_params", f"sampling_params must be an object, got {type(params).__name__}")
    unknown = set(params) - SAMPLING_FIELDS
    if unknown:
        name = sorted(unknown)[0]
        raise RefusedField(
            f"sampling_params.{name}",
            f"sampling_params has unknown fields {sorted(unknown)} (SGLang's names are expected)",
        )
    sampling, extra, n = _sampling(params, where="sampling_params.")
    payload = RolloutPayload(
        prompt_token_ids=_token_ids(ids, "input_ids") if ids is not None else None,
        prompt_text=text,
        sampling=sampling,
        n=n,
        extra=extra,
    )
    constraint, waits = constraint_of(body, default_max_staleness)
    return GatewayRequest(
        route="generate",
        payload=payload,
        constraint=constraint,
        wait_for_replica=waits,
        idempotency_key=key,
        stream=_bool(body.get("stream", False), "stream"),
        logprobs=_bool(body.get("return_logprob") or False, "return_logprob"),
    )


def _sampling(params: dict[str, Any], *, where: str, max_tokens: str = "max_new_tokens", seed: str = "sampling_seed",
              default_max: int = 128) -> tuple[SamplingParams, dict[str, Any], int]:  # fmt: skip
    """The sampling fields every route shares (SGLang's names; OpenAI's routes name the token limit
    and the seed their own way): the parameters, what passes to the engine as it is (``ignore_eos``,
    SGLang's text options), and ``n``."""

    def given(name: str, default: Any) -> Any:
        value = params.get(name)
        return default if value is None else value

    top_k = _int(params["top_k"], where + "top_k") if params.get("top_k") is not None else 0
    stop_ids = params.get("stop_token_ids")
    sampling = SamplingParams(
        max_tokens=_int(given(max_tokens, default_max), where + max_tokens, minimum=1),
        temperature=_float(given("temperature", 1.0), where + "temperature"),
        top_p=_float(given("top_p", 1.0), where + "top_p"),
        top_k=0 if top_k < 0 or top_k >= _NO_TOP_K else top_k,
        stop_token_ids=_token_ids(stop_ids, where + "stop_token_ids") if stop_ids else [],
        seed=_int(params[seed], where + seed) if params.get(seed) is not None else None,
        logprobs=True,
    )
    extra: dict[str, Any] = {}
    if params.get("ignore_eos") is not None and _bool(params["ignore_eos"], where + "ignore_eos"):
        extra["ignore_eos"] = True
    text_options = _sampling_extras(params, where=where)
    if text_options:
        extra["sampling_params"] = text_options
    return sampling, extra, _int(given("n", 1), where + "n", minimum=1)


# SGLang's sampling names taken at the top level of OpenAI's bodies (its OpenAI server takes them
# there too), less the two OpenAI names its own way (``max_tokens``, ``seed``).
_OPENAI_SAMPLING = SAMPLING_FIELDS - {"max_new_tokens", "sampling_seed"}


def _openai_common(body: dict[str, Any], read: set[str], neutral: dict[str, tuple[Check, str]],
                   model_name: str | None) -> tuple[str | None, str | None]:  # fmt: skip
    """What OpenAI's two routes check alike: every field known and honoured (SGLang's sampling
    names are taken at the top level too), the model, the end-user id, ``stream_options``."""
    check_fields(body, read | _OPENAI_SAMPLING, _OPENAI_HINTS, neutral)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", True), bool)):  # fmt: skip
        # (the last event always carries usage: include_usage is honoured either way)
        raise RefusedField("stream_options", "stream_options may only carry include_usage (true or false)")
    return _model(body, model_name), _user(body)


def parse_completions(
    body: Any, *, key_header: str | None, default_max_staleness: int | None, model_name: str | None = None
) -> GatewayRequest:
    """OpenAI's ``/v1/completions`` body (one prompt: text or token ids)."""
    body = _object(body)
    model, user = _openai_common(body, _COMPLETIONS_READ, _COMPLETIONS_NEUTRAL, model_name)
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
        raise RefusedField("prompt", "prompt must be a string or a list of token ids (one prompt a request)")
    logprobs = body.get("logprobs")
    if logprobs is not None and _int(logprobs, "logprobs", minimum=0) > 0:
        raise RefusedField("logprobs", "logprobs: only 0 (the sampled tokens' own log-probs): no engine gives top-k")
    sampling, extra, n = _sampling(body, where="", max_tokens="max_tokens", seed="seed", default_max=16)
    best_of = body.get("best_of")
    if best_of is not None and _int(best_of, "best_of", minimum=1) not in (1, n):
        raise RefusedField("best_of", "best_of is not honoured: only 1, or equal to n (every sample is returned)")
    constraint, waits = constraint_of(body, default_max_staleness)
    return GatewayRequest(
        route="completions",
        payload=RolloutPayload(prompt_token_ids=ids, prompt_text=text, sampling=sampling, n=n, extra=extra),
        constraint=constraint,
        wait_for_replica=waits,
        idempotency_key=_key(body, key_header),
        stream=_bool(body.get("stream") or False, "stream"),
        logprobs=logprobs is not None,
        model=model,
        user=user,
    )


def parse_chat(
    body: Any,
    *,
    key_header: str | None,
    default_max_staleness: int | None,
    template: ChatTemplate | None,
    now: datetime | None = None,
    model_name: str | None = None,
) -> GatewayRequest:
    """OpenAI's ``/v1/chat/completions`` body: the conversation rendered into one prompt with the
    served model's chat template (a gateway started without one refuses chat, naming the flag)."""
    body = _object(body)
    model, user = _openai_common(body, _CHAT_READ, _CHAT_NEUTRAL, model_name)
    if template is None:
        raise InvalidRequest("this gateway has no chat template: start it with --tokenizer DIR (the model's files)")
    messages = messages_of(body.get("messages"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RefusedField("chat_template_kwargs", "chat_template_kwargs must be an object")
    add_generation_prompt = _bool(body.get("add_generation_prompt", True), "add_generation_prompt")
    top = body.get("top_logprobs")
    if top is not None and _int(top, "top_logprobs", minimum=0) > 0:
        raise RefusedField("top_logprobs", "top_logprobs: only 0; the engines give the sampled token's own log-prob")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {**body, "max_tokens": limit}
    sampling, extra, n = _sampling(params, where="", max_tokens="max_tokens", seed="seed", default_max=128)
    prompt = template.render(messages, tools=tools_of(body.get("tools")), add_generation_prompt=add_generation_prompt,
                             kwargs=kwargs, now=now)  # fmt: skip
    if not prompt:
        raise InvalidRequest("the chat template rendered the conversation to an empty prompt")
    constraint, waits = constraint_of(body, default_max_staleness)
    return GatewayRequest(
        route="chat",
        payload=RolloutPayload(prompt_text=prompt, sampling=sampling, n=n, extra=extra),
        constraint=constraint,
        wait_for_replica=waits,
        idempotency_key=_key(body, key_header),
        stream=_bool(body.get("stream") or False, "stream"),
        logprobs=_bool(body.get("logprobs") or False, "logprobs"),
        model=model,
        user=user,
    )


# -- responses ---------------------------------------------------------------------------------


def json_bytes(body: Any) -> bytes:
    """A response body as JSON text: msgspec's encoder (compact, UTF-8; a fraction of
    ``json.dumps``'s time on the request path), the same JSON values ``json.dumps`` writes. A float
    that is not finite is written ``null``, as SGLang's own server writes it (``NaN`` and
    ``Infinity`` are not JSON: strict parsers refuse the whole answer). A string that is not
    Unicode text (a lone surrogate, which a body may send as ``"\\ud800"``) is written with
    ``json.dumps``'s escapes, as msgspec refuses it."""
    try:
        return msgspec.json.encode(body)
    except UnicodeEncodeError:
        return json.dumps(body).encode()


def sse_event(body: Any) -> bytes:
    """One server-sent event carrying ``body`` (JSON never holds a raw line break)."""
    return b"data: " + json_bytes(body) + b"\n\n"


def _finish(reason: str, tokens: int) -> dict[str, Any]:
    # SGLang's shape: {"type": "length", "length": N} | {"type": "stop", "matched": ...} | {"type": "abort"}
    return {"type": "length", "length": tokens} if reason == "length" else {"type": reason}


def _facts(result: RolloutResult, index: int) -> dict[str, Any]:
    """rollfleet's own facts beside each shape's fields: which version made which tokens, and what
    it takes to generate the sample again (``replay``, the coordinate's wire form)."""
    out = result.outputs[index]
    return {
        "job_id": result.job_id,
        "idempotency_key": result.idempotency_key,
        "replica": result.worker_id,
        "weight_versions": [[s.version, s.start, s.end, s.replica or result.worker_id] for s in out.weight_versions],
        "queue_wait_s": result.queue_wait_s,
        "generation_s": result.generation_s,
        "replay": coordinate_wire(result.replay, index),
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


class RouteNotFound(InvalidRequest):
    """No route at this path (404)."""

    code = "not_found"


class MethodNotAllowed(InvalidRequest):
    """The path's route takes other methods (405, with ``Allow``)."""

    code = "method_not_allowed"

    def __init__(self, message: str, allowed: list[str]) -> None:
        super().__init__(message)
        self.allowed = allowed


class BodyTooLarge(InvalidRequest):
    """The request's body is larger than the gateway reads (413)."""

    code = "request_too_large"


class RequestTimeout(InvalidRequest):
    """The request's body did not arrive in time (408)."""

    code = "request_timeout"


_STATUS = {
    "no_compatible_replica": 409,
    "expired": 504,
    "invalid_request": 400,
    "unsupported_schema": 400,
    "model_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "request_timeout": 408,
    "request_too_large": 413,
    "idempotency_conflict": 422,
    "cancelled": 499,
    "unauthorized": 401,
    "session_conflict": 409,  # (a turn of the trajectory still running, or other settings)
    "unknown_session": 404,
}


def error_reply(exc: RollfleetError, *, retry_after_s: int = 1) -> ErrorReply:
    """The HTTP status a client can act on: 409 with ``Retry-After`` when no replica can serve
    the constraint now (``retry_after_s``: see ``retry_after_s``), 504 past the deadline, 400 for
    bad input (naming the field in ``param``, as OpenAI's errors do), 401 with
    ``WWW-Authenticate``, 503 for other retryable errors, 500 otherwise; the body carries the
    error's code and ``retryable`` flag."""
    code = exc.code
    status = _STATUS.get(code, 503 if exc.retryable else 500)
    headers = {"Retry-After": "1"} if status in (409, 503) else {}
    if code == "no_compatible_replica":
        headers["Retry-After"] = str(retry_after_s)
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="rollfleet"'
    if isinstance(exc, MethodNotAllowed):
        headers["Allow"] = ", ".join(exc.allowed)
    error: dict[str, Any] = {"code": code, "message": exc.message, "retryable": exc.retryable,
                             "type": type(exc).__name__}  # fmt: skip
    name = getattr(exc, "field", None)
    if isinstance(name, str):
        error["param"] = name
    return ErrorReply(status, {"error": error}, headers)


AUTOSCALER_FRESH_S = 60.0  # a status older than this is not read (a live controller writes one every 15 s)
MAX_RETRY_AFTER_S = 3600


def retry_after_s(constraint: AskedConstraint, autoscaler_status: bytes | None, now: float) -> int:
    """What a 409's ``Retry-After`` says: the seconds until the fleet's autoscaler expects a
    replica of the class the constraint needs to serve, where its last published status (the
    fleet bucket's ``autoscaler.status``, written within ``AUTOSCALER_FRESH_S``) says one is
    starting there (``classes.<class>.serving_by``: its launch plus the start-up time it measured
    from its own launches, unix time); else 1 (a replica may register any moment; nothing says
    when). The class: an exact version older than the status's ``latest`` is that version's (a
    replica held there); any other constraint is the followers' (``latest``), unless it asks for
    a version past ``latest``, which no replica starting now will serve. ``now`` is this host's
    unix time: its skew from the controller's clock errs the wait as it errs a job's deadline."""
    if not autoscaler_status:
        return 1
    try:
        doc = load_json(autoscaler_status, what="the autoscaler's status", max_bytes=1 << 20)
        latest, at, classes = doc.get("latest"), float(doc["at"]), doc["classes"]
    except (InvalidRequest, AttributeError, KeyError, TypeError, ValueError):
        return 1  # (a status this gateway cannot read says nothing)
    if not isinstance(classes, dict) or not isinstance(latest, int) or now - at > AUTOSCALER_FRESH_S:
        return 1  # (a controller clock a little ahead of this one is no staleness)
    exact = constraint.value if constraint.kind == "exact" else None
    version = None if constraint.kind == "staleness" else constraint.value
    if version is not None and version > latest:
        return 1
    klass = str(exact) if exact is not None and exact < latest else "latest"
    row = classes.get(klass)
    serving_by = row.get("serving_by") if isinstance(row, dict) else None
    if isinstance(serving_by, bool) or not isinstance(serving_by, int | float) or not math.isfinite(serving_by):
        return 1
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(serving_by - now)))
