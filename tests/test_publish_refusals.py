"""The retrying publish reads the broker's refusals by their codes, against a real nats-server:
a conditional write whose subject moved on is ``Fenced`` (with the sequence it expected), any
other refusal ``InvalidRequest``, and neither is retried."""

from __future__ import annotations

import time

import nats
import pytest

from rollfleet.broker.retry_publish import publish_retrying
from rollfleet.schemas.errors import Fenced, InvalidRequest

EXPECT = "Nats-Expected-Last-Subject-Sequence"


async def test_a_conditional_write_behind_the_subject_is_fenced(nats_url: str, namespace: str) -> None:
    nc = await nats.connect(nats_url)
    stream, subject = f"FENCE_{namespace}", f"fence.{namespace}.a"
    try:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[f"fence.{namespace}.>"])
        first = await publish_retrying(js, subject, b"1", {EXPECT: "0"}, until=time.time() + 5)
        other = await publish_retrying(js, f"fence.{namespace}.b", b"x", {}, until=time.time() + 5)
        assert other.seq == first.seq + 1  # (another subject's write does not move this one)
        second = await publish_retrying(js, subject, b"2", {EXPECT: str(first.seq)}, until=time.time() + 5)

        start = time.monotonic()
        with pytest.raises(Fenced) as caught:  # a writer that still thinks the subject ends at `first`
            await publish_retrying(js, subject, b"3", {EXPECT: str(first.seq)}, until=time.time() + 5)
        assert time.monotonic() - start < 1.0  # refused at once, not retried until the budget ends
        err = caught.value
        assert (err.subject, err.expected_seq, err.retryable, err.code) == (subject, first.seq, False, "fenced")
        assert isinstance(err, InvalidRequest)
        assert (await js.stream_info(stream)).state.last_seq == second.seq  # nothing stored

        with pytest.raises(InvalidRequest) as plain:  # another refusal: not a fence
            await publish_retrying(js, subject, b"4", {"Nats-Expected-Stream": "NOT_" + stream},
                                   until=time.time() + 5)
        assert not isinstance(plain.value, Fenced)
    finally:
        await nc.close()
