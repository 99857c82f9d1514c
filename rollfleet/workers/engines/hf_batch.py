"""The hf engine's decode batch: one forward pass per step over every active sequence.

``BatchStepper`` runs on the engine's step thread only. It owns the batch's KV cache
(``KVBatch``), assembled from per-sequence rows (``_kvrows``): a sequence that joins is
prefilled on its own rows (only the part of its prompt not already cached) and its rows are
merged into the running batch, whose members keep their KV; a sequence that leaves gives its row
back, and its KV goes to its session (``SessionCache``) for the session's next turn. KV is tagged
with the weights epoch it was computed on (``kv_epoch``) and never reused across an activation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rollfleet.workers.engines import _kvrows
from rollfleet.workers.engines._sampling import advance_stream, sample_token
from rollfleet.workers.engines.hf_requests import HFSeq
from rollfleet.workers.engines.session_cache import Branch, Lookup, SessionCache


@dataclass
class KVBatch:
    """KV-cache state owned by the step thread: which sequences the cache rows hold."""

    members: list[HFSeq] = field(default_factory=list)
    cache: Any = None
    mask: torch.Tensor | None = None  # [B, width]: 1 where a column holds the KV of one of the row's tokens
    valid: bool = True  # False: the rows' KV is from other weights, rebuild every row


def _out_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class BatchStepper:
    """Forward passes of the batch (prefill of joiners, decode of members) and its KV rows."""

    def __init__(self, device: torch.device, sessions: SessionCache) -> None:
        self.device = device
        self.sessions = sessions
        self.model: Any = None
        self.cache_kw = "past_key_values"  # the forward's name for the cache (``load``)
        self.rows = True  # whether the model's cache can be assembled from rows (``load``)
        self.batch = KVBatch()
        self.kv_epoch = 0  # bumps when an activation changes tensors: KV from before is stale
        self.prefills = 0  # forward passes that prefilled joining sequences
        self.prefill_tokens = 0  # tokens those passes computed (padding excluded)

    def load(self, model: Any, cache_kw: str, rows: bool) -> None:
        self.model, self.cache_kw, self.rows = model, cache_kw, rows

    def reset(self) -> None:
        """Forget every row (their KV is lost, not kept for sessions)."""
        self.batch = KVBatch()

    def settle(self) -> None:
        """Nothing is active: every row leaves (to its session, if any)."""
        try:
            with torch.inference_mode():
                self._release([])
        except Exception:  # losing cached rows is harmless: the next turns prefill
            self.batch = KVBatch()

    def step(self, batch: list[HFSeq]) -> list[tuple[int, float]]:
        """The next token of every sequence in ``batch`` and its log-prob (in that order)."""
        with torch.inference_mode():
            logits = self._forward(batch)
            for i, seq in enumerate(batch):
                if seq.skip_draws and seq.gen is not None:  # (a replay from inside a request: once, first)
                    advance_stream(seq.gen, seq.skip_draws, logits[i])
                    seq.skip_draws = 0
            return [sample_token(logits[i], seq.req.params, seq.gen) for i, seq in enumerate(batch)]

    def _release(self, batch: list[HFSeq]) -> KVBatch:
        """Rows of sequences not in ``batch`` leave (their KV kept for their sessions); with KV of
        other weights (``valid`` false) every row leaves."""
        state = self.batch
        wanted = {id(s) for s in batch}
        members = state.members
        if all(id(s) in wanted for s in members) and state.valid:
            return state
        for i, seq in enumerate(members):
            if id(seq) not in wanted:
                self._keep_for_session(state, i, seq)
        kept = [i for i, s in enumerate(members) if id(s) in wanted] if state.valid else []
        if not kept:
            self.batch = KVBatch()
            return self.batch
        state.cache, state.mask = _kvrows.select_rows(state.cache, state.mask, kept, compact=self.rows)  # type: ignore[arg-type]
        state.members = [members[i] for i in kept]
        return state

    def _forward(self, batch: list[HFSeq]) -> torch.Tensor:
        """Logits of the next token of every sequence in ``batch`` (in that order)."""
        state = self._release(batch)
        rows = {id(s) for s in state.members}
        joiners = [s for s in batch if id(s) not in rows]
        if joiners and state.members and not self.rows:  # cannot merge rows: prefill everyone again
            joiners, state = batch, KVBatch()
            self.batch = state
        logits: dict[int, torch.Tensor] = {}
        if state.members:
            logits.update(zip(map(id, state.members), self._decode(state), strict=True))
        if joiners:
            seqs, cache, mask, out = self._prefill(joiners)
            logits.update(zip(map(id, seqs), out, strict=True))
            if state.members:
                cache, mask = _kvrows.merge(state.cache, state.mask, cache, mask)  # type: ignore[arg-type]
            state.cache, state.mask, state.members = cache, mask, [*state.members, *seqs]
        return torch.stack([logits[id(s)] for s in batch])

    def _decode(self, state: KVBatch) -> torch.Tensor:
        """One token for every row: the last token of each sequence is not in the cache yet."""
        ids = torch.tensor([[s.tokens[-1]] for s in state.members], device=self.device)
        pos = state.mask.sum(dim=1, keepdim=True)  # type: ignore[union-attr]
        mask = F.pad(state.mask, (0, 1), value=1)  # type: ignore[arg-type]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: state.cache},
        )
        state.cache, state.mask = _out_cache(out), mask
        return out.logits[:, -1, :].float()

    def _prefill(self, joiners: list[HFSeq]) -> tuple[list[HFSeq], Any, torch.Tensor, torch.Tensor]:
        """Prefill ``joiners`` on rows of their own: what their session cache holds is reused, the
        rest computed in one pass (samples of one request that join together share one row, copied
        afterwards). Returns the sequences in row order, their cache, mask and next-token logits."""
        groups: dict[int, list[HFSeq]] = {}
        for seq in joiners:
            fresh = not seq.out  # all samples of a request start from the same prompt
            groups.setdefault(id(seq.req) if fresh else id(seq), []).append(seq)
        self.sessions.expire()  # idle sessions expire on time, even when only other traffic runs
        items = [(seqs, self._reusable(seqs[0])) for seqs in groups.values()]
        self.prefills += 1
        self.prefill_tokens += sum(len(seqs[0].tokens) - n for seqs, (_, n) in items)
        suffixes = [seqs[0].tokens[n:] for seqs, (_, n) in items]
        cache, mask, logits = self._prefill_pass(suffixes, [reuse for _, reuse in items])
        order = [r for r, (seqs, _) in enumerate(items) for _ in seqs]
        if order != list(range(len(items))):
            cache, mask = _kvrows.select_rows(cache, mask, order, compact=self.rows)
            logits = logits[torch.tensor(order, device=logits.device)]
        seqs = [seq for group, _ in items for seq in group]
        for seq, (_, n) in zip(seqs, (items[r][1] for r in order), strict=True):
            seq.kv_epoch = self.kv_epoch
            seq.cached = seq.cached or n
        for req in {id(s.req): s.req for s in seqs}.values():
            lookup = req.lookup
            joined = all(s.kv_epoch >= 0 or s.finish is not None for s in req.seqs)
            if lookup is not None and lookup.branch is not None and joined:
                req.lookup = Lookup(cached=lookup.cached, stale=lookup.stale)  # every sample joined: free the KV
        return seqs, cache, mask, logits

    def _prefill_pass(
        self, suffixes: list[list[int]], reuse: list[tuple[_kvrows.KV, int]]
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward pass over each row's ``suffixes`` after the KV it reuses: the rows' cache,
        mask and next-token logits."""
        width = max(len(t) for t in suffixes)
        ids = torch.zeros((len(suffixes), width), dtype=torch.long)
        in_mask = torch.zeros((len(suffixes), width), dtype=torch.long)
        for r, tokens in enumerate(suffixes):  # right-aligned: the last column is every row's last token
            ids[r, width - len(tokens) :] = torch.tensor(tokens)
            in_mask[r, width - len(tokens) :] = 1
        ids, in_mask = ids.to(self.device), in_mask.to(self.device)
        kwargs: dict[str, Any] = {}
        mask = in_mask
        if any(n for _, n in reuse):
            past, past_mask = _kvrows.past(reuse, self.device)
            kwargs[self.cache_kw] = past
            mask = torch.cat([past_mask, in_mask], dim=1)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -width:]
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kwargs
        )
        return _out_cache(out), mask, out.logits[:, -1, :].float()

    def _reusable(self, seq: HFSeq) -> tuple[_kvrows.KV, int]:
        """The session KV ``seq`` can start from (and how many of its tokens it covers)."""
        req = seq.req
        if seq.out or req.session is None or req.alone:  # (alone: prefilled whole, as a replay is)
            return [], 0
        if req.lookup is None:  # once per turn: samples admitted later reuse what the first got
            req.lookup = self.sessions.take(req.session, seq.tokens, self.kv_epoch)
        branch = req.lookup.branch
        if branch is None or branch.epoch != self.kv_epoch:
            return [], 0
        return branch.kv, req.lookup.cached

    def _keep_for_session(self, state: KVBatch, i: int, seq: HFSeq) -> None:
        """Row ``i`` leaves the batch: keep its KV for the next turn of its session."""
        req = seq.req
        if req.session is None or seq.kv_epoch < 0 or state.mask is None:
            return
        n = int(state.mask[i].sum())
        tokens = seq.tokens[:n]
        if seq.kv_epoch != self.kv_epoch:  # computed (partly) on other weights: only say so
            self.sessions.add(req.session, Branch(tokens=(), epoch=seq.kv_epoch))
            return
        kv = _kvrows.row(state.cache, state.mask, i)
        self.sessions.add(req.session, Branch(tokens=tokens, epoch=seq.kv_epoch, kv=kv, nbytes=_kvrows.nbytes(kv)))
