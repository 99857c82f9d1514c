"""Tokens that prove their weights: the echo engine's ``keyed`` mode, as pure functions.

A keyed echo engine makes each output token from three things only: the key of the tensor
bytes it holds (``weights_key``, recomputed from its local checkpoint at start and at every
activation), the token context (the prompt and the tokens so far) and the sample's stream (its
seed, or its index within the request). Anyone holding a version's bytes can recompute every
token of an answer labelled with that version (the reliability oracle does, from the trainer's
own tensors): a label that does not match the weights that served shows as different tokens.

The weights key is blake2b-256 over, for each tensor in sorted name order, the name's length
(8 bytes, little-endian), the name (UTF-8), the data's length (8 bytes) and the raw data bytes
(as safetensors stores them). The oracle re-implements that rule with its own code on purpose.

A token depends on the whole context through a chained hash of its tokens (``context_state``),
never on where the prompt ended: a resumed generation (the prompt and the tokens kept so far
sent as one prompt) continues the same function, and no two contexts share a continuation. A
seeded sample ``i`` draws the stream ``sample_seed(seed, i)`` on every token (the rule of every
engine: a resumed sample, sent alone with that seed, goes on with the same stream); an unseeded
one differs from sample 0 only by ``i`` added to its first token, after which its own context
sets it apart (an unseeded sample resumed before its first token, sent alone, cannot know its
index: it is made as sample 0 is).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence

from rollfleet.workers.engines.base import sample_seed

VOCAB = 32_000  # the echo engine's default vocabulary
EMPTY = bytes(16)  # the state of an empty context
_U64 = 0xFFFF_FFFF_FFFF_FFFF


def weights_key(tensors: Mapping[str, bytes]) -> bytes:
    """The key of a checkpoint's tensors (name -> raw bytes); see the module's docstring."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        raw = name.encode()
        data = tensors[name]
        h.update(struct.pack("<Q", len(raw)) + raw + struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


def context_state(tokens: Iterable[int], state: bytes = EMPTY) -> bytes:
    """The state of a context: ``state`` (the context so far) followed by ``tokens``."""
    for t in tokens:
        state = hashlib.blake2b(state + struct.pack("<Q", t & _U64), digest_size=16).digest()
    return state


def keyed_token(key: bytes, context: bytes, *, seed: int | None, sample: int, first: bool, vocab: int) -> int:
    """The token that follows the context whose ``context_state`` is ``context``, for sample
    ``sample`` of a request (``first``: the sample's first output token), under the weights whose
    key is ``key``."""
    # An unseeded stream is tagged apart from every seeded one (a seed may be any integer).
    own = sample_seed(seed, sample)
    stream = struct.pack("<BQ", 0, 0) if own is None else struct.pack("<BQ", 1, own & _U64)
    h = hashlib.blake2b(stream + context, digest_size=8, key=key)
    shift = sample if seed is None and first else 0
    return (int.from_bytes(h.digest(), "little") + shift) % vocab


def keyed_tokens(
    key: bytes, prompt: Sequence[int], count: int, *, seed: int | None, sample: int, vocab: int
) -> list[int]:
    """The first ``count`` tokens of sample ``sample`` of a fresh request for ``prompt``."""
    state = context_state(prompt)
    out: list[int] = []
    for i in range(count):
        tok = keyed_token(key, state, seed=seed, sample=sample, first=i == 0, vocab=vocab)
        out.append(tok)
        state = context_state((tok,), state)
    return out
