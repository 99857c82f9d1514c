"""miles hands its policy versions and its rollouts to rollfleet, with miles' documented flags only.

What a miles user adds to a disk-delta run (Megatron backend, not colocated)::

    --update-weight-transfer-mode disk-delta
    --update-weight-disk-dir /shared/miles-deltas        # miles' own directory; miles clears it at start-up
    --update-weight-local-checkpoint-dir /local/ckpt     # required by miles' disk-delta mode
    --custom-update-weight-post-write-path rollfleet.integrations.miles.post_write_hook
    --custom-generate-function-path rollfleet.integrations.miles.generate
    --custom-config-path rollfleet.yaml

``rollfleet.yaml`` (miles sets each key on its ``args``; environment variables are the fallback)::

    rollfleet_nats: nats://broker:4222        # ROLLFLEET_NATS, default nats://127.0.0.1:4222
    rollfleet_namespace: run1                 # ROLLFLEET_NAMESPACE, default "default"
    rollfleet_store: /shared/policy           # ROLLFLEET_STORE, required: the store the workers follow
    rollfleet_max_staleness: 1                # ROLLFLEET_MAX_STALENESS, default --max-weight-staleness or 1
    rollfleet_timeout: 600                    # ROLLFLEET_TIMEOUT, seconds per rollout
    rollfleet_client_id: trainer-0            # ROLLFLEET_CLIENT_ID, default miles-<host>-<pid>

Versions (``post_write_hook``, miles' signature ``hook(args, version_dir, rollout_engines)``):

- miles calls it on every trainer rank; only global rank 0 acts, the others return at once.
- Its first call names miles' directory itself (right after miles cleared it): a *run* starts.
  The run's ``--hf-checkpoint`` is recorded as a full version ``B`` of the rollfleet store (hard
  links and checksums; ``B`` = 0 on an empty namespace, else one past everything written or
  committed) and committed: miles' version 0, which it never writes, is rollfleet's ``B``.
- Each later call hands over miles' ``weight_v{k}`` (a delta on ``k-1``): it is verified
  (structure, names against the base layout, every frame decoded within bounds), its shards are
  hard-linked into the store as ``weight_v{B+k}`` with the index renumbered (base ``B+k-1``),
  and committed. The bytes are miles' own; only the numbers change.
- miles numbers from 1 on every run and deletes its directory at start-up, so a second run, or
  a run restarted after a crash, is a new run: a new ``B`` past everything before it, and the
  fleet moves to the new run's base (the weights miles' own engines would serve) and follows it.
  A version whose files were written but not committed when a run died is passed over, never
  applied. Calling the hook again for a version already handed over finishes its commit if it
  was interrupted, and changes nothing otherwise.
- The store must not be miles' directory or lie inside it (miles' start-up deletes that
  directory): the hook refuses such a layout with ``InvalidRequest`` before writing anything.

Rollouts (``generate``, miles' ``--custom-generate-function-path`` signature ``generate(input)``):
each call submits one rollfleet job (``max_staleness`` against the latest committed version,
retried while the error is retryable, within ``rollfleet_timeout``) and fills the ``Sample`` as
miles' SGLang path does: ``tokens``, ``response_length``, ``response``, ``rollout_log_probs``,
``status``, and ``weight_versions`` (the version of each span of the new tokens, as strings,
oldest first: two entries when an activation landed mid-generation; miles' staleness reads the
oldest). The per-token detail is in ``sample.metadata["rollfleet"]``: ``weight_versions`` as
``[version, start, end]`` over the whole response (absent for engines that cannot tell), and per
call the versions at start and end, the worker, the idempotency key and the sample's replay
coordinate (``replay``: ``schemas.replay.coordinate_wire``, what it takes to generate the call's
tokens again; None from a replica that stamps none).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rollfleet.broker.connection import connect
from rollfleet.broker.kv import read_latest
from rollfleet.broker.topology import DEFAULT_TOPOLOGY, ensure_topology
from rollfleet.broker.types import NATS, JetStreamContext
from rollfleet.policy_store.formats import DEFAULT_CHECKSUM
from rollfleet.policy_store.layout import CheckpointLayout, TensorSpec
from rollfleet.policy_store.publisher import publish_checkpoint
from rollfleet.policy_store.store import (
    dir_version,
    list_versions,
    read_index,
    read_record,
    read_sidecar,
    version_dir_name,
)
from rollfleet.policy_store.verify import verify_version_dir
from rollfleet.policy_store.writer import link_full
from rollfleet.runtime.backoff import Backoff
from rollfleet.schemas import Names, RolloutPayload, RolloutResult, SamplingParams, VersionRecord, coordinate_wire
from rollfleet.schemas.errors import (
    CorruptArtifact,
    HostileName,
    InvalidRequest,
    LineageMismatch,
    RollfleetError,
    VersionConflict,
)
from rollfleet.schemas.index import IndexMetadata
from rollfleet.trainer_client.client import RolloutClient
from rollfleet.trainer_client.versions import commit_or_finish

T = TypeVar("T")
_COMMIT_TIMEOUT_S = 120.0
# A rollout asked again (no compatible replica yet, an engine that failed): soon at first, then every
# 5 s, since a replica that is loading the version asked for takes seconds, not milliseconds.
SUBMIT_RETRY = Backoff(first_s=0.2, max_s=5.0)


@dataclass(frozen=True)
class MilesConfig:
    """rollfleet's settings inside a miles run: ``rollfleet_*`` attributes of miles' ``args``
    (from ``--custom-config-path``), else ``ROLLFLEET_*`` environment variables."""

    nats_url: str
    namespace: str
    store: Path | None
    client_id: str | None
    max_staleness: int
    timeout_s: float

    @classmethod
    def from_args(cls, args: Any) -> MilesConfig:
        def get(key: str, default: Any = None) -> Any:
            value = getattr(args, f"rollfleet_{key}", None)
            if value is None or value == "":
                value = os.environ.get(f"ROLLFLEET_{key.upper()}", default)
            return value

        staleness = get("max_staleness")
        if staleness is None:
            staleness = getattr(args, "max_weight_staleness", None)
        store = get("store")
        return cls(
            nats_url=str(get("nats", "nats://127.0.0.1:4222")),
            namespace=str(get("namespace", "default")),
            store=Path(store) if store else None,
            client_id=get("client_id"),
            max_staleness=int(1 if staleness is None else staleness),
            timeout_s=float(get("timeout", 600.0)),
        )

    def require_store(self) -> Path:
        if self.store is None:
            raise InvalidRequest("rollfleet_store is not set (in --custom-config-path's YAML, or ROLLFLEET_STORE)")
        return self.store


# -- versions --------------------------------------------------------------------------------------


def global_rank() -> int:
    """This process's trainer rank: torch.distributed's when it is set up, else $RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


