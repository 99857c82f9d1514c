"""Reading an inference server's answers: version labels, per-token version spans, errors.

Pure functions over what the SGLang and vLLM servers send back, shared by their adapters:
rollfleet versions as the integer strings the servers carry (``parse_version``), per-token
version spans (``parse_spans``, ``span_labels``), a request's version range
(``generation_versions``) and an error answer as one line (``error_message``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from rollfleet.schemas import Completion, VersionSpan
from rollfleet.schemas.messages import FinishReason


def parse_version(value: object) -> int | None:
    """A rollfleet version from a server's weight-version label; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def parse_spans(raw: object, n_tokens: int) -> list[VersionSpan]:
    """A server's ``weight_versions`` (``{version, start, end}`` over output tokens) as rollfleet
    spans; [] when absent, not rollfleet versions, or inconsistent with the tokens (they must tile
    ``[0, n_tokens)`` in order)."""
    if not isinstance(raw, list) or not raw:
        return []
    spans: list[VersionSpan] = []
    for item in raw:
        if not isinstance(item, Mapping):
            return []
        version = parse_version(item.get("version"))
        start, end = item.get("start"), item.get("end")
        if version is None or not isinstance(start, int) or not isinstance(end, int):
            return []
        if start != (spans[-1].end if spans else 0) or end < start:
            return []
        if spans and spans[-1].version == version:  # one version's tokens split in two: one span
            spans[-1] = VersionSpan(version=version, start=spans[-1].start, end=end)
        elif end > start or n_tokens == 0:
            spans.append(VersionSpan(version=version, start=start, end=end))
    if (spans[-1].end if spans else 0) != n_tokens:
        return []
    return spans


def span_labels(raw: object) -> list[object]:
    """The version labels a server's ``weight_versions`` spans name, as it sent them."""
    return [item.get("version") for item in raw if isinstance(item, Mapping)] if isinstance(raw, list) else []


def response_json(r: httpx.Response) -> dict[str, Any]:
    try:
        value = r.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_message(r: httpx.Response) -> str:
    body = response_json(r)
    err = body.get("error") or body.get("detail")
    if isinstance(err, Mapping):
        return str(err.get("message", err))
    if isinstance(err, list | str):
        return str(err)[:500]
    return str(body.get("message") or r.text[:500])


def generation_versions(
    outputs: Sequence[Completion], sent_on: int, served: Sequence[int], fallback: int
) -> tuple[int, int]:
    """(version_start, version_end) of a request: from the completions' spans where every one has
    them; otherwise the version the request was sent on (requests wait during activations, so it is
    exact or conservatively older) and the newest version the server reported (``served``)."""
    firsts = [o.weight_versions[0].version for o in outputs if o.weight_versions]
    lasts = [o.weight_versions[-1].version for o in outputs if o.weight_versions] + list(served)
    version_end = max(lasts) if lasts else fallback
    if outputs and len(firsts) == len(outputs):
        return min(firsts), version_end
    return min([sent_on, version_end, *firsts]), version_end


def finish_reason(said: FinishReason, made: int, max_tokens: int | None, aborted: bool) -> FinishReason:
    """How a sample an engine server answered ended, one rule for every server: ``said`` is the
    server's reason, ``made`` the tokens it made, ``aborted`` whether the adapter aborted the
    request (an activation). An aborted request ends ``abort`` unless it had made all
    ``max_tokens`` by then: an abort after the last token ends nothing, and an ``abort`` with
    every token made is ``length`` (campaign 7, seed 4242: a rollout loop trained a sample of 45
    of 45 tokens labelled abort)."""
    whole = max_tokens is not None and made >= max_tokens
    if aborted and not whole:
        return "abort"
    return "length" if said == "abort" and whole else said
