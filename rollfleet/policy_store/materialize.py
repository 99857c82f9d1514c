"""Replica side: bring a host-local checkpoint to a target version.

The host-local checkpoint is an ordinary HF checkpoint directory (loadable with
``from_pretrained``) plus the applied-version marker ``rollfleet-version.json``. Protocol per
version: check the version's structure against the local layout; remove the marker (fsynced);
apply every tensor in place through mmap with a thread pool, verifying each final-state
checksum; on any failure undo what was applied and put the marker back; on success flush,
fsync and write the marker. A process killed mid-apply therefore leaves no marker, and the
next call reseeds from a full version instead of applying an XOR delta twice.

Reseeding copies a full version into a staging directory, verifies it, and only then moves it
into place, so a bad full version leaves the local checkpoint as it was.

Durability without fsyncing the model: a process crash never loses page-cache writes, so the
protocol above is enough across SIGKILL. Against power loss the marker records the kernel boot id
and the checksum of every local tensor; a marker from an earlier boot is trusted only after every
tensor hashes to its recorded value (a few hundred ms per GiB), otherwise the call reseeds. With
``durable=True`` the data is msync'ed and fsync'ed before each marker instead (and such a marker
is trusted after a reboot without re-hashing).

A marker says which store it came from (a digest of the store's identity: its resolved path, or
the bucket's URL) and, in its checksums, what every local tensor holds. A ``local_dir`` reused
with another store, or with a store re-created by another run, would otherwise pass that store's
version N off as this one's: a marker is trusted only when its store is this store and its
checksums agree with every final-state checksum this store publishes for that version
(``marker_matches``); otherwise the call reseeds from a full version.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rollfleet.policy_store import delta_codecs as codecs
from rollfleet.policy_store.digest import content_digest
from rollfleet.policy_store.files import check_file
from rollfleet.policy_store.formats import CHECKSUM_FORMATS, DEFAULT_CHECKSUM, new_hasher
from rollfleet.policy_store.hooks import Hook, resolve_hook
from rollfleet.policy_store.layout import CheckpointLayout, TensorLocation, check_layout, fsync_dir
from rollfleet.policy_store.store import SIDECAR, list_versions, read_index, version_path
from rollfleet.policy_store.verify import OpenVersion, check_delta_against, open_version
from rollfleet.runtime import faults
from rollfleet.schemas.bounded_json import load_json
from rollfleet.schemas.errors import (
    ChecksumMismatch,
    CorruptArtifact,
    InvalidRequest,
    LineageMismatch,
    PolicyError,
    VersionNotFound,
)
from rollfleet.schemas.index import INDEX_FILE, check_name

MARKER = "rollfleet-version.json"
LOCK = ".rollfleet.lock"
STAGING = ".rollfleet-staging"
DEFAULT_WORKERS = max(1, min(8, os.cpu_count() or 1))


@dataclass
class MaterializeResult:
    version: int  # the version the local checkpoint now holds
    previous_version: int | None  # the marker before the call (None: missing)
    changed: list[str]  # tensors whose bytes may differ from before: reload only these
    applied: list[int] = field(default_factory=list)  # versions applied, in order (a seed included)
    reseeded: bool = False
    seeded_from: int | None = None
    wire_bytes: int = 0  # bytes of version files read
    changed_bytes: int = 0  # as recorded by the publisher, where known
    total_bytes: int = 0
    density: float = 0.0  # changed_bytes / total_bytes (over every version applied), capped at 1
    seconds: float = 0.0
    # "fmt:hex" of every tensor the local checkpoint now holds (as its marker records them): what
    # a replica compares with what its engine holds to know which tensors to reload.
    checksums: dict[str, str] = field(default_factory=dict)
    # From an object store: bytes downloaded by this call, and bytes an interrupted earlier one kept.
    fetched_bytes: int = 0
    resumed_bytes: int = 0


# -- marker and lock ---------------------------------------------------------------------------


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""  # unknown: every marker is then verified by hashing


def _read_marker_doc(local_dir: Path) -> dict | None:
    try:
        doc = load_json((Path(local_dir) / MARKER).read_bytes(), what="local marker", max_bytes=16 * 1024**2)
    except (OSError, InvalidRequest):  # unreadable, or not a marker of ours: no version held
        return None
    v = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        return None
    return doc  # type: ignore[no-any-return]


def read_marker(local_dir: Path) -> int | None:
    """The applied version of a host-local checkpoint, or None when missing or unreadable."""
    doc = _read_marker_doc(Path(local_dir))
    return None if doc is None else int(doc["version"])


def store_identity(store: str) -> str:
    """What a marker records of the store it came from: a digest (an address may carry secrets)."""
    return hashlib.sha256(store.encode()).hexdigest()[:32]


def marker_matches(
    recorded_store: object, recorded_sums: Mapping[str, str], store: str, published: Mapping[str, str] | None
) -> bool:
    """Whether a local checkpoint whose marker records ``recorded_store`` (see ``store_identity``)
    and ``recorded_sums`` ("fmt:hex" per tensor) holds this store's version of its number.

    ``published``: the final-state checksums ("fmt:hex") the store gives for that version (a
    delta's changed tensors, a full version's every tensor); None when the store cannot say (the
    version was retired, or is unreadable now): then the store's identity alone decides."""
    if recorded_store != store_identity(store):
        return False  # another store's (or an older rollfleet's) version N is not this store's N
    return published is None or all(recorded_sums.get(name) == digest for name, digest in published.items())


