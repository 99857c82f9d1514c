"""The hf engine's request table: which samples wait, which run, and what happens as tokens arrive.

Samples of new requests queue (``pending``) and join the running batch (``active``) between steps,
in their order (``hf_requests.admit``: a deterministic one runs alone). Each step's tokens advance
their samples (``advance``); a request whose samples all finished answers its caller with its
``Generation``. Runs on the event loop: the step thread never touches it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from rollfleet.schemas.errors import RollfleetError
from rollfleet.workers.engines import hf_requests
from rollfleet.workers.engines.base import Generation
from rollfleet.workers.engines.hf_requests import HFRequest, HFSeq


class RequestScheduler:
    def __init__(self, answer: Callable[[HFRequest], Generation]) -> None:
        """``answer``: the result of a request whose samples all finished."""
        self.answer = answer
        self.requests: dict[str, HFRequest] = {}
        self.pending: deque[HFSeq] = deque()
        self.active: list[HFSeq] = []

    def add(self, req: HFRequest) -> None:
        self.requests[req.rid] = req
        self.pending.extend(req.seqs)

    def idle(self) -> bool:
        """Whether no sample runs or waits (finished ones leave the batch)."""
        self.active = [s for s in self.active if s.finish is None]
        return not self.active and not self.pending

    def next_batch(self, max_batch: int) -> list[HFSeq]:
        """The samples the next step advances: the batch, after pending ones joined it."""
        self.active = hf_requests.admit(self.active, self.pending, max_batch)
        return self.active[:max_batch]

    def advance(self, seq: HFSeq, token: int, logprob: float, version: int, max_len: int) -> None:
        """``seq`` made ``token`` on ``version``'s weights (``max_len``: the model's context)."""
        if seq.finish is not None:  # aborted while its step ran
            return
        seq.versions.append(version)
        seq.tokens.append(token)
        seq.out.append(token)
        seq.logprobs.append(logprob)
        seq.finish = hf_requests.finish_reason(seq, token, max_len)
        req = seq.req
        if req.sink is not None:
            req.sink.token(seq.index, token, logprob, version)
            if seq.finish is not None:
                req.sink.finished(seq.index, seq.finish)
        if seq.finish is not None:
            self._complete_if_done(req)

    def finish(self, req: HFRequest, reason: str) -> None:
        """Every unfinished sample of ``req`` finishes now with ``reason`` (tokens so far kept)."""
        for seq in req.seqs:
            if seq.finish is None:
                seq.finish = reason
                if req.sink is not None:
                    req.sink.finished(seq.index, reason)
        self._complete_if_done(req)

    def fail(self, req: HFRequest, err: RollfleetError) -> None:
        for seq in req.seqs:
            seq.finish = seq.finish or "abort"
        self.requests.pop(req.rid, None)
        if not req.future.done():
            req.future.set_exception(err)

    def _complete_if_done(self, req: HFRequest) -> None:
        if any(s.finish is None for s in req.seqs) or req.future.done():
            return
        self.requests.pop(req.rid, None)
        req.future.set_result(self.answer(req))