class _LoopThread:
    """An event loop on a daemon thread, so a synchronous hook can talk to the broker."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rf-miles-loop", daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = _COMMIT_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@dataclass
class _Run:
    base: int  # the rollfleet version of miles' version 0 (its --hf-checkpoint)
    disk_dir: Path
    specs: dict[str, TensorSpec]


class VersionBridge:
    """Hands one miles trainer's versions to one rollfleet namespace and store (rank 0 only)."""

    def __init__(self, config: MilesConfig) -> None:
        self.config = config
        self.store = config.require_store().resolve()
        self.names = Names(config.namespace)
        self.publisher = f"miles:{socket.gethostname()}:{os.getpid()}"
        self.run: _Run | None = None
        self._lock = threading.Lock()
        self._loop: _LoopThread | None = None
        self._js: JetStreamContext | None = None
        self._nc: NATS | None = None

    # -- the broker, from a synchronous caller ------------------------------------------------
    def _call(self, make: Any) -> Any:
        if self._loop is None:
            self._loop = _LoopThread()

        async def with_js() -> Any:
            if self._js is None:
                self._nc = await connect(self.config.nats_url, name=f"rollfleet-miles-{os.getpid()}")
                self._js = self._nc.jetstream()
                await ensure_topology(self._js, self.names, DEFAULT_TOPOLOGY)
            return await make(self._js)

        return self._loop.run(with_js())

    def _commit(self, record: VersionRecord) -> None:
        self._call(lambda js: commit_or_finish(js, self.names, record))

    def _latest(self) -> int | None:
        async def latest(js: JetStreamContext) -> int | None:
            return await read_latest(await js.key_value(self.names.policy_bucket))

        return self._call(latest)  # type: ignore[no-any-return]

    # -- a run starts: miles' version 0 is its --hf-checkpoint ----------------------------------
    def start_run(self, disk_dir: Path, hf_checkpoint: Path, checksum: str = DEFAULT_CHECKSUM) -> VersionRecord:
        disk_dir = Path(disk_dir).resolve()
        if _inside(self.store, disk_dir):
            raise InvalidRequest(
                f"the rollfleet store {self.store} is --update-weight-disk-dir or inside it, which miles deletes at "
                "start-up; give miles a directory of its own"
            )
        with self._lock:
            for _ in range(8):  # another publisher may take a number between our look and our write
                written = list_versions(self.store)
                latest = self._latest()
                base = max([-1, *(written[-1:]), *([latest] if latest is not None else [])]) + 1
                origin = {"miles": {"run_base": base, "version": 0, "disk_dir": str(disk_dir)}}
                try:
                    record = publish_checkpoint(
                        self.store, base, hf_checkpoint, checksum=checksum, publisher=self.publisher, provenance=origin
                    )
                except VersionConflict:
                    continue
                self._commit(record)
                specs = CheckpointLayout.read(self.store / version_dir_name(base)).specs
                self.run = _Run(base, disk_dir, specs)
                return record
        raise VersionConflict(f"could not find a free version number in {self.store}")

    # -- each published version: renumbered, linked, committed -------------------------------
    def hand_over(self, version_dir: Path) -> VersionRecord:
        version_dir = Path(version_dir)
        k = dir_version(version_dir.name)
        if k is None:
            raise HostileName(f"{version_dir.name} is not a miles version directory (weight_vNNNNNN)")
        with self._lock:
            run = self.run or self._recover(version_dir.resolve().parent)
            if version_dir.resolve().parent != run.disk_dir:
                raise HostileName(f"{version_dir} is not inside this run's --update-weight-disk-dir {run.disk_dir}")
            target = run.base + k
            done = self._handed_over(run, k, target)
            if done is not None:
                self._commit(done)  # finishes a commit a crash interrupted; otherwise changes nothing
                return done
            meta = read_index(version_dir).metadata
            if meta.version != k:
                raise CorruptArtifact(f"{version_dir.name}: index says version {meta.version}")
            if meta.is_delta and meta.base_version != k - 1:
                raise LineageMismatch(f"miles version {k} is based on {meta.base_version}, not {k - 1}")
            if target - 1 not in list_versions(self.store):
                raise LineageMismatch(f"miles version {k - 1} (rollfleet {target - 1}) was never handed over")
            verify_version_dir(version_dir, run.specs)
            record = self._link(run, version_dir, k, target, meta)
            self._commit(record)
            return record

    def _link(self, run: _Run, source: Path, k: int, target: int, meta: IndexMetadata) -> VersionRecord:
        t0 = time.perf_counter()
        provenance = {"miles": {"run_base": run.base, "version": k, "disk_dir": str(run.disk_dir)}}
        if not meta.is_delta:  # miles writes deltas; a full version is an ordinary checkpoint
            fmt = meta.checksum_format or DEFAULT_CHECKSUM
            return publish_checkpoint(
                self.store, target, source, checksum=fmt, publisher=self.publisher, provenance=provenance
            )
        renumbered = IndexMetadata(
            version=target,
            base_version=target - 1,
            delta_encoding=meta.delta_encoding,
            compression_format=meta.compression_format,
            checksum_format=meta.checksum_format,
            extra=meta.extra,
        )
        total = sum(spec.nbytes for spec in run.specs.values())

        def record(wire: int) -> VersionRecord:
            return VersionRecord(
                version=target,
                kind="delta",
                base_version=target - 1,
                encoding=meta.delta_encoding,
                checksum_format=meta.checksum_format,
                path=version_dir_name(target),
                total_bytes=total,
                wire_bytes=wire,
                seconds=time.perf_counter() - t0,
                created_at=time.time(),
                publisher=self.publisher,
            )

        weight_map = read_index(source).weight_map
        return link_full(self.store, renumbered, source, weight_map, {}, record, provenance)[1]

    def _handed_over(self, run: _Run, k: int, target: int) -> VersionRecord | None:
        """The record of miles version ``k`` if this run already handed it over; VersionConflict if
        ``target`` holds something else."""
        if target not in list_versions(self.store):
            return None
        origin = _origin(self.store, target)
        if origin != (run.base, k, str(run.disk_dir)):
            raise VersionConflict(f"rollfleet version {target} is already taken (by {origin or 'another publisher'})")
        return read_record(self.store, target)

    def _recover(self, disk_dir: Path) -> _Run:
        """This process did not see the run start (e.g. the hook module was reloaded): find the
        newest run of ``disk_dir`` in the store."""
        for v in reversed(list_versions(self.store)):
            origin = _origin(self.store, v)
            if origin is not None and origin[2] == str(disk_dir):
                base = origin[0]
                self.run = _Run(base, disk_dir, CheckpointLayout.read(self.store / version_dir_name(base)).specs)
                return self.run
        raise LineageMismatch(
            f"no miles run of {disk_dir} started in {self.store}: the hook's first call (with "
            "--update-weight-disk-dir itself) was not seen"
        )

    def close(self) -> None:
        if self._loop is None:
            return
        if self._nc is not None:
            self._loop.run(self._nc.close(), timeout=10)
        self._loop.loop.call_soon_threadsafe(self._loop.loop.stop)
        self._loop = self._js = self._nc = None


