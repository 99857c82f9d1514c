"""How a request's samples are drawn: the sampling parameters every engine reads."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True
