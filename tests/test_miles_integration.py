"""A miles-shaped training loop hands its versions and rollouts to rollfleet with miles' flags only.

The trainer is ``miles_like.py``: two real gloo ranks that follow miles' disk-delta call sequence
and file layout, loading ``rollfleet.integrations.miles.post_write_hook`` by its dotted path and
getting the rollfleet settings as ``args`` attributes (what ``--custom-config-path`` does). The
fleet is a real rollfleet worker following the store through a real broker.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import subprocess
import sys
from argparse import Namespace
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from policy_helpers import make_checkpoint, raw, read_local
from safetensors.torch import load_file

from harness import running_worker, wait_until
from rollfleet.integrations import miles
from rollfleet.policy_store import list_versions, materialize, read_record
from rollfleet.policy_store.store import read_index
from rollfleet.schemas import coordinate_wire
from rollfleet.schemas.errors import InvalidRequest, NoCompatibleReplica
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.workers.engines.echo import EchoEngine
from tests.helpers import stored_results

MILES_LIKE = Path(__file__).with_name("miles_like.py")
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
async def close_connections() -> AsyncIterator[None]:
    """The hook and generate keep a connection per process (and loop); close them per test."""
    yield
    await miles.close_rollout_client()
    await asyncio.to_thread(miles.shutdown)


@dataclass
class Run:
    """One miles run: its rank processes and where it leaves its expected weights."""

    procs: list[subprocess.Popen[bytes]]
    expected: Path

    async def wait(self, timeout: float = 120) -> list[int]:
        return [await asyncio.to_thread(p.wait, timeout) for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def state(self, version: int) -> dict[str, bytes]:
        """The trainer's full weights after its ``version``, from every rank."""
        tensors: dict[str, torch.Tensor] = {}
        for part in sorted(self.expected.glob(f"v{version}-r*.safetensors")):
            tensors.update(load_file(str(part)))
        return raw(tensors)


class Miles:
    """Starts miles-shaped runs against one rollfleet namespace and store."""

    def __init__(self, tmp: Path, nats_url: str, namespace: str) -> None:
        self.tmp = tmp
        self.hf = tmp / "hf"
        self.base = make_checkpoint(self.hf)
        self.disk_dir = tmp / "miles-deltas"  # miles' own directory, cleared at every start
        self.store = tmp / "store"  # rollfleet's
        self.config = {"rollfleet_nats": nats_url, "rollfleet_namespace": namespace, "rollfleet_store": str(self.store)}
        self.runs = 0

    def start(self, steps: int, *flags: str, encoding: str = "xor", checksum: str = "xxh3-128") -> Run:
        self.runs += 1
        name = f"run{self.runs}"
        expected = self.tmp / f"{name}-expected"
        procs = []
        for rank in range(2):
            cmd = [sys.executable, str(MILES_LIKE), "--rank", str(rank), "--world", "2"]
            cmd += ["--pg-file", str(self.tmp / f"{name}.pg"), "--hf-checkpoint", str(self.hf)]
            cmd += ["--disk-dir", str(self.disk_dir), "--steps", str(steps), "--seed", str(self.runs)]
            cmd += ["--expected", str(expected), "--config", json.dumps(self.config)]
            cmd += ["--encoding", encoding, "--checksum", checksum, *flags]
            log = open(self.tmp / f"{name}-rank{rank}.log", "wb")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ}))
            log.close()
        return Run(procs, expected)

    def args(self) -> Namespace:
        return Namespace(update_weight_disk_dir=str(self.disk_dir), hf_checkpoint=str(self.hf), **self.config)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.tmp.glob("run*-rank*.log")))


@pytest.fixture
async def setup(nats_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[tuple[Miles, RolloutClient]]:
    """miles runs against a namespace, and a client that watches its versions."""
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="observer") as client:
        yield Miles(tmp_path, nats_url, namespace), client


async def latest_is(client: RolloutClient, version: int, timeout: float = 30) -> None:
    async def check() -> bool:
        await client.fleet.refresh()
        return client.latest_version == version

    await wait_until(check, timeout=timeout)