def _origin(store: Path, version: int) -> tuple[int, int, str] | None:
    """(run base, miles version, miles dir) of a version this integration wrote, else None."""
    miles = (read_sidecar(store / version_dir_name(version)).get("provenance") or {}).get("miles")
    if not isinstance(miles, dict):
        return None
    try:
        return int(miles["run_base"]), int(miles["version"]), str(miles["disk_dir"])
    except (KeyError, TypeError, ValueError):
        return None


_BRIDGES: dict[tuple[str, str, Path], VersionBridge] = {}
_BRIDGES_LOCK = threading.Lock()


def bridge(config: MilesConfig) -> VersionBridge:
    """One bridge per (broker, namespace, store) in this process."""
    key = (config.nats_url, config.namespace, config.require_store().resolve())
    with _BRIDGES_LOCK:
        if key not in _BRIDGES:
            _BRIDGES[key] = VersionBridge(config)
        return _BRIDGES[key]


def shutdown() -> None:
    """Close the hook's broker connections in this process (a later call reconnects)."""
    with _BRIDGES_LOCK:
        for b in _BRIDGES.values():
            b.close()
        _BRIDGES.clear()


def post_write_hook(args: Any, version_dir: str | os.PathLike[str], rollout_engines: Any = None) -> None:
    """``--custom-update-weight-post-write-path rollfleet.integrations.miles.post_write_hook``.

    miles calls it on every rank; rank 0 starts a run (``version_dir`` is the disk dir itself)
    or hands a version over. miles' own ``rollout_engines`` are left to miles.
    """
    if global_rank() != 0:
        return
    b = bridge(MilesConfig.from_args(args))
    path = Path(version_dir)
    disk_dir = getattr(args, "update_weight_disk_dir", None)
    if disk_dir is not None and path.resolve() == Path(disk_dir).resolve():
        hf = getattr(args, "hf_checkpoint", None)
        if not hf:
            raise InvalidRequest("miles' --hf-checkpoint is needed: it is version 0 of every miles run")
        b.start_run(path, Path(hf), getattr(args, "update_weight_delta_checksum", None) or DEFAULT_CHECKSUM)
        return
    b.hand_over(path)


