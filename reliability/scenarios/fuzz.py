"""Scenario 8: property-based fuzzing of every decoder and parser; only typed errors may escape.

Each property takes hostile input (random bytes, random structures, and mutations of valid
messages and files) and calls the real decoder. Returning, or raising a
``RollfleetError`` subclass, is fine; anything else (a ``KeyError``, ``TypeError``, a crash)
is a bug, and hypothesis shrinks it to a minimal reproduction.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliability.scenarios.common import Figures, job_payload
from rollfleet.schemas import (
    ReplicaStatus,
    RolloutJob,
    VersionConstraint,
    VersionRecord,
    check_job,
    decode,
    decode_event,
    decode_outcome,
    encode,
)
from rollfleet.schemas.errors import RollfleetError
from rollfleet.schemas.index import PublicationIndex, parse_weight_map

# -- strategies --------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
structures = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers(-(2**63), 2**63)), inner, max_size=5),
    ),
    max_leaves=20,
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)),
    max_leaves=20,
)


def _valid_job() -> dict[str, Any]:
    job = RolloutJob(
        job_id="j",
        idempotency_key="k",
        client_id="c",
        constraint=VersionConstraint("min", 0),
        payload=job_payload(1),
        deadline=4e9,
        submitted_at=1.0,
    )
    return msgspec.to_builtins(job)  # type: ignore[no-any-return]


VALID = {
    "job": _valid_job(),
    "result": {
        "type": "result", "job_id": "j", "idempotency_key": "k", "client_id": "c",
        "outputs": [{"token_ids": [1], "finish_reason": "stop", "logprobs": [0.0]}],
        "version_start": 0, "version_end": 0, "worker_id": "w", "engine": "echo", "queue_wait_s": 0.0,
        "generation_s": 0.0, "delivery_attempt": 1, "finished_at": 1.0,
    },
    "failure": {"type": "failure", "idempotency_key": "k", "client_id": "c", "code": "expired", "message": "m",
                "retryable": True},
    "activated": {"type": "activated", "worker_id": "w", "version": 1, "previous_version": 0, "prepare_s": 0.1,
                  "pause_s": 0.1, "wire_bytes": 1, "density": 0.1, "activated_at": 1.0},
    "replica": {"worker_id": "w", "state": "ready", "active_version": 0, "engine": "echo", "capacity": 1,
                "in_flight": 0, "heartbeat_at": 1.0, "heartbeat_interval_s": 1.0, "started_at": 1.0},
    "record": {"version": 1, "kind": "delta", "base_version": 0, "encoding": "xor", "path": "weight_v000001"},
}  # fmt: skip


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc = copy.deepcopy(doc)
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return doc


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any], values: st.SearchStrategy[Any] = structures) -> Any:
    """A valid document with one to three fields replaced by arbitrary values (or dropped)."""
    doc = valid
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        if path and isinstance(path[-1], str) and draw(st.booleans()) and draw(st.booleans()):
            doc = copy.deepcopy(doc)
            cur = doc
            for p in path[:-1]:
                cur = cur[p]
            cur.pop(path[-1], None)
        else:
            doc = _replace(doc, path, draw(values))
    return doc


def msgpack_inputs(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        structures.map(msgspec.msgpack.encode),
        mutated(valid).map(msgspec.msgpack.encode),
        st.tuples(st.just(msgspec.msgpack.encode(valid)), st.integers(0, 400), st.integers(0, 255)).map(
            lambda t: t[0][: t[1]] + bytes([t[2]]) + t[0][t[1] + 1 :]
        ),
    )


# -- the property: typed errors only -----------------------------------------------------------


class UntypedError(AssertionError):
    pass


def typed_only(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except RollfleetError:
        return None
    except Exception as exc:
        raise UntypedError(f"{fn.__qualname__} raised {type(exc).__name__}: {exc!r}") from exc


def run_property(strategy: st.SearchStrategy[Any], prop: Callable[[Any], None], max_examples: int) -> int:
    """Run one property under hypothesis; return the number of examples tried (raises on a bug)."""
    count = 0

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(strategy)
    def check(value: Any) -> None:
        nonlocal count
        count += 1
        prop(value)

    check()
    return count


# -- message decoders --------------------------------------------------------------------------


def prop_job(data: bytes) -> None:
    job = typed_only(decode, data, RolloutJob)
    if job is not None:
        typed_only(check_job, job)  # what a worker runs next on a decoded job
        encode(job)


def prop_outcome(data: bytes) -> None:
    typed_only(decode_outcome, data)


def prop_event(data: bytes) -> None:
    typed_only(decode_event, data)


def prop_replica(data: bytes) -> None:
    status = typed_only(decode, data, ReplicaStatus)
    if status is not None:  # the fleet view calls these on every entry it decodes
        typed_only(status.is_live)
        typed_only(status.can_serve, VersionConstraint("min", 0))


def prop_record(data: bytes) -> None:
    typed_only(decode, data, VersionRecord)


DECODERS: dict[str, tuple[st.SearchStrategy[bytes], Callable[[bytes], None]]] = {
    "RolloutJob": (msgpack_inputs(VALID["job"]), prop_job),
    "Outcome (result)": (msgpack_inputs(VALID["result"]), prop_outcome),
    "Outcome (failure)": (msgpack_inputs(VALID["failure"]), prop_outcome),
    "VersionEvent": (msgpack_inputs(VALID["activated"]), prop_event),
    "ReplicaStatus": (msgpack_inputs(VALID["replica"]), prop_replica),
    "VersionRecord": (msgpack_inputs(VALID["record"]), prop_record),
}

# -- the index parser --------------------------------------------------------------------------

VALID_INDEX = {
    "metadata": {
        "version": "000002",
        "base_version": "000001",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "xxh3-128",
    },
    "weight_map": {"model.embed_tokens.weight": "model-00000-of-00001.safetensors"},
}
index_inputs = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    mutated(VALID_INDEX, json_values).map(lambda v: json.dumps(v).encode()),
    mutated(VALID_INDEX, st.text(max_size=30)).map(lambda v: json.dumps(v).encode()),
)


def prop_index(raw: bytes) -> None:
    index = typed_only(PublicationIndex.parse, raw)
    if index is not None:
        index.to_bytes()
        _ = index.shards
    typed_only(parse_weight_map, raw)


# -- the shard and version opener --------------------------------------------------------------


class VersionFixture:
    """A real store with a base and one delta; each example damages a copy of the delta."""

    def __init__(self) -> None:
        from harness.weights import tensors_at, write_base_checkpoint
        from rollfleet.policy_store import CheckpointLayout
        from rollfleet.trainer_client import PolicyPublisher

        self.root = Path(tempfile.mkdtemp(prefix="rf-fuzz-"))
        base = write_base_checkpoint(self.root / "base")
        store = self.root / "store"
        pub = PolicyPublisher(store, base, keyframe_every=0, keep_last=None)
        pub.publish(tensors_at(0))
        pub.publish(tensors_at(1))
        self.delta = store / "weight_v000001"
        self.full = store / "weight_v000000"
        self.specs = CheckpointLayout.read(base).specs
        self.work = self.root / "work"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


VALID_HEADER = {
    "__metadata__": {"model.embed_tokens.weight": "0" * 32},
    "model.embed_tokens.weight": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
}
KINDS = ["flip", "truncate", "header", "header-entry", "index", "sidecar", "full-flip", "full-header"]


@st.composite
def damage(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    doc = {"header-entry": mutated(VALID_HEADER, json_values)}.get(kind, mutated(VALID_INDEX, json_values))
    return {
        "kind": kind,
        "positions": draw(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4)),
        "xor": draw(st.integers(1, 255)),
        "cut": draw(st.integers(0, 1 << 20)),
        "json": draw(st.one_of(json_values, doc)),
        "bytes": draw(st.binary(max_size=64)),
    }


def _apply_damage(fx: VersionFixture, d: dict[str, Any]) -> Path:
    src = fx.full if d["kind"].startswith("full") else fx.delta
    shutil.rmtree(fx.work, ignore_errors=True)
    shutil.copytree(src, fx.work)
    shard = next(p for p in sorted(fx.work.glob("*.safetensors")))
    data = bytearray(shard.read_bytes())
    kind = d["kind"]
    if kind in ("flip", "full-flip"):
        for pos in d["positions"]:
            data[pos % len(data)] ^= d["xor"]
    elif kind == "truncate":
        data = data[: d["cut"] % len(data)]
    elif kind == "header-entry":  # a plausible header, one entry damaged, 16 data bytes
        head = json.dumps(d["json"]).encode()
        data = bytearray(len(head).to_bytes(8, "little") + head + bytes(16))
    elif kind in ("header", "full-header"):
        head = json.dumps(d["json"]).encode() + d["bytes"]
        data = bytearray(len(head).to_bytes(8, "little") + head + data[8 + int.from_bytes(data[:8], "little") :])
    elif kind == "index":
        (fx.work / "model.safetensors.index.json").write_bytes(json.dumps(d["json"]).encode())
    elif kind == "sidecar":
        (fx.work / "rollfleet.json").write_bytes(json.dumps(d["json"]).encode() + d["bytes"])
    shard.write_bytes(bytes(data))
    return fx.work


def version_property(fx: VersionFixture) -> Callable[[dict[str, Any]], None]:
    from rollfleet.policy_store.layout import CheckpointLayout, read_header
    from rollfleet.policy_store.verify import check_delta_against, open_version, verify_version_dir

    def prop(d: dict[str, Any]) -> None:
        path = _apply_damage(fx, d)
        for shard in path.glob("*.safetensors"):
            typed_only(read_header, shard)
        typed_only(CheckpointLayout.read, path)
        ov = typed_only(open_version, path)
        if ov is not None and ov.is_delta:
            typed_only(check_delta_against, ov, fx.specs)
        typed_only(verify_version_dir, path)
        typed_only(verify_version_dir, path, fx.specs)

    return prop


def header_property(fx: VersionFixture) -> Callable[[Any], None]:
    """The safetensors header parser alone, on plausible headers with damaged entries."""
    from rollfleet.policy_store.layout import read_header

    def prop(doc: Any) -> None:
        head = json.dumps(doc).encode()
        path = fx.root / "header.safetensors"
        path.write_bytes(len(head).to_bytes(8, "little") + head + bytes(16))
        typed_only(read_header, path)

    return prop


# -- the whole scenario ------------------------------------------------------------------------


def fuzz_all(max_examples: int = 200) -> Figures:
    """Run every property; a property that finds an untyped error is recorded as a problem."""
    fig = Figures("8", "Property-based fuzzing of decoders and parsers", {"max_examples": max_examples})
    t0 = time.monotonic()
    counts: dict[str, int] = {}
    targets: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], None]]] = dict(DECODERS)
    targets["index parser"] = (index_inputs, prop_index)
    fx = VersionFixture()
    targets["shard header parser"] = (st.one_of(json_values, mutated(VALID_HEADER, json_values)), header_property(fx))
    targets["shard/version opener"] = (damage(), version_property(fx))
    try:
        for name, (strategy, prop) in targets.items():
            try:
                counts[name] = run_property(strategy, prop, max_examples)
            except Exception as exc:
                fig.problems.append(f"{name}: {str(exc).splitlines()[0][:300]}")
                counts[name] = -1
    finally:
        fx.close()
    fig.notes["examples"] = counts
    fig.submitted = sum(c for c in counts.values() if c > 0)
    fig.faults = fig.submitted
    fig.seconds = time.monotonic() - t0
    return fig
