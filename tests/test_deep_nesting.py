"""Documents nested deeper than any parser should recurse: a typed error at every surface, never
``RecursionError`` (which ended a worker's version follow task: the replica stayed ``preparing``)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import nats
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from harness import running_worker, wait_until
from rollfleet.broker.retry_publish import publish_retrying
from rollfleet.models import build_model_dir
from rollfleet.policy_store import materialize, read_marker
from rollfleet.policy_store.layout import read_header
from rollfleet.policy_store.store import SIDECAR, read_sidecar, read_sidecar_strict
from rollfleet.schemas import (
    RolloutJob,
    RolloutPayload,
    VersionConstraint,
    check_payload,
    decode,
    encode,
)
from rollfleet.schemas.bounded_json import MAX_DEPTH, depth_within, json_depth_within, load_json
from rollfleet.schemas.errors import CorruptArtifact, InvalidRequest, ServiceUnavailable
from rollfleet.schemas.index import INDEX_FILE, PublicationIndex, parse_weight_map
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests.helpers import built_job, payload

DEEP_JSON = b"[" * 5_000 + b"]" * 5_000  # 10 KB: far past the interpreter's recursion limit
DEEP_MSGPACK = b"\x91" * 100_000 + b"\x90"  # a one-element array in a one-element array in ...


def nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def deep_index(version: int) -> bytes:
    doc = b'{"metadata": {"version": "%06d"}, "weight_map": {}, "x": ' % version
    return doc + DEEP_JSON + b"}"


# -- the rule, in milliseconds ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[[[[", "b": "}}}"}', 1),  # brackets inside strings do not nest
        ('["\\"[[[", "\\\\", [["\\\\\\"]"]]]', 3),  # escaped quotes and backslashes
        ("[[],[[],[[],[]]]]", 4),
    ],
)
def test_json_depth_is_measured_without_recursing(text: str, depth: int) -> None:
    assert json_depth_within(text, depth) and json_depth_within(text.encode(), depth)
    assert depth_within(json.loads(text), depth)
    if depth:
        assert not json_depth_within(text, depth - 1) and not depth_within(json.loads(text), depth - 1)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(alphabet='[]{}"a', max_size=3), inner, max_size=3),
    max_leaves=12,
)


@given(_JSON, st.integers(0, 7))
def test_both_depth_checks_agree_with_a_recursive_count(value: object, max_depth: int) -> None:
    """Fast paths included (few openers in the text; a flat container): exactly depth <= bound."""
    want = _depth(value) <= max_depth
    assert json_depth_within(json.dumps(value), max_depth) == want
    assert depth_within(value, max_depth) == want


def test_load_json_refuses_deep_documents_with_the_callers_error() -> None:
    with pytest.raises(InvalidRequest, match="nests deeper than 64"):
        load_json(DEEP_JSON, what="doc", max_bytes=1 << 20)
    with pytest.raises(CorruptArtifact, match="over the limit"):
        load_json(b"[1, 2]", what="doc", max_bytes=3, error=CorruptArtifact)
    assert load_json(json.dumps(nested(MAX_DEPTH - 1)), what="doc", max_bytes=1 << 20) == nested(MAX_DEPTH - 1)


def test_deep_index_is_a_corrupt_artifact() -> None:
    for parse in (lambda: PublicationIndex.parse(deep_index(2)), lambda: parse_weight_map(deep_index(2))):
        with pytest.raises(CorruptArtifact, match="nests deeper"):
            parse()


def test_deep_safetensors_header_and_sidecar_are_corrupt_artifacts(tmp_path: Path) -> None:
    shard = tmp_path / "model.safetensors"
    header = b'{"__metadata__": {}, "x": ' + DEEP_JSON + b"}"
    shard.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptArtifact, match="nests deeper"):
        read_header(shard)
    version = tmp_path / "weight_v000001"
    version.mkdir()
    (version / SIDECAR).write_bytes(b'{"record": ' + DEEP_JSON + b"}")
    with pytest.raises(CorruptArtifact, match="nests deeper"):
        read_sidecar_strict(version)
    assert read_sidecar(version) == {}  # (the lenient reader: a foreign version has none)


def test_deep_messages_are_invalid_requests() -> None:
    job = RolloutJob(
        job_id="j",
        idempotency_key="k",
        client_id="c",
        constraint=VersionConstraint("min", 0),
        payload=RolloutPayload(prompt_token_ids=[1], extra={"a": "MARK"}),
        deadline=4e9,
        submitted_at=1.0,
    )
    data = encode(job).replace(b"\xa4MARK", DEEP_MSGPACK)
    with pytest.raises(InvalidRequest, match="nests deeper"):
        decode(data, RolloutJob, what="rollout job")


def test_extra_nested_past_the_limit_is_refused_on_both_sides() -> None:
    ok = RolloutPayload(prompt_token_ids=[1], extra={"a": nested(MAX_DEPTH - 1)})
    check_payload(ok)
    too_deep = RolloutPayload(prompt_token_ids=[1], extra={"a": nested(MAX_DEPTH)})
    with pytest.raises(InvalidRequest, match="extra nests deeper"):
        check_payload(too_deep)  # (the worker's check_job runs this too)
    for levels in (MAX_DEPTH, 5_000):  # one the encoder handles, one past its recursion
        deep = RolloutPayload(prompt_token_ids=[1], extra={"a": nested(levels)})
        with pytest.raises(InvalidRequest, match="nests deeper"):
            built_job(deep, VersionConstraint("min", 0), "min:0")


# -- the surfaces, with real parts ---------------------------------------------------------------


async def test_a_garbled_acknowledgement_is_retried_then_unavailable(nats_url: str) -> None:
    """A publish answered with something that is not an acknowledgement (here a responder on a
    plain subject sends a deeply nested error) is retried until its deadline, then a typed
    ServiceUnavailable; never a decoder's own exception."""
    nc = await nats.connect(nats_url)
    try:
        answers = iter([b'{"error": {"code": 503, "x": ' + DEEP_JSON + b"}}", b"[1, 2]"] * 50)

        async def garble(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(next(answers))

        await nc.subscribe("garbled.acks", cb=garble)
        start = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="acknowledgement"):
            await publish_retrying(nc.jetstream(), "garbled.acks", b"x", {}, until=time.time() + 0.5)
        assert time.monotonic() - start < 5
    finally:
        await nc.close()