# -- rollouts --------------------------------------------------------------------------------------


@dataclass
class GenerateOutput:
    """What miles reads from a generate function: ``output.samples``."""

    samples: Any


_CLIENTS: dict[int, tuple[asyncio.AbstractEventLoop, RolloutClient]] = {}
_CLIENTS_LOCK: dict[int, asyncio.Lock] = {}


async def rollout_client(config: MilesConfig) -> RolloutClient:
    """One RolloutClient per event loop (miles runs rollouts on its own loop)."""
    loop = asyncio.get_running_loop()
    key = id(loop)
    lock = _CLIENTS_LOCK.setdefault(key, asyncio.Lock())
    async with lock:
        held = _CLIENTS.get(key)
        if held is None or held[0] is not loop:
            client_id = config.client_id or f"miles-{socket.gethostname().split('.')[0][:40]}-{os.getpid()}"
            client = await RolloutClient.connect(
                config.nats_url, namespace=config.namespace, client_id=client_id.replace(".", "-")
            )
            _CLIENTS[key] = held = (loop, client)
        return held[1]


async def close_rollout_client() -> None:
    """Close this event loop's rollout client, if ``generate`` opened one."""
    held = _CLIENTS.pop(id(asyncio.get_running_loop()), None)
    if held is not None:
        await held[1].close()


def _prompt_ids(state: Any, sample: Any) -> list[int]:
    """As miles' SGLang path computes them: the chat template for messages, no special tokens."""
    prompt = sample.prompt
    if getattr(sample, "multimodal_inputs", None) and any(v is not None for v in sample.multimodal_inputs.values()):
        raise InvalidRequest("multimodal samples are not supported by rollfleet's miles generate")
    if not isinstance(prompt, str):
        prompt = state.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return list(state.tokenizer.encode(prompt, add_special_tokens=False))


