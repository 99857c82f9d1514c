"""Reading what a stream stores on one subject, in order: the look-up under every "is it stored
already?" of the job lifecycle (a job's answers, a resumable job's progress records).

A direct get of the next message on a subject: no consumer is created, and it is served by any
replica of the stream. ``None`` (nothing stored there) is only ever said when the broker said it;
a broker that did not answer raises its own error (``nats.errors.Error``), so that "not
answered" is never taken for "nothing stored".
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, RawStreamMsg

from rollfleet.broker.errors import typed_errors


async def next_stored(js: JetStreamContext, stream: str, subject: str, seq: int = 1) -> RawStreamMsg | None:
    """The first message stored on ``subject`` at or after sequence ``seq``; None if none is."""
    try:
        return await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
    except nats.js.errors.NotFoundError:
        return None


async def stored_on(
    js: JetStreamContext, stream: str, subject: str, from_seq: int = 1, *, limit: int | None = None
) -> AsyncIterator[RawStreamMsg]:
    """Every message stored on ``subject`` from ``from_seq`` on, oldest first (at most ``limit``)."""
    seq, read = from_seq, 0
    while limit is None or read < limit:
        msg = await next_stored(js, stream, subject, seq)
        if msg is None:
            return
        seq, read = int(msg.seq or seq) + 1, read + 1
        yield msg


# -- by sequence, typed ---------------------------------------------------------------------------
# What a client reads and removes where it stored a job, and how far a consumer has delivered:
# every error the broker gives typed (``broker.errors.typed``): nothing there is ``NotFound``, a
# broker that did not answer a ``BrokerError``.


async def message_at(js: JetStreamContext, stream: str, seq: int) -> RawStreamMsg:
    """The message stored at ``seq`` of ``stream``; ``NotFound`` if none is."""
    with typed_errors():
        return await js.get_msg(stream, seq)


async def remove_message(js: JetStreamContext, stream: str, seq: int) -> bool:
    """Remove the message at ``seq`` of ``stream``: whether the broker removed one; ``NotFound``
    if none lay there (taken, acknowledged and removed, just now)."""
    with typed_errors():
        return bool(await js.delete_msg(stream, seq))


async def consumer_state(js: JetStreamContext, stream: str, consumer: str) -> ConsumerInfo:
    """The consumer's state as the broker says it now (delivered, pending, waiting requests);
    ``NotFound`` if it has no such consumer."""
    with typed_errors():
        return await js.consumer_info(stream, consumer)


def delivered_through(info: ConsumerInfo) -> int:
    """The stream sequence of the last message the consumer delivered (0: none yet)."""
    return int(info.delivered.stream_seq or 0) if info.delivered is not None else 0