def test_materialize_fails_closed_on_a_deep_index(tmp_path: Path) -> None:
    base = build_model_dir(tmp_path / "base", preset="tiny")
    store, local = tmp_path / "store", tmp_path / "local"
    publisher = PolicyPublisher(store, base, keyframe_every=0)
    tensors = load_file(str(base / "model.safetensors"))
    publisher.publish(tensors)
    materialize(local, store, 0)
    for t in tensors.values():
        t.view(-1)[:3] += torch.tensor(0.5, dtype=t.dtype)
    record = publisher.publish(tensors)
    (store / record.path / INDEX_FILE).write_bytes(deep_index(1))
    with pytest.raises(CorruptArtifact, match="nests deeper"):
        materialize(local, store, 1)
    assert read_marker(local) == 0


async def test_worker_keeps_serving_and_degrades_on_a_deep_index(nats_url: str, namespace: str, tmp_path: Path) -> None:
    base = build_model_dir(tmp_path / "base", preset="tiny")
    store = tmp_path / "store"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        publisher = PolicyPublisher(store, base, keyframe_every=0)
        tensors = load_file(str(base / "model.safetensors"))
        await client.publish_policy(publisher, tensors)
        async with running_worker(nats_url, namespace, store_dir=store, local_dir=tmp_path / "l") as worker:
            for t in tensors.values():
                t.view(-1)[:3] += torch.tensor(0.5, dtype=t.dtype)
            record = publisher.publish(tensors)
            (store / record.path / INDEX_FILE).write_bytes(deep_index(record.version))
            await client.commit_version(record)

            def degraded() -> bool:
                return any(r.state == "degraded" for r in client.fleet.replicas())

            await wait_until(degraded, timeout=20, what="the replica degraded")
            [entry] = client.fleet.replicas()
            assert entry.active_version == 0 and "nests deeper" in (entry.degraded_reason or "")
            assert (await (await client.submit(payload(), exact_version=0)).result(10)).version_start == 0
            assert worker.version == 0


def test_a_deep_local_marker_reads_as_no_version_held(tmp_path: Path) -> None:
    from rollfleet.policy_store.materialize import MARKER

    (tmp_path / MARKER).write_bytes(DEEP_JSON)
    assert read_marker(tmp_path) is None  # not RecursionError: the replica re-materializes