def published_checksums(store: Path, version: int) -> dict[str, str] | None:
    """The final-state checksums ("fmt:hex") ``store`` publishes for ``version``; None when it has
    none to give (not in the store, unreadable, or a plain full version without checksums)."""
    try:
        ov = open_version(version_path(store, version), expected_version=version)
    except PolicyError:
        return None
    fmt = ov.index.metadata.checksum_format or DEFAULT_CHECKSUM
    sums = {n: f.checksum for n, f in ov.frames.items()} if ov.is_delta else ov.checksums
    return {name: f"{fmt}:{digest}" for name, digest in sums.items()} or None


def store_content_digest(store: Path, version: int) -> bytes:
    """``version``'s content digest (``digest.content_digest``) read from ``store`` alone: the
    final-state checksums of the full version its chain starts from, overlaid with each delta's
    after it, as materializing the chain would record them (a full version without published
    checksums is hashed from its files). Raises ``PolicyError`` (``VersionNotFound``) where the
    store cannot give them: what a replay compares a coordinate's digest with."""
    seed, deltas = plan(Path(store), None, version)
    if seed is None:  # (plan without a marker always seeds)
        raise VersionNotFound(f"no full version under {version} in {store}")
    ov = open_version(version_path(Path(store), seed), expected_version=seed)
    sums = _full_sums(ov, ov.layout, DEFAULT_WORKERS)
    for v in deltas:
        sums.update(published_checksums(Path(store), v) or {})
    return content_digest(sums)