def origin(store: Path, version: int) -> tuple[int, int] | None:
    found = miles._origin(store, version)
    return None if found is None else found[:2]


async def test_runs_and_a_second_run_reach_the_fleet_byte_for_byte(
    setup: tuple[Miles, RolloutClient], nats_url: str, namespace: str, tmp_path: Path
) -> None:
    m, client = setup
    run1 = m.start(3)
    assert await run1.wait() == [0, 0], m.logs()
    await latest_is(client, 3)
    # miles' version 0 (its --hf-checkpoint) is rollfleet's 0; its 1..3 are rollfleet's 1..3.
    assert list_versions(m.store) == [0, 1, 2, 3]
    assert [origin(m.store, v) for v in range(4)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert read_record(m.store, 0).kind == "base"
    local = tmp_path / "check"
    materialize(local, m.store, 0)
    assert read_local(local) == raw(m.base)
    materialize(local, m.store, 3)
    assert read_local(local) == run1.state(3)

    worker_dir = tmp_path / "replica"
    async with running_worker(nats_url, namespace, store_dir=m.store, local_dir=worker_dir) as worker:
        assert worker.version == 3 and read_local(worker_dir) == run1.state(3)
        # A second run in the same namespace: miles numbers from 1 again and clears its directory.
        run2 = m.start(2, encoding="overwrite", checksum="adler32")
        assert await run2.wait() == [0, 0], m.logs()
        await latest_is(client, 6)
        assert [origin(m.store, v) for v in (4, 5, 6)] == [(4, 0), (4, 1), (4, 2)]
        assert (
            read_record(m.store, 4).kind == "full" and read_index(m.store / "weight_v000005").metadata.base_version == 4
        )
        await client.wait_for_version(6, timeout=30)
        assert worker.version == 6 and read_local(worker_dir) == run2.state(2)
    # miles' start-up deleted its own directory, never the store.
    assert sorted(p.name for p in m.disk_dir.iterdir()) == ["weight_v000001", "weight_v000002"]
    assert list_versions(m.store) == [0, 1, 2, 3, 4, 5, 6]
    fresh = tmp_path / "fresh"  # a new replica catches up through both runs
    assert materialize(fresh, m.store, 6).seeded_from == 4 and read_local(fresh) == run2.state(2)


async def test_crashes_before_the_hook_and_inside_the_commit_then_a_restart(
    setup: tuple[Miles, RolloutClient], nats_url: str, namespace: str, tmp_path: Path
) -> None:
    m, client = setup
    # A run that dies after writing version 2's files, before its hook: version 2 never reaches rollfleet.
    run1 = m.start(3, "--crash-before-hook", "2")
    assert await run1.wait() == [3, 3], m.logs()
    await latest_is(client, 1)
    assert list_versions(m.store) == [0, 1]

    # A run killed inside the commit of its version 1: written, v.N created, latest not moved.
    run2 = m.start(2, "--kill-in-commit", "1")
    codes = [await asyncio.to_thread(run2.procs[0].wait, 120)]
    run2.kill()
    assert codes == [-9], m.logs()
    assert list_versions(m.store) == [0, 1, 2, 3] and origin(m.store, 3) == (2, 1)
    await latest_is(client, 2)
    # Handing the same version over again (here from another process) finishes that commit...
    await asyncio.to_thread(miles.post_write_hook, m.args(), m.disk_dir / "weight_v000001", [])
    await latest_is(client, 3)
    # ... and changes nothing the second time.
    await asyncio.to_thread(miles.post_write_hook, m.args(), m.disk_dir / "weight_v000001", [])
    await asyncio.sleep(0.5)
    await latest_is(client, 3)
    assert list_versions(m.store) == [0, 1, 2, 3]

    async with running_worker(nats_url, namespace, store_dir=m.store, local_dir=tmp_path / "replica") as worker:
        assert worker.version == 3 and read_local(tmp_path / "replica") == run2.state(1)
        # The restarted trainer is a new run: a new base past everything, and the fleet follows it.
        run3 = m.start(2)
        assert await run3.wait() == [0, 0], m.logs()
        assert [origin(m.store, v) for v in (4, 5, 6)] == [(4, 0), (4, 1), (4, 2)]
        await client.wait_for_version(6, timeout=30)
        assert worker.version == 6 and read_local(tmp_path / "replica") == run3.state(2)


async def test_a_version_written_but_never_committed_is_passed_over(
    setup: tuple[Miles, RolloutClient], nats_url: str, namespace: str, tmp_path: Path
) -> None:
    m, client = setup
    run1 = m.start(2, "--kill-in-commit", "2")
    await asyncio.to_thread(run1.procs[0].wait, 120)
    run1.kill()
    await latest_is(client, 1)
    assert list_versions(m.store) == [0, 1, 2]  # 2 is written, its commit never finished
    async with running_worker(nats_url, namespace, store_dir=m.store, local_dir=tmp_path / "replica") as worker:
        run2 = m.start(1)
        assert await run2.wait() == [0, 0], m.logs()
        assert [origin(m.store, v) for v in (3, 4)] == [(3, 0), (3, 1)]
        await client.wait_for_version(4, timeout=30)
        assert read_local(tmp_path / "replica") == run2.state(1) and worker.version == 4


def test_only_rank_zero_acts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    args = Namespace(update_weight_disk_dir=str(tmp_path / "d"), hf_checkpoint=str(tmp_path / "hf"))
    args.rollfleet_store = str(tmp_path / "store")
    args.rollfleet_nats = "nats://127.0.0.1:1"  # nothing listens: a rank that acted would fail
    miles.post_write_hook(args, str(tmp_path / "d"), [])
    miles.post_write_hook(args, str(tmp_path / "d" / "weight_v000001"), [])
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("where", ["the store is miles' directory", "the store is inside it"])
def test_a_store_miles_would_delete_is_refused_before_anything_is_written(tmp_path: Path, where: str) -> None:
    disk = tmp_path / "miles-deltas"
    disk.mkdir()
    store = disk if where == "the store is miles' directory" else disk / "policy"
    make_checkpoint(tmp_path / "hf")
    args = Namespace(update_weight_disk_dir=str(disk), hf_checkpoint=str(tmp_path / "hf"), rollfleet_store=str(store))
    args.rollfleet_nats = "nats://127.0.0.1:1"
    with pytest.raises(InvalidRequest, match="deletes at start-up"):
        miles.post_write_hook(args, str(disk), [])
    assert list_versions(store) == [] and sorted(disk.iterdir()) == []


def test_settings_come_from_args_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLFLEET_NAMESPACE", "from-env")
    monkeypatch.setenv("ROLLFLEET_STORE", "/env/store")
    config = miles.MilesConfig.from_args(Namespace(rollfleet_store="/args/store", max_weight_staleness=3))
    assert (config.namespace, config.store, config.max_staleness) == ("from-env", Path("/args/store"), 3)
    with pytest.raises(InvalidRequest, match="rollfleet_store"):
        monkeypatch.delenv("ROLLFLEET_STORE")
        miles.MilesConfig.from_args(Namespace()).require_store()


# -- rollouts ---------------------------------------------------------------------------------------


class Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


@dataclass
class Sample:
    """The fields of miles' ``Sample`` (miles/utils/types.py) that a generate function fills."""

    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict | None = None
    response: str = ""
    response_length: int = 0
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    metadata: dict = field(default_factory=dict)
    status: Status = Status.PENDING
    Status = Status


class ByteTokenizer:
    """A tokenizer over bytes (the generate function only calls these three methods)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode("latin-1")

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@dataclass(frozen=True)
class GenerateInput:
    """miles' ``GenerateFnInput``: state (args, tokenizer), sample, sampling params."""

    state: Any
    sample: Sample
    sampling_params: dict
    evaluation: bool = False

    @property
    def args(self) -> Any:
        return self.state.args


def generate_input(config: dict, sample: Sample, max_new_tokens: int, **params: Any) -> GenerateInput:
    args = Namespace(rollout_max_response_len=1024, rollout_max_context_len=None, **config)
    state = Namespace(args=args, tokenizer=ByteTokenizer())
    return GenerateInput(state, sample, {"max_new_tokens": max_new_tokens, "temperature": 1.0, **params})


async def test_generate_fills_a_miles_sample_with_per_token_versions(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    make_checkpoint(tmp_path / "hf")
    store = tmp_path / "store"
    config = {"rollfleet_nats": nats_url, "rollfleet_namespace": namespace, "rollfleet_store": str(store)}
    config["rollfleet_max_staleness"] = 0
    config["rollfleet_client_id"] = "miles-t"
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer") as client:
        publisher = PolicyPublisher(store, tmp_path / "hf")
        weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
        await client.publish_policy(publisher, weights)
        engine = EchoEngine(per_token_s=0.02)
        async with running_worker(nats_url, namespace, engine=engine, store_dir=store, local_dir=tmp_path / "r"):
            sample = Sample(prompt=[{"role": "user", "content": "hi"}])
            task = asyncio.create_task(miles.generate(generate_input(config, sample, 80, stop=["\n"])))
            await wait_until(lambda: any(r.in_flight for r in client.fleet.replicas()), timeout=10)
            await asyncio.sleep(0.3)
            for t in weights.values():
                t.view(-1)[:2] += 1
            await client.publish_policy(publisher, weights)  # activated while the sample is generating
            out = (await asyncio.wait_for(task, 30)).samples
            prompt = list(b"<user>hi<assistant>")
            assert out is sample and out.tokens[: len(prompt)] == prompt and len(out.tokens) == len(prompt) + 80
            assert out.response_length == 80 and len(out.rollout_log_probs) == 80 and out.status is Status.TRUNCATED
            assert out.weight_versions == ["0", "1"]
            [(v0, a0, b0), (v1, a1, b1)] = out.metadata["rollfleet"]["weight_versions"]
            assert (v0, a0, v1, b1) == (0, 0, 1, 80) and b0 == a1 and 0 < a1 < 80
            assert out.response == ByteTokenizer().decode(out.tokens[len(prompt) :])
            # A partial rollout resumes after what was generated: spans continue over the response.
            sample.status = Status.PENDING
            again = (await miles.generate(generate_input(config, sample, 90))).samples
            assert again.response_length == 90 and again.weight_versions == ["0", "1", "1"]
            assert again.metadata["rollfleet"]["weight_versions"][-1] == [1, 80, 90]
            assert len(again.metadata["rollfleet"]["calls"]) == 2
            # Each call's replay coordinate is the one the worker stored with that call's answer.
            for call in again.metadata["rollfleet"]["calls"]:
                (stored,) = await stored_results(nats_url, namespace, "miles-t", call["idempotency_key"])
                assert stored.replay is not None and call["replay"] == coordinate_wire(stored.replay, 0)


async def test_generate_waits_for_a_compatible_replica_and_refuses_bad_input(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    config = {"rollfleet_nats": nats_url, "rollfleet_namespace": namespace, "rollfleet_timeout": 20}
    task = asyncio.create_task(miles.generate(generate_input(config, Sample(prompt="abc"), 4)))
    await asyncio.sleep(1.5)  # no replica: NoCompatibleReplica, retried
    assert not task.done()
    async with running_worker(nats_url, namespace):
        out = (await asyncio.wait_for(task, 20)).samples
        assert out.response_length == 4 and out.weight_versions == ["0"]
        with pytest.raises(InvalidRequest):
            await miles.generate(generate_input(config, Sample(prompt="abc"), 10**6))
    short = dict(config, rollfleet_timeout=1)
    with pytest.raises(NoCompatibleReplica):
        await miles.generate(generate_input(short, Sample(prompt="abc"), 4))
