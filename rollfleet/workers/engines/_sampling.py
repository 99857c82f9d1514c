"""Next-token sampling for the hf engine: temperature, top-k, top-p, per-request seeds.

Log-probability rule (what ``Completion.logprobs`` holds): the log-softmax of the
temperature-scaled logits, ``log_softmax(logits / T)[token]``, before any top-k/top-p
truncation. That is the behaviour policy an RL trainer recomputes (``logits / T``) for
importance weights; truncation is a sampling detail trainers do not model. With
``temperature == 0`` (greedy) the rule uses ``T = 1``, since a one-hot distribution would
make every log-prob 0 and tell the trainer nothing.
"""

from __future__ import annotations

import torch

from rollfleet.schemas import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


def advance_stream(gen: torch.Generator, draws: int, like: torch.Tensor) -> None:
    """Advance ``gen`` past ``draws`` tokens' draws, as ``sample_token`` makes them from logits
    rows shaped as ``like``: a stream replayed from inside a request. (``multinomial`` of one
    sample draws by the distribution's shape and dtype, never its values: drawing from a uniform
    row of the same shape leaves the generator where the real draws left it.)"""
    uniform = torch.full_like(like, 1.0 / like.numel(), dtype=torch.float32)
    for _ in range(draws):
        torch.multinomial(uniform, 1, generator=gen)


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> tuple[int, float]:
    """Sample one token from a ``[vocab]`` float32 logits row; returns (token, logprob)."""
    if params.temperature <= 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logp[token])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    filtered = _truncate(logp, params.top_k, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logp[token])


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the top-p nucleus."""
    vocab = logp.shape[-1]
    out = logp
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logp, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= top_p  # the first token always stays: its mass_before is 0
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        out = torch.empty_like(out).scatter_(-1, order, sorted_logp)
    return out
