"""A replica's reads of an object store through a fault proxy (``harness.link``) in front of
a real S3 API (``moto_server``): what the adversary's ``--store s3`` does to every worker.

A response cut short is never taken for the object: the catch-up fails with a typed, retryable
error, the host-local checkpoint stays at its version, and once the link is whole the same call
reaches the target byte for byte. A link that resets for a moment, or lags, costs time only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harness.link import LinkProxy
from harness.weights import expected_digest, local_digest, tensors_at, write_base_checkpoint
from rollfleet.cli import local_s3 as s3
from rollfleet.policy_store import list_versions, read_marker
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.policy_store.remote import CACHE_DIR, materialize_from
from rollfleet.schemas.errors import PolicyError
from rollfleet.schemas.index import INDEX_FILE, MAX_INDEX_BYTES

pytestmark = pytest.mark.skipif(s3.unavailable() is not None, reason=str(s3.unavailable()))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3.S3Server]:
    srv = s3.S3Server(tmp_path_factory.mktemp("s3")).start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in srv.env().items():
            mp.setenv(key, value)  # the publisher (the trainer) writes to moto directly
        yield srv
    srv.stop()


@pytest.fixture
async def proxy(server: s3.S3Server) -> AsyncIterator[LinkProxy]:
    link = await LinkProxy("127.0.0.1", server.port).start()
    yield link
    await link.close()


def publish(server: s3.S3Server, tmp_path: Path, upto: int) -> str:
    url = server.url(tmp_path.name)
    base = write_base_checkpoint(tmp_path / "base")
    pub = PolicyPublisher(url, base, keyframe_every=0, keep_last=None)
    for v in range(upto + 1):
        pub.publish(tensors_at(v))
    return url


def through(url: str, link: LinkProxy) -> Bucket:
    return Bucket(url, endpoint=f"http://127.0.0.1:{link.port}")


async def test_a_truncated_read_is_refused_retryable_and_the_next_try_after_the_heal_is_exact(
    server: s3.S3Server, proxy: LinkProxy, tmp_path: Path
) -> None:
    url = publish(server, tmp_path, 2)
    local = tmp_path / "local"  # a fresh replica: it seeds from v0's full shard (160 KB)
    cutting = asyncio.ensure_future(proxy.truncate(4096, 60.0))
    try:
        with pytest.raises(PolicyError) as failed:
            await asyncio.to_thread(materialize_from, through(url, proxy), local, 2)
        assert failed.value.retryable, failed.value
        assert proxy.truncated > 0
        assert read_marker(local) is None  # nothing applied
        cache = local / CACHE_DIR
        assert not list_versions(cache)  # no version taken for whole (a partial download is kept, to resume)
    finally:
        cutting.cancel()
        proxy.heal()
    await asyncio.to_thread(materialize_from, through(url, proxy), local, 2)  # healed: the same call
    assert read_marker(local) == 2
    assert local_digest(local) == expected_digest(2)


async def test_a_small_object_cut_short_is_finished_by_ranged_retries_byte_for_byte(
    server: s3.S3Server, proxy: LinkProxy, tmp_path: Path
) -> None:
    """A delta (5 KB) cut after 4 KB: the client asks for the rest (a ranged retry), and what it
    applies is the version's bytes exactly."""
    url = publish(server, tmp_path, 2)
    local = tmp_path / "local"
    await asyncio.to_thread(materialize_from, through(url, proxy), local, 0)
    cutting = asyncio.ensure_future(proxy.truncate(4096, 60.0))
    try:
        await asyncio.to_thread(materialize_from, through(url, proxy), local, 2)
    finally:
        cutting.cancel()
        proxy.heal()
    assert proxy.truncated > 0
    assert local_digest(local) == expected_digest(2)


async def test_a_dropped_or_lagging_link_costs_time_not_bytes(
    server: s3.S3Server, proxy: LinkProxy, tmp_path: Path
) -> None:
    url = publish(server, tmp_path, 1)
    local = tmp_path / "local"
    dropping = asyncio.ensure_future(proxy.drop(1.0))
    await asyncio.sleep(0.05)
    lagging = asyncio.ensure_future(proxy.lag(0.1, 3.0))
    await asyncio.to_thread(materialize_from, through(url, proxy), local, 1)  # retried through the drop
    assert local_digest(local) == expected_digest(1)
    await asyncio.gather(dropping, lagging)
    assert proxy.dropped > 0


async def test_a_read_whose_link_stays_down_longer_than_the_clients_retries_is_asked_again(
    server: s3.S3Server, proxy: LinkProxy, tmp_path: Path
) -> None:
    """obstore asks a request again for about 2 s of resets, then fails it; under a loaded
    `make test` a 1 s drop once outlasted that (``StoreUnavailable ... GenericError`` from
    ``objects()``). An idempotent read, a listing or a small object, is asked again, whole, for
    ``READ_PATIENCE_S``: a 4 s drop costs time only."""
    url = publish(server, tmp_path, 1)
    dropping = asyncio.ensure_future(proxy.drop(4.0))
    await asyncio.sleep(0.05)
    listed = await asyncio.to_thread(through(url, proxy).objects)
    await dropping
    assert proxy.dropped >= 2  # (reset more than once: asked again past a single failure)
    assert listed == await asyncio.to_thread(Bucket(url).objects)  # the bucket's listing, whole
    assert sorted(listed) == [0, 1]
    before = proxy.dropped
    dropping = asyncio.ensure_future(proxy.drop(4.0))
    await asyncio.sleep(0.05)
    index = await asyncio.to_thread(through(url, proxy).read, 1, INDEX_FILE, MAX_INDEX_BYTES)
    await dropping
    assert proxy.dropped >= before + 2
    direct = await asyncio.to_thread(Bucket(url).read, 1, INDEX_FILE, MAX_INDEX_BYTES)
    assert index is not None and direct is not None and index[0] == direct[0]  # the index's bytes
