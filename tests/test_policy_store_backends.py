"""The policy store's promises, on both backends: a store directory and an S3 bucket (a real
``moto_server`` process with IAM checks on, reached through obstore).

Each test in the first part runs on both (``backend``), so the two cannot drift: byte-exact
materialization along a chain of deltas, keyframes and many shards; a late joiner; retention; a
corrupt object; a missing object; a publisher that resumes; two publishers racing for a number.
The second part is what only an object store has: URLs, credentials, interrupted downloads and
uploads, hostile keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from policy_helpers import Trainer, kill_at_pause, make_checkpoint, raw, read_local

from rollfleet.cli import local_s3 as s3
from rollfleet.policy_store import list_versions, read_marker
from rollfleet.policy_store.bucket import OBJECTS_KEY, PIN_FORMAT, Bucket, check_store
from rollfleet.policy_store.formats import new_hasher
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.policy_store.remote import CACHE_DIR, materialize_from, open_store
from rollfleet.policy_store.retention import plan_retention
from rollfleet.schemas.errors import (
    ChecksumMismatch,
    CorruptArtifact,
    HostileName,
    PolicyError,
    StoreAccessDenied,
    UnsupportedStore,
    VersionConflict,
)
from rollfleet.schemas.index import INDEX_FILE

pytestmark = pytest.mark.skipif(s3.unavailable() is not None, reason=str(s3.unavailable()))


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3.S3Server]:
    server = s3.S3Server(tmp_path_factory.mktemp("s3")).start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)  # this process's trainer and readers find the bucket as users do
        yield server
    server.stop()


@dataclass
class Backend:
    """One store, whichever kind: where a publisher writes, how to follow it, how to damage it."""

    kind: str
    store: str  # a directory path or an s3:// URL
    server: s3.S3Server | None = None

    def reader(self) -> Path | Bucket:
        return open_store(self.store)

    def follow(self, local: Path, version: int):  # type: ignore[no-untyped-def]
        return materialize_from(self.reader(), local, version)

    def versions(self) -> list[int]:
        reader = self.reader()
        return reader.versions() if isinstance(reader, Bucket) else list_versions(reader)

    def _key(self, version: int, name: str) -> str:
        """The object holding file ``name`` of a version: the one its index pins (the index itself)."""
        vdir = f"{self.store.split('/', 3)[3]}/weight_v{version:06d}"
        if name == INDEX_FILE:
            return f"{vdir}/{name}"
        return f"{vdir}/{self._pins(version)['prefix']}/{name}"

    def _pins(self, version: int) -> dict:
        assert self.server is not None
        key = f"{self.store.split('/', 3)[3]}/weight_v{version:06d}/{INDEX_FILE}"
        index = json.loads(self.server.client().get_object(Bucket=s3.BUCKET, Key=key)["Body"].read())
        return index["metadata"][OBJECTS_KEY]  # type: ignore[no-any-return]

    def files(self, version: int) -> list[str]:
        """A version's files: those its index pins, or every object under it while it has no index."""
        if self.server is None:
            return sorted(os.listdir(Path(self.store) / f"weight_v{version:06d}"))
        reader = self.reader()
        assert isinstance(reader, Bucket)
        objects = reader.objects().get(version, {})
        if INDEX_FILE not in objects:
            return sorted(objects)
        return sorted([INDEX_FILE, *self._pins(version)["files"]])

    def read(self, version: int, name: str) -> bytes:
        if self.server is None:
            return (Path(self.store) / f"weight_v{version:06d}" / name).read_bytes()
        got = self.server.client().get_object(Bucket=s3.BUCKET, Key=self._key(version, name))
        return got["Body"].read()  # type: ignore[no-any-return]

    def write(self, version: int, name: str, data: bytes) -> None:
        if self.server is None:
            path = Path(self.store) / f"weight_v{version:06d}" / name
            path.unlink(missing_ok=True)  # a hard link to the base must not be damaged through
            path.write_bytes(data)
        else:
            self.server.client().put_object(Bucket=s3.BUCKET, Key=self._key(version, name), Body=data)

    def remove(self, version: int, name: str) -> None:
        if self.server is None:
            (Path(self.store) / f"weight_v{version:06d}" / name).unlink()
        else:
            self.server.client().delete_object(Bucket=s3.BUCKET, Key=self._key(version, name))