class _Local:
    """The host-local checkpoint: where it is, how durably to write, what each tensor's checksum is."""

    def __init__(self, root: Path, durable: bool, workers: int, store: str = "") -> None:
        self.root = root
        self.durable = durable
        self.workers = workers
        self.store = store  # the identity of the store its versions come from
        self.sums: dict[str, str] = {}  # tensor name -> "fmt:hex" of its current local bytes

    def write_marker(self, version: int) -> None:
        doc = {
            "version": version,
            "store": store_identity(self.store),
            "boot_id": _boot_id(),
            "durable": self.durable,
            "checksums": self.sums,
            "written_at": time.time(),
        }
        tmp = self.root / f".{MARKER}.tmp"
        with open(tmp, "wb") as f:
            f.write(json.dumps(doc).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / MARKER)
        fsync_dir(self.root)

    def remove_marker(self) -> None:
        try:
            os.unlink(self.root / MARKER)
        except FileNotFoundError:
            return
        fsync_dir(self.root)

    def adopt_marker(self, store: Path, hook: Hook | None = None) -> int | None:
        """The marker's version if it can be trusted as ``store``'s (loading its checksums), else None;
        ``hook``: the pre-read hook, run before that version's directory in the store is read."""
        doc = _read_marker_doc(self.root)
        if doc is None:
            return None
        try:
            layout = CheckpointLayout.read(self.root)
        except PolicyError:
            return None  # a marker without a loadable checkpoint beside it
        sums = doc.get("checksums")
        if not isinstance(sums, dict) or set(sums) != set(layout.tensors):
            return None
        recorded = {str(k): str(v) for k, v in sums.items()}
        path = version_path(store, int(doc["version"]))
        if hook is not None and path.is_dir():
            hook(path)
        if not marker_matches(doc.get("store"), recorded, self.store, published_checksums(store, int(doc["version"]))):
            return None
        self.sums = recorded
        if doc.get("boot_id") == _boot_id() != "" or doc.get("durable") is True:
            return int(doc["version"])
        # Written before a reboot without fsync: trust it only if every tensor still matches.
        if self.verify(layout):
            self.write_marker(int(doc["version"]))  # with the current boot id
            return int(doc["version"])
        return None

    def verify(self, layout: CheckpointLayout) -> bool:
        def one(name: str) -> None:
            fmt, _, want = self.sums[name].partition(":")
            if fmt not in CHECKSUM_FORMATS or _hash_file_range(layout.tensors[name], fmt) != want:
                raise ChecksumMismatch(name)

        return _run_all(one, list(layout.tensors), self.workers) is None

    def flush(self, mapped: _Mapped) -> None:
        if self.durable:
            mapped.flush()


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


