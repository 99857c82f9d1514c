"""Streaming a job's tokens to the trainer as its worker checkpoints them.

``stream_tokens`` follows the job's progress subject (``schemas.progress``) with an ordered
consumer from its first record, reads it with the same ``Replay`` the resuming worker uses, and
ends with the job's answer: whatever the checkpoints had not yet carried comes from the result,
so the chunks put together are the result's tokens, in order, with no gap and no token twice,
across any number of resumes. A job that is not ``resume`` has no checkpoints: its stream is
the result, in one chunk per sample. Records without the job's MAC are not the job's and are
skipped, as the worker skips them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.types import JetStreamContext, Msg
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, RolloutResult, decode
from rollfleet.schemas.errors import BrokerError, InvalidRequest
from rollfleet.schemas.progress import ProgressRecord, Replay, TokenChunk, sealed, spans_between
from rollfleet.trainer_client.handle import RolloutHandle

log = get_logger("rollfleet.trainer_client.streaming")


async def stream_tokens(js: JetStreamContext, names: Names, handle: RolloutHandle) -> AsyncIterator[TokenChunk]:
    """The job's tokens as they are checkpointed, then the rest from its answer; raises the job's
    error if it fails."""
    job = handle.job
    params = job.payload.sampling
    replay = Replay(job.payload.n, params.max_tokens, params.logprobs)
    records: asyncio.Queue[Msg] = asyncio.Queue()
    sub: Any = None
    if job.behaviour.checkpoints:

        async def on_record(msg: Msg) -> None:
            records.put_nowait(msg)

        try:
            with typed_errors():
                sub = await js.subscribe(
                    names.progress_subject(job.client_id, job.job_id),
                    stream=names.progress_stream,
                    cb=on_record,
                    ordered_consumer=True,
                )
        except BrokerError as exc:
            # The broker did not make the consumer (a cluster electing, a node cut off): the stream
            # comes from the answer alone, whole, which the checkpoints would only have preceded.
            log.warning("progress not followed; the answer carries the tokens", job_id=job.job_id, error=repr(exc))
    answered = asyncio.ensure_future(asyncio.shield(handle.result()))
    try:
        while sub is not None and not replay.done:
            take = asyncio.ensure_future(records.get())
            await asyncio.wait({take, answered}, return_when=asyncio.FIRST_COMPLETED)
            if not take.done():
                take.cancel()
                break  # answered: the result says the rest
            for chunk in _read(replay, take.result(), job.job_id):
                yield chunk
        result = await answered
        for chunk in _rest(replay, result):
            yield chunk
    finally:
        answered.cancel()
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()


def _read(replay: Replay, msg: Msg, job_id: str) -> list[TokenChunk]:
    if not sealed(job_id, msg.data or b"", msg.headers):
        log.warning("progress record ignored: no valid MAC for this job")
        return []
    try:
        record = decode(msg.data or b"", ProgressRecord, what="progress record")
        return [c for c in replay.apply(record) if c.token_ids or c.rewound or c.finish]
    except InvalidRequest as exc:  # a worker falls back from it too (and says so in a resume record)
        log.warning("progress record skipped", error=exc.message)
        return []


def chunks_of(result: RolloutResult, logprobs: bool = True) -> list[TokenChunk]:
    """A whole answer as the chunks a stream that saw no checkpoint yields (one a sample)."""
    return _rest(Replay(len(result.outputs), max((len(o.token_ids) for o in result.outputs), default=0), logprobs),
                 result)  # fmt: skip


def _rest(replay: Replay, result: RolloutResult) -> list[TokenChunk]:
    """What the result holds past what was streamed (a rewind first, where they differ)."""
    chunks = []
    for i, (streamed, out) in enumerate(zip(replay.samples, result.outputs, strict=True)):
        have = streamed.token_ids
        same = 0
        while same < min(len(have), len(out.token_ids)) and have[same] == out.token_ids[same]:
            same += 1
        if same == len(have) == len(out.token_ids) and streamed.finish == out.finish_reason:
            continue  # all of it, finish included, came with the checkpoints
        if same < len(have):
            chunks.append(TokenChunk(index=i, start=same, token_ids=[], rewound=True))
        chunks.append(
            TokenChunk(
                index=i,
                start=same,
                token_ids=out.token_ids[same:],
                logprobs=out.logprobs[same:] if out.logprobs is not None else None,
                spans=spans_between(out.weight_versions, same, len(out.token_ids)),
                finish=out.finish_reason,
            )
        )
    return chunks