@pytest.fixture(params=["dir", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "dir":
        return Backend("dir", str(tmp_path / "store"))
    server: s3.S3Server = request.getfixturevalue("s3_server")
    return Backend("s3", server.url(tmp_path.name), server)


def _shards(backend: Backend, version: int) -> list[str]:
    return [n for n in backend.files(version) if n.endswith(".safetensors")]


def _publish_chain(tmp: Path, backend: Backend, n: int, **options: object) -> tuple[PolicyPublisher, list[dict]]:
    base = make_checkpoint(tmp / "base", sharded=True)
    options.setdefault("max_shard_bytes", 1 << 20)  # several shards per full version
    pub = PolicyPublisher(backend.store, tmp / "base", **options)  # type: ignore[arg-type]
    trainer = Trainer(base)
    weights = [trainer.weights()]
    pub.publish(weights[0])
    for _ in range(n):
        weights.append(trainer.step())
        pub.publish(weights[-1])
    return pub, weights


# -- the same promises on both backends --------------------------------------------------------


def test_a_chain_of_deltas_keyframes_and_shards_materializes_byte_exact(tmp_path: Path, backend: Backend) -> None:
    pub, weights = _publish_chain(tmp_path, backend, 7, keyframe_every=3, keep_last=None)
    assert backend.versions() == list(range(8))
    assert len(_shards(backend, 6)) > 1  # the keyframe at 6 is several shards
    local = tmp_path / "local"
    for v in range(8):  # a replica following every version
        result = backend.follow(local, v)
        assert result.version == v and read_marker(local) == v
        assert read_local(local) == raw(weights[v]), v
    late = backend.follow(tmp_path / "late", 7)  # a late joiner: the newest keyframe and what follows
    assert (late.seeded_from, late.applied) == (6, [6, 7])
    assert read_local(tmp_path / "late") == raw(weights[7])
    assert pub.latest_version == 7


def test_retention_keeps_what_catch_up_needs_on_both(tmp_path: Path, backend: Backend) -> None:
    _, weights = _publish_chain(tmp_path, backend, 11, keyframe_every=4, keep_last=3)
    kept = backend.versions()
    assert set(kept) == plan_retention({v: v % 4 == 0 for v in range(12)}, 3) == {0, 8, 9, 10, 11}
    backend.follow(tmp_path / "late", 11)
    assert read_local(tmp_path / "late") == raw(weights[11])


def test_a_corrupt_object_is_a_typed_error_and_the_replica_keeps_its_version(tmp_path: Path, backend: Backend) -> None:
    _, weights = _publish_chain(tmp_path, backend, 2, keyframe_every=0, keep_last=None)
    local = tmp_path / "local"
    backend.follow(local, 1)
    shard = _shards(backend, 2)[0]
    good = backend.read(2, shard)
    bad = bytearray(good)
    bad[-5] ^= 0xFF  # inside the last frame: the file parses, a checksum does not match
    backend.write(2, shard, bytes(bad))
    with pytest.raises((ChecksumMismatch, CorruptArtifact)) as info:
        backend.follow(local, 2)
    assert isinstance(info.value, PolicyError)
    assert read_marker(local) == 1 and read_local(local) == raw(weights[1])  # still serving v1, intact
    backend.write(2, shard, good)  # repaired at the source: the next try reads it again, not a cached copy
    backend.follow(local, 2)
    assert read_local(local) == raw(weights[2])


def test_a_missing_object_is_a_typed_error_and_the_replica_keeps_its_version(tmp_path: Path, backend: Backend) -> None:
    _, weights = _publish_chain(tmp_path, backend, 2, keyframe_every=0, keep_last=None)
    local = tmp_path / "local"
    backend.follow(local, 1)
    backend.remove(2, _shards(backend, 2)[0])
    with pytest.raises(PolicyError):
        backend.follow(local, 2)
    assert read_marker(local) == 1 and read_local(local) == raw(weights[1])


def test_a_new_publisher_resumes_and_two_cannot_publish_the_same_number(tmp_path: Path, backend: Backend) -> None:
    a, _ = _publish_chain(tmp_path, backend, 1, keyframe_every=0, keep_last=None)
    trainer = Trainer(make_checkpoint(tmp_path / "base", sharded=True), seed=5)
    b = PolicyPublisher(backend.store, tmp_path / "base", keep_last=None)
    assert b.latest_version == 1
    assert b.publish(trainer.step()).version == 2  # b resumed from the store alone
    with pytest.raises(VersionConflict):
        a.publish(trainer.step())  # a still believes 1 is the latest
    assert backend.versions() == [0, 1, 2]
    rec = a.publish(trainer.weights())  # a rebuilt its state from the store and moves on
    assert (rec.version, rec.base_version) == (3, 2)
    backend.follow(tmp_path / "local", 3)
    assert read_local(tmp_path / "local") == raw(trainer.weights())


# -- what only an object store has -------------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://host/weights", "http://host/weights", "nats://host/weights", "s4://b/p"])
def test_a_store_address_rollfleet_cannot_serve_is_refused_in_one_line(tmp_path: Path, url: str) -> None:
    make_checkpoint(tmp_path / "base")
    with pytest.raises(UnsupportedStore) as info:
        PolicyPublisher(url, tmp_path / "base")
    assert url in str(info.value) and "\n" not in str(info.value)
    assert not any(p.name.endswith(":") for p in Path.cwd().iterdir())  # no local folder named after it
    proc = subprocess.run(
        [sys.executable, "-m", "rollfleet", "worker", "--nats", "nats://127.0.0.1:1", "--store", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "cannot serve a policy store" in proc.stderr and "Traceback" not in proc.stderr


def test_a_url_that_went_through_pathlib_is_still_a_url() -> None:
    assert check_store(Path("s3://bucket/prefix")) == "s3://bucket/prefix"
    assert check_store("file:///tmp/store") == Path("/tmp/store")
    assert check_store("relative/dir") == Path("relative/dir")


def test_wrong_credentials_are_one_clear_line_that_never_prints_the_secret(
    tmp_path: Path, s3_server: s3.S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_checkpoint(tmp_path / "base")
    secret = "wrong-secret-Zq9xK2"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(StoreAccessDenied) as info:
        PolicyPublisher(s3_server.url("creds"), tmp_path / "base")
    text = str(info.value)
    assert "SignatureDoesNotMatch" in text and "\n" not in text
    assert secret not in text and s3_server.access_key not in text
    assert not info.value.retryable
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
    with pytest.raises(StoreAccessDenied) as info:
        Bucket(s3_server.url("creds")).versions()
    assert "InvalidAccessKeyId" in str(info.value) and "AKIANOSUCHKEY" not in str(info.value)


_DOWNLOAD = """
import sys
from rollfleet.policy_store.bucket import Bucket
from rollfleet.policy_store.remote import materialize_from
result = materialize_from(Bucket({url!r}, segment_bytes=256 << 10, step_bytes=32 << 10, connections=2), {local!r}, {v})
print("DONE", result.fetched_bytes, result.resumed_bytes, flush=True)
"""


def test_a_download_killed_midway_resumes_where_it_stopped(tmp_path: Path, s3_server: s3.S3Server) -> None:
    url = s3_server.url(tmp_path.name)
    _, weights = _publish_chain(tmp_path, Backend("s3", url, s3_server), 1, keyframe_every=0, keep_last=None)
    code = _DOWNLOAD.format(url=url, local=str(tmp_path / "local"), v=1)
    kill_at_pause(code, "bucket:mid-download")
    cache = tmp_path / "local" / CACHE_DIR
    assert any(n.startswith(".partial-") for n in os.listdir(cache))  # kept for the next try
    assert read_marker(tmp_path / "local") is None
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    _, fetched, resumed = done.stdout.split()
    assert int(resumed) > 0 and int(fetched) > 0  # some chunks came from the killed attempt
    assert read_local(tmp_path / "local") == raw(weights[1])
    assert os.listdir(cache) == [".rollfleet.lock"]  # nothing left behind once applied


def test_an_upload_killed_midway_is_never_listed_and_the_next_publisher_publishes_the_number(
    tmp_path: Path, s3_server: s3.S3Server
) -> None:
    url = s3_server.url(tmp_path.name)
    backend = Backend("s3", url, s3_server)
    _, weights = _publish_chain(tmp_path, backend, 0, keep_last=None)
    child_code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from policy_helpers import Trainer, make_checkpoint
from rollfleet.policy_store.publisher import PolicyPublisher
pub = PolicyPublisher({url!r}, {str(tmp_path / "base")!r}, keep_last=None, keyframe_every=1, max_shard_bytes=1 << 20)
pub.publish(Trainer(make_checkpoint(Path({str(tmp_path / "scratch")!r}), sharded=True), seed=3).step())
"""
    kill_at_pause(child_code, "bucket:mid-upload")
    assert backend.versions() == [0]  # half uploaded: not published
    assert backend.files(1) and INDEX_FILE not in backend.files(1)
    trainer = Trainer(weights[0], seed=9)
    pub = PolicyPublisher(url, tmp_path / "base", keep_last=None)
    assert pub.publish(trainer.step()).version == 1
    # The dead upload's objects are left alone (they might have been a live racer's), and unpinned.
    reader = backend.reader()
    assert isinstance(reader, Bucket)
    pins = _edit_index(backend, 1)
    assert {k for k in reader.objects()[1] if not k.startswith(f"{pins['prefix']}/")} - {INDEX_FILE}
    backend.follow(tmp_path / "local", 1)
    assert read_local(tmp_path / "local") == raw(trainer.weights())


def test_hostile_object_names_are_refused(tmp_path: Path, s3_server: s3.S3Server) -> None:
    url = s3_server.url(tmp_path.name)
    backend = Backend("s3", url, s3_server)
    _publish_chain(tmp_path, backend, 0, keep_last=None)
    backend.write(0, "a\\..\\..\\evil.json", b"x")  # a full version's extra top-level file...
    pins = _edit_index(backend, 0)
    pins["files"]["a\\..\\..\\evil.json"] = {"size": 1, "checksum": _pin(b"x")}  # ...that its index pins
    _edit_index(backend, 0, pins)
    with pytest.raises(HostileName):
        backend.follow(tmp_path / "local", 0)
    assert read_marker(tmp_path / "local") is None


def test_a_base_recorded_from_torch_tensors_round_trips(tmp_path: Path, s3_server: s3.S3Server) -> None:
    """The first publish() records the base (hard links on disk; an upload here) from tensors alone."""
    url = s3_server.url(tmp_path.name)
    tensors = make_checkpoint(tmp_path / "base")
    pub = PolicyPublisher(url, tmp_path / "base")
    assert pub.publish(tensors).kind == "base"
    materialize_from(open_store(url), tmp_path / "local", 0)
    assert read_local(tmp_path / "local") == raw({n: t.contiguous() for n, t in tensors.items()})
    assert (tmp_path / "local" / "config.json").is_file()  # the checkpoint's config came along
    pub.close()
    assert not pub.store_dir.exists()  # its staging directory is gone


def test_a_store_that_cannot_be_opened_says_what_is_missing_and_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollfleet.policy_store.bucket import _redact

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "c2VjcmV0LWtleS12YWx1ZQ==")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(UnsupportedStore) as info:
        Bucket("az://container/prefix")  # no account: refused when opened, before any request
    assert "Account must be specified" in str(info.value) and "\n" not in str(info.value)
    assert _redact("sent c2VjcmV0LWtleS12YWx1ZQ== to the server") == "sent *** to the server"


def test_an_endpoint_given_as_a_setting_instead_of_the_environment(
    tmp_path: Path, s3_server: s3.S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MinIO, Ceph, R2: the endpoint as ``store_options`` / ``Bucket(endpoint=)`` (what
    ``--store-endpoint`` passes), with only the credentials in the environment."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    tensors = make_checkpoint(tmp_path / "base")
    url = s3_server.url(tmp_path.name)
    pub = PolicyPublisher(url, tmp_path / "base", store_options={"endpoint": s3_server.endpoint})
    pub.publish(tensors)
    materialize_from(Bucket(url, endpoint=s3_server.endpoint), tmp_path / "local", 0)
    assert read_local(tmp_path / "local") == raw(tensors)


# -- a published version is what its index pins, whoever else writes -------------------------


def _pin(data: bytes) -> str:
    hasher = new_hasher(PIN_FORMAT)
    hasher.update(data)
    return hasher.hexdigest()


def _edit_index(backend: Backend, version: int, pins: dict | None = None) -> dict:
    """The pins of a version's index; with ``pins``, the index object rewritten to pin those instead
    (what no publisher can do: the index is create-only; damage, or a repair, at the source)."""
    key = backend._key(version, INDEX_FILE)
    doc = json.loads(backend.read(version, INDEX_FILE))
    if pins is not None:
        doc["metadata"][OBJECTS_KEY] = pins
        assert backend.server is not None
        backend.server.client().put_object(Bucket=s3.BUCKET, Key=key, Body=json.dumps(doc).encode())
    return doc["metadata"][OBJECTS_KEY]  # type: ignore[no-any-return]


def test_racing_publishers_one_wins_and_a_replica_gets_exactly_the_winners_bytes(
    tmp_path: Path, s3_server: s3.S3Server
) -> None:
    url = s3_server.url(tmp_path.name)
    backend = Backend("s3", url, s3_server)
    base = make_checkpoint(tmp_path / "base", sharded=True)
    PolicyPublisher(url, tmp_path / "base", keep_last=None).publish(base)
    local = tmp_path / "local"
    backend.follow(local, 0)
    # Two trainers that both believe 0 is the latest publish different bytes as 1, at once.
    pubs = [PolicyPublisher(url, tmp_path / "base", keep_last=None, max_shard_bytes=1 << 20) for _ in range(2)]
    weights = [Trainer(base, seed=seed).step() for seed in (3, 4)]
    start = threading.Barrier(2)
    outcome: dict[int, object] = {}

    def publish(i: int) -> None:
        start.wait()
        try:
            outcome[i] = pubs[i].publish(weights[i])
        except VersionConflict as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    [winner] = [i for i in range(2) if not isinstance(outcome[i], VersionConflict)]
    assert isinstance(outcome[1 - winner], VersionConflict)
    assert backend.versions() == [0, 1]
    # The refused publisher took back what it wrote: under 1, the index and what it pins alone.
    pins = _edit_index(backend, 1)
    reader = backend.reader()
    assert isinstance(reader, Bucket)
    assert set(reader.objects()[1]) == {INDEX_FILE} | {f"{pins['prefix']}/{n}" for n in pins["files"]}
    backend.follow(local, 1)
    assert read_local(local) == raw(weights[winner])
    late = tmp_path / "late"
    backend.follow(late, 1)  # a second replica, from nothing: the same version 1
    assert read_local(late) == raw(weights[winner])


@pytest.mark.parametrize("keyframe_every", [0, 1], ids=["delta", "full"])
def test_a_late_upload_under_a_published_version_cannot_change_what_readers_verify(
    tmp_path: Path, s3_server: s3.S3Server, keyframe_every: int
) -> None:
    """A refused publisher's puts landing after the winner's index (its shards, and its sidecar:
    a full version's checksums): every object readers read for version 1 gets the loser's bytes."""
    url = s3_server.url(tmp_path.name)
    backend = Backend("s3", url, s3_server)
    base = make_checkpoint(tmp_path / "base", sharded=True)
    options = {"keep_last": None, "keyframe_every": keyframe_every}
    pub = PolicyPublisher(url, tmp_path / "base", **options)  # type: ignore[arg-type]
    pub.publish(base)
    local = tmp_path / "local"
    backend.follow(local, 0)
    pub.publish(Trainer(base, seed=3).step())
    loser = PolicyPublisher(tmp_path / "loser", tmp_path / "base", **options)  # type: ignore[arg-type]
    loser.publish(base)
    loser.publish(Trainer(base, seed=4).step())  # its version 1: the same base, other bytes
    loser_dir = tmp_path / "loser" / "weight_v000001"
    prefix = f"{tmp_path.name}/weight_v000001/"
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3.BUCKET, Prefix=prefix)["Contents"]]
    replaced = 0
    for name in os.listdir(loser_dir):
        for key in (k for k in keys if k.endswith(f"/{name}") and name != INDEX_FILE):
            client.put_object(Bucket=s3.BUCKET, Key=key, Body=(loser_dir / name).read_bytes())
            replaced += 1
    assert replaced >= 2  # a shard and the sidecar at least
    with pytest.raises(ChecksumMismatch):
        backend.follow(local, 1)
    assert read_marker(local) == 0 and read_local(local) == raw(base)  # still serving 0, intact
    with pytest.raises(ChecksumMismatch):
        backend.follow(tmp_path / "late", 1)
    assert read_marker(tmp_path / "late") is None


def _rename_first_tensor(shard: bytes, name: str) -> bytes:
    """A safetensors file whose first tensor is called ``name`` (its bytes where they were)."""
    n = int.from_bytes(shard[:8], "little")
    header = json.loads(shard[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[name] = header.pop(first)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + shard[8 + n :]


def test_a_download_refused_for_any_reason_is_not_reused_after_the_bucket_is_repaired(
    tmp_path: Path, s3_server: s3.S3Server
) -> None:
    url = s3_server.url(tmp_path.name)
    backend = Backend("s3", url, s3_server)
    _, weights = _publish_chain(tmp_path, backend, 1, keyframe_every=0, keep_last=None)
    local = tmp_path / "local"
    backend.follow(local, 0)
    pins = _edit_index(backend, 1)
    shard = next(n for n in pins["files"] if n.endswith(".safetensors"))
    good = backend.read(1, shard)
    hostile = _rename_first_tensor(good, "../evil")
    backend.write(1, shard, hostile)  # a bad version at the source, its pins consistent with it
    bad_pins = json.loads(json.dumps(pins))
    bad_pins["files"][shard] = {"size": len(hostile), "checksum": _pin(hostile)}
    _edit_index(backend, 1, bad_pins)
    with pytest.raises(HostileName):
        backend.follow(local, 1)
    assert read_marker(local) == 0
    assert not (local / CACHE_DIR / "weight_v000001").exists()  # the refused download was forgotten
    backend.write(1, shard, good)  # repaired at the source
    _edit_index(backend, 1, pins)
    backend.follow(local, 1)
    assert read_local(local) == raw(weights[1])


def test_a_version_published_again_under_its_number_is_read_afresh(tmp_path: Path, s3_server: s3.S3Server) -> None:
    """A long-lived reader's cached index is dropped when a listing shows the index replaced."""
    url = s3_server.url(tmp_path.name)
    base = make_checkpoint(tmp_path / "base", sharded=True)
    pub = PolicyPublisher(url, tmp_path / "base", keep_last=None, keyframe_every=0)
    pub.publish(base)
    pub.publish(Trainer(base, seed=3).step())
    reader = Bucket(url)
    assert reader.versions() == [0, 1] and not reader.is_full(1)  # read, and cached
    assert Bucket(url).delete(1)  # retired elsewhere, then published again as a full version
    again = Trainer(base, seed=4).step()
    assert PolicyPublisher(url, tmp_path / "base", keep_last=None, keyframe_every=1).publish(again).version == 1
    assert reader.versions() == [0, 1]
    assert reader.is_full(1)  # the new index, not the cached one
    materialize_from(reader, tmp_path / "local", 1)
    assert read_local(tmp_path / "local") == raw(again)
    assert reader.delete(1) and reader.versions() == [0]
    assert 1 not in reader._indexes  # bounded by what the bucket lists


# A ``--local-dir`` reused with another store, in an object store: the marker names the bucket, so
# another bucket's version N is never taken for this one's (a directory store: test_policy_materialize).


def _publish_seeded(tmp: Path, store: str, seed: int, steps: int) -> list[dict]:
    """Versions 0..steps (deltas after 0) into ``store``; their bytes depend on ``seed``."""
    base = make_checkpoint(tmp / "base", seed=seed)
    pub = PolicyPublisher(store, tmp / "base", keyframe_every=0, keep_last=None)
    trainer = Trainer(base, seed=seed + 1)
    weights = [trainer.weights()] + [trainer.step() for _ in range(steps)]
    for w in weights:
        pub.publish(w)
    return weights


def test_a_local_dir_reused_with_another_bucket_ends_with_that_buckets_bytes(
    tmp_path: Path, s3_server: s3.S3Server
) -> None:
    a, b = s3_server.url(f"{tmp_path.name}-a"), s3_server.url(f"{tmp_path.name}-b")
    _publish_seeded(tmp_path / "a", a, seed=0, steps=1)
    b_weights = _publish_seeded(tmp_path / "b", b, seed=7, steps=2)
    local = tmp_path / "local"
    materialize_from(open_store(a), local, 1)
    # B's delta 2 must not be applied over A's 1 (it would fail its checksums, and keep failing:
    # the replica would never leave A's weights); B's own chain is followed from its base instead.
    res = materialize_from(open_store(b), local, 2)
    assert res.reseeded and res.version == 2
    assert read_local(local) == raw(b_weights[2])
