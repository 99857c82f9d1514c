"""The truth of what served: every token of an answer recomputed from the trainer's weights.

The adversary's echo workers run keyed (``--echo-keyed``): each token they make is a function
of the tensor bytes they hold, the context and the sample's stream
(``rollfleet.workers.engines.keyed.keyed_token``). So the oracle can take the version each span
of an accepted answer claims, key the trainer's own tensors at that version and recompute
every token of the span; a label that does not name the weights that really served shows as
different tokens. The weights' key is computed here with this module's own code (the rule in
``keyed``'s docstring), from the trainer's tensors, never from a replica or rollfleet's digests.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollfleet.workers.engines.keyed import VOCAB, context_state, keyed_token


def tensors_key(tensors: Mapping[str, np.ndarray]) -> bytes:
    """blake2b-256 over each tensor in sorted name order: name length, name, data length, raw
    bytes (little-endian, C order: as safetensors stores them)."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name]).tobytes()
        raw = name.encode()
        h.update(struct.pack("<Q", len(raw)) + raw + struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


@dataclass(frozen=True)
class Mismatch:
    """Span ``[start, end)`` of completion ``sample``, labelled ``version``, is not what that
    version's weights make: ``bad`` of its tokens differ, the first at ``first``; ``fits``: the
    versions (among those tried) whose weights do make that token."""

    sample: int
    version: int
    start: int
    end: int
    bad: int
    first: int
    fits: tuple[int, ...] = ()

    def describe(self) -> str:
        made = f"; that token is what {', '.join(f'v{v}' for v in self.fits)} make(s)" if self.fits else ""
        return (f"sample {self.sample} tokens [{self.start}, {self.end}) labelled v{self.version}: {self.bad} are not "
                f"what v{self.version}'s weights make, the first at token {self.first}{made}")


@dataclass
class Verdict:
    checked: int = 0  # tokens recomputed
    skipped: int = 0  # tokens made by an engine that is not keyed (hf), or outside every span
    mismatches: list[Mismatch] = field(default_factory=list)


def recompute(
    key_of: Callable[[int], bytes],
    prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    spans: Sequence[Sequence[Sequence[int]]],
    *,
    seed: int | None,
    keyed: Callable[[int, int], bool] = lambda sample, span: True,
    versions: Sequence[int] = (),
    vocab: int = VOCAB,
) -> Verdict:
    """Recompute every token of ``completions`` (each sample's token ids) from the version its
    span ([version, start, end], per sample) names; ``keyed(sample, span index)`` says whether
    a keyed engine made that span. ``versions``: the versions to try when a token is wrong."""
    out = Verdict()
    for i, tokens in enumerate(completions):
        checked = 0
        for k, (version, start, end) in enumerate(spans[i] if i < len(spans) else []):
            start, end = int(start), int(end)
            if not keyed(i, k):
                continue
            if end > len(tokens) or start < 0 or start > end:  # a span over tokens the answer lacks
                lacking = Mismatch(i, int(version), start, end, max(1, end - start), min(start, len(tokens)))
                out.mismatches.append(lacking)
                continue
            key = key_of(int(version))
            context = context_state(tokens[:start], context_state(prompt))
            bad, first, fits = 0, -1, ()
            for j in range(start, end):
                want = keyed_token(key, context, seed=seed, sample=i, first=j == 0, vocab=vocab)
                if want != tokens[j] and not _alone(key, context, seed, i, j, tokens[j], vocab):
                    bad += 1
                    if first < 0:
                        first = j
                        fits = tuple(
                            v for v in versions
                            if keyed_token(key_of(v), context, seed=seed, sample=i, first=j == 0, vocab=vocab)
                            == tokens[j]
                        )
                context = context_state((tokens[j],), context)
            checked += end - start
            if bad:
                out.mismatches.append(Mismatch(i, int(version), start, end, bad, first, fits))
        out.checked += checked
        out.skipped += max(0, len(tokens) - checked)
    return out


def _alone(key: bytes, context: bytes, seed: int | None, sample: int, j: int, token: int, vocab: int) -> bool:
    """Whether ``token`` is an unseeded sample's first token as made when it was resumed before
    it had any token: sent alone (a request of one), it cannot know its index and starts as
    sample 0 would (and, the echo being deterministic, goes on as a copy of it; an engine that
    draws unseeded samples from fresh entropy makes no copy). Its later tokens are checked as
    any others, from their context."""
    return j == 0 and seed is None and sample > 0 and token == keyed_token(
        key, context, seed=None, sample=0, first=True, vocab=vocab
    )


class Truth:
    """The trainer's weights keyed per version (each computed once), and answers judged by them."""

    def __init__(self, weights: Any, vocab: int = VOCAB) -> None:
        self.weights = weights  # TrainerWeights: ``at(v)``, the trainer's tensors at version v
        self.vocab = vocab

    @functools.lru_cache(maxsize=512)  # noqa: B019 - one object per judged run, a few dozen versions
    def key(self, version: int) -> bytes:
        return tensors_key(self.weights.at(version))

    def judge(
        self,
        desc: dict[str, Any],
        prompt: Sequence[int],
        *,
        seed: int | None,
        keyed_replica: Callable[[str], bool],
        versions: Sequence[int] = (),
    ) -> Verdict:
        """An accepted answer's description (``journal.describe_result``: ``token_ids``, ``spans``,
        ``replicas``, ``worker_id``); ``keyed_replica(worker id)``: whether it runs a keyed engine.
        A completion with no spans is taken as made at ``version_start`` when that equals
        ``version_end`` (else its tokens are skipped)."""
        completions = desc.get("token_ids") or []
        spans = [list(s) for s in desc.get("spans") or []]
        replicas = desc.get("replicas") or []
        for i, tokens in enumerate(completions):
            if i >= len(spans):
                spans.append([])
            if not spans[i] and tokens and desc.get("version_start") == desc.get("version_end"):
                spans[i] = [[int(desc["version_start"]), 0, len(tokens)]]

        def keyed(sample: int, span: int) -> bool:
            names = replicas[sample] if sample < len(replicas) else []
            replica = names[span] if span < len(names) else None
            return keyed_replica(str(replica or desc.get("worker_id")))

        return recompute(self.key, prompt, completions, spans, seed=seed, keyed=keyed, versions=versions,
                         vocab=self.vocab)