@contextmanager
def host_lock(local_dir: Path) -> Iterator[None]:
    """Exclusive across threads (a lock per path) and processes (flock on a lock file)."""
    key = os.path.realpath(local_dir)
    with _THREAD_LOCKS_GUARD:
        tlock = _THREAD_LOCKS.setdefault(key, threading.Lock())
    with tlock:
        fd = _open_lock(Path(local_dir) / LOCK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


def _open_lock(path: Path) -> int:
    """The lock file, opened for flock. On a disk that refuses writes (remounted read-only after
    I/O errors, or a directory made read-only) an existing one is opened read-only, which flock
    accepts: a checkpoint already there at the version asked for is still read and served, and
    anything that needs a write fails later, at that write, typed (``LocalDiskError``)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not path.is_file():
            raise
        return os.open(path, os.O_RDONLY)


# -- planning ----------------------------------------------------------------------------------


def plan(
    store: Path, marker: int | None, target: int, present: list[int] | None = None
) -> tuple[int | None, list[int]]:
    """(version to seed from or None, versions to apply after it) to reach ``target`` from ``store``."""
    have = list_versions(store) if present is None else present
    return plan_chain(have, marker, target, lambda v: not read_index(version_path(store, v)).metadata.is_delta, store)


def plan_chain(
    present: Iterable[int], marker: int | None, target: int, is_full: Callable[[int], bool], where: object
) -> tuple[int | None, list[int]]:
    """(version to seed from or None, versions to apply after it) to reach ``target``.

    Continue from the marker when every version after it is present; otherwise seed from the
    newest full version at or below the target from which the chain is complete. ``is_full``
    reads a version's index (a PolicyError: unreadable, never a seed); the same plan serves a
    store directory and an object store.
    """
    have = set(present)
    if target not in have:
        raise VersionNotFound(f"version {target} is not in {where}")
    if marker is not None and marker <= target and all(v in have for v in range(marker + 1, target + 1)):
        # A full version on the way makes every delta before it moot (and routes around a
        # corrupt one): continue from the newest full version instead.
        start = marker + 1
        for v in range(target, marker, -1):
            try:
                if is_full(v):
                    start = v
                    break
            except PolicyError:
                continue
        return None, list(range(start, target + 1))
    for v in sorted((x for x in have if x <= target), reverse=True):
        if not all(x in have for x in range(v + 1, target + 1)):
            break  # an older seed would need the same missing versions
        try:
            if is_full(v):
                return v, list(range(v + 1, target + 1))
        except PolicyError:
            continue
    raise VersionNotFound(f"no full version at or below {target} with a complete chain in {where}")


# -- materialize -------------------------------------------------------------------------------


def materialize(
    local_dir: Path | str,
    store_dir: Path | str,
    target_version: int,
    *,
    pre_read_hook: str | Hook | None = None,
    workers: int = DEFAULT_WORKERS,
    durable: bool = False,
    store_id: str | None = None,
) -> MaterializeResult:
    """Bring ``local_dir`` to ``target_version`` from ``store_dir``; thread- and process-safe.

    ``durable=True`` fsyncs the model data before every marker (see the module docstring for why
    the default does not need to). ``store_id``: the identity of the store the versions come from
    (default: ``store_dir``'s resolved path; a bucket's URL when ``store_dir`` is its download cache).

    Raises a typed PolicyError on any inconsistency; the local checkpoint then stays at its last
    good version (the marker says which), or has no marker if it had none to begin with.
    """
    t0 = time.perf_counter()
    local = Path(local_dir)
    store = Path(store_dir)
    local.mkdir(parents=True, exist_ok=True)
    hook = resolve_hook(pre_read_hook)
    state = _Local(local, durable, workers, store_id if store_id is not None else str(store.resolve()))
    with host_lock(local):
        previous = read_marker(local)
        if hook is not None:
            hook(store)
        marker = state.adopt_marker(store, hook)
        seed, chain = plan(store, marker, target_version)
        result = MaterializeResult(version=marker if marker is not None else -1, previous_version=previous, changed=[])
        changed: set[str] = set()
        if seed is not None:
            names, wire, total = _seed(state, version_path(store, seed), seed, hook)
            result.reseeded, result.seeded_from = True, seed
            result.applied.append(seed)
            result.wire_bytes += wire
            result.total_bytes = total
            result.version = seed
            changed.update(names)
        layout = CheckpointLayout.read(local)
        result.total_bytes = layout.total_bytes
        for v in chain:
            changed.update(_apply_version(state, layout, version_path(store, v), v, hook, result))
        order = {n: i for i, n in enumerate(layout.tensors)}
        result.changed = sorted(changed, key=lambda n: order.get(n, 0))
        if result.total_bytes:
            result.density = min(1.0, result.changed_bytes / result.total_bytes)
        result.checksums = dict(state.sums)
        result.seconds = time.perf_counter() - t0
        return result


def _apply_version(
    state: _Local, layout: CheckpointLayout, path: Path, v: int, hook: Hook | None, result: MaterializeResult
) -> list[str]:
    """Apply version ``v`` (a delta onto ``result.version``, its base, or a full version) to the
    local checkpoint, counting it in ``result``; the names of the tensors it changed."""
    if hook is not None:
        hook(path)
    ov = open_version(path, expected_version=v)
    if ov.is_delta:
        if ov.index.metadata.base_version != result.version:
            raise LineageMismatch(
                f"{path.name} is based on {ov.index.metadata.base_version}, the local checkpoint is at {result.version}"
            )
        names = _apply_delta(state, layout, ov, result.version)
    else:
        names = _apply_full(state, layout, ov)
    result.changed_bytes += ov.record().changed_bytes
    result.wire_bytes += ov.wire_bytes
    result.applied.append(v)
    result.version = v
    return names


# -- apply a delta in place --------------------------------------------------------------------


class _Mapped:
    """Writable memory maps of the local shards, opened once per version."""

    def __init__(self) -> None:
        self.maps: dict[Path, np.memmap] = {}

    def view(self, loc: TensorLocation) -> np.ndarray:
        mm = self.maps.get(loc.file)
        if mm is None:
            mm = self.maps[loc.file] = np.memmap(loc.file, dtype=np.uint8, mode="r+")
        return mm[loc.offset : loc.offset + loc.nbytes]

    def flush(self) -> None:
        for path, mm in self.maps.items():
            mm.flush()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.maps.clear()


def _apply_delta(local: _Local, layout: CheckpointLayout, ov: OpenVersion, current: int) -> list[str]:
    check_delta_against(ov, layout.specs)
    meta = ov.index.metadata
    enc, fmt = meta.delta_encoding or "", meta.checksum_format or DEFAULT_CHECKSUM
    names = sorted(ov.frames, key=lambda n: -layout.tensors[n].nbytes)  # big first: better packing
    if not names:
        local.write_marker(ov.version)  # an empty delta is valid
        return []
    local.remove_marker()
    mapped = _Mapped()
    dsts = {n: mapped.view(layout.tensors[n]) for n in names}  # map every file before threads start
    undos: dict[str, codecs.Undo] = {}
    lock = threading.Lock()
    first_done = threading.Event()

    def one(name: str) -> None:
        loc, frame = layout.tensors[name], ov.frames[name]
        dst = dsts[name]
        hasher = new_hasher(fmt)
        undo = codecs.apply(enc, dst, frame.view(), loc.spec.itemsize, hasher, name)
        digest = hasher.hexdigest()
        if digest != frame.checksum:
            undo()
            raise ChecksumMismatch(f"{ov.path.name}: {name!r} final state is {digest}, published {frame.checksum}")
        with lock:
            undos[name] = undo
        if not first_done.is_set():
            first_done.set()
            faults.point("apply:mid-version")

    try:
        error = _run_all(one, names, local.workers)
        if error is not None:
            for undo in undos.values():
                undo()
            local.flush(mapped)
            local.write_marker(current)  # back at the last good version
            raise error
        local.flush(mapped)
        faults.point("apply:before-marker")
        for name in names:
            local.sums[name] = f"{fmt}:{ov.frames[name].checksum}"
        local.write_marker(ov.version)
    finally:
        undos.clear()
        dsts.clear()
        mapped.close()
    return names


def _run_all(fn: Callable[[str], None], names: list[str], workers: int) -> BaseException | None:
    """Run ``fn`` over names on a pool; stop starting new work after the first failure."""
    failed: list[BaseException] = []
    stop = threading.Event()

    def guarded(name: str) -> None:
        if stop.is_set():
            return
        try:
            fn(name)
        except BaseException as exc:
            stop.set()
            failed.append(exc)

    if workers <= 1 or len(names) == 1:
        for name in names:
            guarded(name)
    else:
        list(codecs.executor(workers).map(guarded, names))
    typed = [e for e in failed if isinstance(e, PolicyError)]
    return (typed or failed or [None])[0]


# -- full versions -----------------------------------------------------------------------------


def _hash_file_range(loc: TensorLocation, fmt: str) -> str:
    hasher = new_hasher(fmt)
    if loc.nbytes == 0:
        hasher.update(b"")
        return hasher.hexdigest()
    mm = np.memmap(loc.file, dtype=np.uint8, mode="r", offset=loc.offset, shape=(loc.nbytes,))
    for s in range(0, loc.nbytes, codecs.CHUNK):
        hasher.update(mm[s : s + codecs.CHUNK])
    return hasher.hexdigest()


def _verify_full(ov: OpenVersion, layout: CheckpointLayout, workers: int) -> None:
    if not ov.checksums:
        return  # a foreign full version without checksums: structure only
    fmt = ov.index.metadata.checksum_format or DEFAULT_CHECKSUM

    def one(name: str) -> None:
        digest = _hash_file_range(layout.tensors[name], fmt)
        if digest != ov.checksums[name]:
            raise ChecksumMismatch(f"{ov.path.name}: {name!r} is {digest}, its checksum says {ov.checksums[name]}")

    error = _run_all(one, list(layout.tensors), workers)
    if error is not None:
        raise error


def _apply_full(local: _Local, layout: CheckpointLayout, ov: OpenVersion) -> list[str]:
    """Apply a full version met inside a chain: copy only tensors whose bytes differ."""
    assert ov.layout is not None
    check_layout(layout.specs, ov.layout.specs, ov.path.name)
    fmt = ov.index.metadata.checksum_format or DEFAULT_CHECKSUM
    differing: list[str] = []
    lock = threading.Lock()

    def compare(name: str) -> None:
        src, dst = ov.layout.tensors[name], layout.tensors[name]  # type: ignore[union-attr]
        if ov.checksums:
            same = _hash_file_range(dst, fmt) == ov.checksums[name]
        else:
            same = bool(np.array_equal(_ro(src), _ro(dst)))
        if not same:
            with lock:
                differing.append(name)

    error = _run_all(compare, list(layout.tensors), local.workers)
    if error is None and ov.checksums:  # verify the sources we will copy, before writing anything
        sub = CheckpointLayout(ov.path, {n: ov.layout.tensors[n] for n in differing}, ov.layout.files)
        try:
            _verify_full(OpenVersion(ov.path, ov.index, layout=sub, checksums=ov.checksums), sub, local.workers)
        except PolicyError as exc:
            error = exc
    if error is not None:
        raise error
    local.remove_marker()
    mapped = _Mapped()
    try:
        for name in differing:
            np.copyto(mapped.view(layout.tensors[name]), _ro(ov.layout.tensors[name]))
        local.flush(mapped)
    finally:
        mapped.close()
    local.sums = _full_sums(ov, layout, local.workers)
    local.write_marker(ov.version)
    return differing


def checkpoint_checksums(
    layout: CheckpointLayout, fmt: str = DEFAULT_CHECKSUM, workers: int = DEFAULT_WORKERS
) -> dict[str, str]:
    """Every tensor's checksum, hashed from the checkpoint's files (nothing is loaded whole)."""
    names = list(layout.tensors)
    hashes = codecs.executor(workers).map(lambda n: _hash_file_range(layout.tensors[n], fmt), names)
    return dict(zip(names, hashes, strict=True))


def _full_sums(ov: OpenVersion, layout: CheckpointLayout, workers: int) -> dict[str, str]:
    """Checksums of a full version's tensors: published ones, or computed from ``layout``'s bytes."""
    if ov.checksums:
        fmt = ov.index.metadata.checksum_format or DEFAULT_CHECKSUM
        return {n: f"{fmt}:{h}" for n, h in ov.checksums.items()}
    return {n: f"{DEFAULT_CHECKSUM}:{h}" for n, h in checkpoint_checksums(layout, DEFAULT_CHECKSUM, workers).items()}


def _ro(loc: TensorLocation) -> np.ndarray:
    if loc.nbytes == 0:
        return np.empty(0, np.uint8)
    return np.memmap(loc.file, dtype=np.uint8, mode="r", offset=loc.offset, shape=(loc.nbytes,))


def _seed(state: _Local, src: Path, version: int, hook: Hook | None) -> tuple[list[str], int, int]:
    """Replace the local checkpoint with full version ``version``: stage, verify, swap, mark."""
    if hook is not None:
        hook(src)
    ov = open_version(src, expected_version=version)
    if ov.is_delta:
        raise CorruptArtifact(f"{src.name} is a delta, not a full version to seed from")
    local = state.root
    staging = local / STAGING
    # A leftover of an interrupted seed is removed, and a failure to remove it is the error raised
    # (a read-only disk, say): ignored, it came back as "File exists" from the mkdir below.
    try:
        shutil.rmtree(staging)
    except FileNotFoundError:
        pass
    staging.mkdir()
    wire = 0
    files = []
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == SIDECAR or entry.is_dir(follow_symlinks=False):
            continue  # subdirectories (e.g. original/) are not part of the checkpoint
        check_name(entry.name, "checkpoint file name")
        check_file(Path(entry.path), src.parent)  # no FIFO, device or symlink out of the store
        shutil.copyfile(entry.path, staging / entry.name)
        if state.durable:
            with open(staging / entry.name, "rb+") as f:
                os.fsync(f.fileno())
        wire += entry.stat().st_size
        files.append(entry.name)
        faults.point("seed:mid-copy")
    try:
        staged = CheckpointLayout.read(staging)
        _verify_full(ov, staged, state.workers)
        sums = _full_sums(ov, staged, state.workers)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # Commit: from here the old local files are replaced; no marker until it is all in place.
    state.remove_marker()
    keep = set(files)
    for entry in os.scandir(local):
        if entry.name not in keep and (entry.name.endswith(".safetensors") or entry.name == INDEX_FILE):
            os.unlink(entry.path)
    for name in files:
        os.replace(staging / name, local / name)
    fsync_dir(local)
    shutil.rmtree(staging, ignore_errors=True)
    state.sums = sums
    state.write_marker(version)
    return list(staged.tensors), wire, staged.total_bytes