def payload_for(args: Any, input_ids: list[int], sampling_params: dict[str, Any]) -> RolloutPayload | None:
    """miles' SGLang sampling parameters as a rollfleet payload; None when no token may be generated."""
    params = dict(sampling_params)
    max_new = int(params.pop("max_new_tokens", getattr(args, "rollout_max_response_len", 0) or 0))
    if context := getattr(args, "rollout_max_context_len", None):
        max_new = min(max_new, int(context) - len(input_ids))
    if max_new <= 0:
        return None
    top_k = int(params.pop("top_k", -1) or -1)
    sampling = SamplingParams(
        max_tokens=max_new,
        temperature=float(params.pop("temperature", 1.0)),
        top_p=float(params.pop("top_p", 1.0)),
        top_k=top_k if top_k > 0 else 0,
        stop_token_ids=[int(t) for t in params.pop("stop_token_ids", None) or []],
        seed=params.pop("sampling_seed", None),
        logprobs=True,
    )
    extra = {"sampling_params": params} if params else {}  # stop strings etc.: passed to SGLang as they are
    return RolloutPayload(prompt_token_ids=list(input_ids), sampling=sampling, extra=extra)


async def submit_until_served(client: RolloutClient, payload: RolloutPayload, config: MilesConfig) -> RolloutResult:
    """Submit; retry retryable errors (no compatible replica yet, expiry, engine failure) until the timeout."""
    deadline = time.monotonic() + config.timeout_s
    key = f"miles-{uuid.uuid4().hex}"
    for attempt in range(10_000):
        delay = SUBMIT_RETRY.delay_s(attempt)
        left = deadline - time.monotonic()
        try:
            handle = await client.submit(
                payload, max_staleness=config.max_staleness, idempotency_key=f"{key}/{attempt}", timeout=max(left, 1.0)
            )
            return await handle
        except RollfleetError as exc:
            if not exc.retryable or time.monotonic() + delay >= deadline:
                raise
        await asyncio.sleep(delay)
    raise AssertionError("unreachable")


def fill_sample(sample: Any, input_ids: list[int], result: RolloutResult, tokenizer: Any = None) -> Any:
    """Write one rollfleet result into a miles ``Sample``, as miles' SGLang path does."""
    out = result.outputs[0]
    if not sample.response and not sample.tokens:
        sample.tokens = list(input_ids)
    offset = sample.response_length
    sample.tokens = list(sample.tokens) + list(out.token_ids)
    sample.response_length += len(out.token_ids)
    text = out.text
    if text is None and tokenizer is not None:
        text = tokenizer.decode(out.token_ids)
    sample.response += text or ""
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = []
    logprobs = out.logprobs if out.logprobs is not None else [float("nan")] * len(out.token_ids)
    sample.rollout_log_probs += list(logprobs)
    spans = [(s.version, offset + s.start, offset + s.end) for s in out.weight_versions]
    if spans:
        versions = [v for v, _, _ in spans]
    else:  # the engine could not tell which token came from which: the versions at start and end bound it
        versions = list(dict.fromkeys([result.version_start, result.version_end]))
    sample.weight_versions += [str(v) for v in versions]
    meta = sample.metadata.setdefault("rollfleet", {"weight_versions": [], "calls": []})
    meta["weight_versions"] += [list(span) for span in spans]
    meta["calls"].append(
        {
            "version_start": result.version_start,
            "version_end": result.version_end,
            "worker_id": result.worker_id,
            "idempotency_key": result.idempotency_key,
            "replay": coordinate_wire(result.replay, 0),
        }
    )
    status = {"length": "TRUNCATED", "stop": "COMPLETED", "abort": "ABORTED"}[out.finish_reason]
    sample.status = getattr(type(sample).Status, status)
    return sample


async def generate(input: Any) -> GenerateOutput:
    """``--custom-generate-function-path rollfleet.integrations.miles.generate`` (miles' ``generate(input)``)."""
    args, sample, state = input.args, input.sample, input.state
    config = MilesConfig.from_args(args)
    prompt_ids = _prompt_ids(state, sample)
    params = dict(input.sampling_params)
    input_ids = prompt_ids
    if sample.response:  # a partial rollout resumes: continue after what was generated
        input_ids = list(sample.tokens)
        params["max_new_tokens"] = int(params.get("max_new_tokens", 0)) - (len(sample.tokens) - len(prompt_ids))
    payload = payload_for(args, input_ids, params)
    if payload is None:
        sample.status = type(sample).Status.TRUNCATED
        return GenerateOutput(samples=sample)
    result = await submit_until_served(await rollout_client(config), payload, config)
    fill_sample(sample, input_ids, result, getattr(state, "tokenizer", None))
    return GenerateOutput(samples=sample)
