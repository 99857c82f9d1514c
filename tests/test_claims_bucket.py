"""The claims bucket's port (``broker.claims_bucket``), which workers and clients both go
through: every conditional write that loses is a typed ``Fenced`` carrying the revision it was
judged at, a missing claim is None, and nothing is read from an error's text. Real nats-server."""

from __future__ import annotations

import time

import nats
import pytest

from rollfleet.broker.claims_bucket import ClaimsBucket
from rollfleet.broker.topology import ensure_topology
from rollfleet.schemas import Claim, Names, claim_key
from rollfleet.schemas.errors import Fenced


async def _bucket(nc: nats.NATS, namespace: str) -> ClaimsBucket:
    js, names = nc.jetstream(), Names(namespace)
    await ensure_topology(js, names)
    return ClaimsBucket(await js.key_value(names.claims_bucket))


async def test_a_claim_is_created_once_and_written_only_over_the_revision_judged(nc: nats.NATS, namespace: str) -> None:
    bucket = await _bucket(nc, namespace)
    assert await bucket.get("job-1") is None
    first = await bucket.create("job-1", Claim("w1:1-a", time.time()).encode())
    with pytest.raises(Fenced) as taken:
        await bucket.create("job-1", Claim("w2:1-b", time.time()).encode())
    assert taken.value.subject == claim_key("job-1") and not taken.value.retryable
    refreshed = await bucket.replace("job-1", Claim("w1:1-a", time.time()).encode(), first)
    assert refreshed > first
    with pytest.raises(Fenced) as moved:  # a verdict over the revision before the refresh
        await bucket.replace("job-1", Claim("w2:1-b", time.time()).encode(), first)
    assert moved.value.expected_seq == first
    entry = await bucket.get("job-1")
    assert entry is not None and entry.revision == refreshed
    assert Claim.decode(entry.value).holder == "w1:1-a"


async def test_marking_a_claim_stopped_keeps_its_holder_and_loses_to_a_refresh(nc: nats.NATS, namespace: str) -> None:
    bucket = await _bucket(nc, namespace)
    judged = await bucket.create("job-2", Claim("w1:1-a", time.time()).encode())
    refreshed = await bucket.replace("job-2", Claim("w1:1-a", time.time()).encode(), judged)
    with pytest.raises(Fenced):  # the holder refreshed after the claim was judged: it keeps the job
        await bucket.mark_stopped("job-2", Claim("w1:1-a", 1.0), judged)
    await bucket.mark_stopped("job-2", Claim("w1:1-a", 1.0), refreshed)
    entry = await bucket.get("job-2")
    assert entry is not None
    stopped = Claim.decode(entry.value)
    assert stopped.stopped and stopped.holder == "w1:1-a"


async def test_a_release_over_a_moved_claim_is_fenced_and_removes_nothing(nc: nats.NATS, namespace: str) -> None:
    bucket = await _bucket(nc, namespace)
    old = await bucket.create("job-3", Claim("w1:1-a", time.time()).encode())
    taken = await bucket.replace("job-3", Claim("w2:1-b", time.time()).encode(), old)
    with pytest.raises(Fenced) as refused:  # the old holder's hand-back, after another took the job
        await bucket.delete("job-3", old)
    assert refused.value.expected_seq == old
    entry = await bucket.get("job-3")
    assert entry is not None and entry.revision == taken
    await bucket.delete("job-3", taken)
    assert await bucket.get("job-3") is None
    assert await bucket.write("job-3", Claim("w3:1-c", time.time()).encode(), None) > taken  # created anew
