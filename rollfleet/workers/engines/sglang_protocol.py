"""SGLang's ``/generate`` as data: the body the adapter sends, the answer it reads, and what a
server's ``/server_info`` says of its build. Pure functions (no I/O), checked against SGLang
0.5.23's own types in ``tests/test_engine_sglang_contract.py``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollfleet.schemas import Completion, EngineBuild, RolloutPayload
from rollfleet.schemas.errors import EngineFailure
from rollfleet.workers.engines.base import sample_seed
from rollfleet.workers.engines.server_protocol import finish_reason, parse_spans, parse_version, span_labels

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def generate_body(rids: list[str], payload: RolloutPayload, session_id: str | None, salt: str | None) -> dict[str, Any]:
    """The ``/generate`` body of a request of ``len(rids)`` samples (one rid and stream each);
    ``salt``: the prefix cache's namespace (the weight version), None for none."""
    s = payload.sampling
    base: dict[str, Any] = {
        "max_new_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,  # SGLang: -1 means no top-k cut
    }
    if s.stop_token_ids:
        base["stop_token_ids"] = list(s.stop_token_ids)
    if payload.extra.get("ignore_eos"):
        base["ignore_eos"] = True
    base.update(payload.extra.get("sampling_params", {}))  # SGLang-specific pass-through
    per_sample = []
    for i in range(len(rids)):
        params = dict(base)
        if (seed := sample_seed(s.seed, i)) is not None:
            params["sampling_seed"] = seed
        per_sample.append(params)
    single = len(rids) == 1
    body: dict[str, Any] = {
        "rid": rids[0] if single else rids,
        "sampling_params": per_sample[0] if single else per_sample,
        "return_logprob": s.logprobs,
        "stream": False,
    }
    if payload.prompt_token_ids is not None:
        ids = list(payload.prompt_token_ids)
        body["input_ids"] = ids if single else [ids] * len(rids)
    else:
        body["text"] = payload.prompt_text if single else [payload.prompt_text] * len(rids)
    if salt is not None:
        body["cache_salt"] = salt
    if session_id is not None:
        body["session_id"] = body["routing_key"] = session_id
    return body


def parse_item(
    item: Mapping[str, Any], want_logprobs: bool, aborted: bool, max_tokens: int | None = None
) -> tuple[Completion, int | None, int]:
    """One sample of a ``/generate`` answer: its completion, the version SGLang says served it
    (None: no rollfleet version) and the prompt's length. ``aborted``: the adapter aborted the
    request (``server_protocol.finish_reason`` says how the sample ended)."""
    meta = item.get("meta_info") or {}
    triples = meta.get("output_token_logprobs") or []
    tokens = item.get("output_ids")
    if tokens is None:
        tokens = [int(t[1]) for t in triples]
    logprobs = None
    if want_logprobs:
        logprobs = [float(t[0]) if t[0] is not None else float("nan") for t in triples]
        if len(logprobs) != len(tokens):
            raise EngineFailure(f"SGLang returned {len(logprobs)} log-probs for {len(tokens)} tokens")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    said = FINISH.get(str(kind), "abort") if kind is not None else "abort"
    reason = finish_reason(said, len(tokens), max_tokens, aborted)  # type: ignore[arg-type]
    completion = Completion(
        token_ids=[int(t) for t in tokens],
        finish_reason=reason,  # type: ignore[arg-type]
        logprobs=logprobs,
        text=item.get("text") if isinstance(item.get("text"), str) else None,
        weight_versions=parse_spans(meta.get("weight_versions"), len(tokens)),
    )
    return completion, parse_version(meta.get("weight_version")), int(meta.get("prompt_tokens") or 0)


def labels(item: Mapping[str, Any]) -> list[object]:
    """The weight-version labels an answer attributes its tokens to (as SGLang sent them)."""
    meta = item.get("meta_info") or {}
    return span_labels(meta.get("weight_versions")) or ([meta["weight_version"]] if "weight_version" in meta else [])


def cached_tokens(item: Mapping[str, Any]) -> int:
    """SGLang's ``meta_info.cached_tokens`` (0 where absent or not a count)."""
    value = (item.get("meta_info") or {}).get("cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def runs_deterministic(info: Mapping[str, Any]) -> bool:
    """Whether a server says it runs deterministic inference (``/server_info``): SGLang seeds a
    request's sampling from its ``sampling_seed`` only then (and every unseeded one with 42), and
    its batch-invariant kernels make the log-probs the same whatever runs beside it. Not
    measured here (SGLang needs a GPU); the server's own resolved arguments are the fact."""
    return info.get("enable_deterministic_inference") is True


def server_build(info: Mapping[str, Any], deterministic: bool) -> EngineBuild:
    """What a replay coordinate records of a server's build, from its ``/server_info``."""
    version, dtype, device = info.get("version"), info.get("dtype"), info.get("device")
    return EngineBuild(
        "sglang",
        version if isinstance(version, str) else "",
        dtype=dtype if isinstance(dtype, str) and dtype != "auto" else "",
        device=device if isinstance(device, str) else "",
        deterministic=deterministic,
    )
