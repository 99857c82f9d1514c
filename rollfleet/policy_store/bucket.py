"""Object-store policy stores: the store directory's layout, as keys under a bucket prefix.

``s3://bucket/prefix`` (and ``gs://``, ``az://``; any S3-compatible server through
``AWS_ENDPOINT_URL`` or ``endpoint=``) holds the same ``weight_vNNNNNN/`` directories as a store
directory, one object per file, so a downloaded copy is an ordinary store directory that SGLang's
and miles' readers understand. I/O goes through ``obstore`` (Rust ``object_store``: signing,
retries, multipart); credentials come only from each cloud's usual environment variables and
files, and no error or log line carries the provider's raw message (it can quote keys).

The commit boundary inside a bucket is the index object: a version is listed only once
``weight_vNNNNNN/model.safetensors.index.json`` exists, it is uploaded after every other file of
its directory and with create-only semantics (a second publisher of the same number is refused),
and a version is deleted index first. So a reader never sees a half-written version, and a
publisher that died mid-upload leaves index-less objects that the next push of that number, or
retention, removes. (A store directory may also hold index-less plain checkpoints; a bucket may
not: there the index is what says the upload finished.)

Downloads are parallel ranged reads: each file is cut into segments (``segment_bytes``, 128 MiB),
each segment is one streamed GET of its byte range, written in place with ``pwrite``, and its
progress is journaled every ``STEP_BYTES`` (8 MiB), so a download killed midway resumes where it
stopped, to within a step. Few, long requests: object stores serve a range as cheaply as a
whole object, and every request costs a round trip (some servers, moto among them, even read
the whole object for each range). Content is checked where it is applied
(``materialize`` verifies every tensor against the published checksums), sizes here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rollfleet.policy_store.store import SIDECAR, dir_version, version_dir_name
from rollfleet.runtime import faults
from rollfleet.schemas.errors import (
    CorruptArtifact,
    PolicyError,
    StoreAccessDenied,
    StoreUnavailable,
    UnsupportedStore,
    VersionConflict,
    VersionNotFound,
)
from rollfleet.schemas.index import INDEX_FILE, MAX_INDEX_BYTES, PublicationIndex, check_name

SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")
_URLISH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")
SEGMENT_BYTES = 128 << 20  # one ranged, streamed GET
STEP_BYTES = 8 << 20  # progress journaled this often within a segment
DEFAULT_CONNECTIONS = 8
PARTIAL_PREFIX = ".partial-"
_JOURNAL = ".progress"


def is_store_url(store: str | os.PathLike[str]) -> bool:
    """Whether ``store`` names an object store rather than a directory.

    ``Path("s3://b/p")`` collapses to ``s3:/b/p``; that form counts as a URL too, so a path object
    made from a URL is refused or served, never written as a local folder named ``s3:``.
    """
    return _URLISH.match(os.fspath(store)) is not None


def check_store(store: str | os.PathLike[str]) -> str | Path:
    """A directory path, or a URL whose scheme rollfleet serves; anything else is refused in one line."""
    text = os.fspath(store)
    m = _URLISH.match(text)
    if m is None:
        return Path(text)
    scheme = m.group(1).lower()
    if scheme == "file":  # file:///abs/path is a directory
        return Path(urlparse(text).path)
    if scheme not in SCHEMES:
        raise UnsupportedStore(
            f"cannot serve a policy store at {text!r}: give a directory, or an s3://, gs:// or az:// URL"
        )
    if "://" not in text:  # s3:/bucket/prefix: a URL that went through pathlib
        text = text.replace(":/", "://", 1)
    return text


def _error(exc: BaseException, where: str) -> PolicyError:
    """Our typed error for an obstore exception, without its text (which may quote credentials)."""
    from obstore.exceptions import (
        AlreadyExistsError,
        NotFoundError,
        PermissionDeniedError,
        PreconditionError,
        UnauthenticatedError,
    )

    status = re.search(r"status code: (\d{3})", str(exc))
    code = re.search(r"<Code>([A-Za-z]{1,64})</Code>", str(exc))
    said = " ".join(x for x in (status.group(1) if status else "", code.group(1) if code else "") if x)
    said = f" ({said})" if said else ""
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or (status and status.group(1) in ("401", "403")):
        return StoreAccessDenied(
            f"{where}: the object store refused the request{said}; check the credentials this process reads "
            "from its environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE, "
            "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, ...)"
        )
    if isinstance(exc, NotFoundError | FileNotFoundError):
        return VersionNotFound(f"{where}: not in the object store{said}")
    if isinstance(exc, AlreadyExistsError | PreconditionError):
        return VersionConflict(f"{where}: already in the object store{said}")
    if code and code.group(1) == "NoSuchBucket":
        return StoreAccessDenied(f"{where}: the bucket does not exist{said}")
    return StoreUnavailable(f"{where}: the object store failed{said}: {type(exc).__name__}")


_SECRET_NAMES = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.IGNORECASE)


def _redact(text: str) -> str:
    """``text`` with the value of every secret-looking environment variable replaced by ``***``."""
    for name, value in os.environ.items():
        if len(value) >= 4 and _SECRET_NAMES.search(name) and value in text:
            text = text.replace(value, "***")
    return text


@dataclass
class DownloadStats:
    """What one version's download read: bytes fetched now, bytes a previous attempt had kept."""

    fetched: int = 0
    resumed: int = 0
    files: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, fetched: int = 0, resumed: int = 0) -> None:
        with self._lock:
            self.fetched += fetched
            self.resumed += resumed


class Bucket:
    """A policy store in an object store: list, read, upload and delete version directories."""

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        options: Mapping[str, Any] | None = None,
        connections: int = DEFAULT_CONNECTIONS,
        segment_bytes: int = SEGMENT_BYTES,
        step_bytes: int = STEP_BYTES,
    ) -> None:
        checked = check_store(url)
        if isinstance(checked, Path):
            raise UnsupportedStore(f"{url!r} is a directory, not an object store URL")
        try:
            from obstore.store import from_url
        except ImportError:  # the optional extra: keep the core install light
            raise UnsupportedStore(
                f"{checked}: object stores need obstore (pip install 'rollfleet[objects]')"
            ) from None
        self.url = checked.rstrip("/")
        self.connections = max(1, connections)
        self.segment_bytes = max(1, segment_bytes)
        self.step_bytes = max(1, step_bytes)
        kwargs: dict[str, Any] = dict(options or {})
        client: dict[str, Any] = {"timeout": "600s"}  # a streamed segment on a slow link takes a while
        endpoint = endpoint or os.environ.get("ROLLFLEET_STORE_ENDPOINT")
        if endpoint:
            kwargs["endpoint"] = endpoint
        # Client options given here replace those read from the environment: carry plain HTTP over.
        plain = os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes")
        if plain or (endpoint or os.environ.get("AWS_ENDPOINT_URL", "")).startswith("http://"):
            client["allow_http"] = True
        try:
            self._store = from_url(self.url, client_options=client, **kwargs)
        except Exception as exc:  # a malformed URL or a missing setting: one clear line
            said = _redact(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:300]
            raise UnsupportedStore(f"cannot open the object store {self.url}: {said}") from None
        self._indexes: dict[int, PublicationIndex] = {}  # immutable once listed

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def _call(self, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self._store, *args, **kwargs)
        except PolicyError:
            raise
        except Exception as exc:
            raise _error(exc, f"{self.url}/{where}" if where else self.url) from None

    # -- listing ----------------------------------------------------------------------------

    def objects(self, version: int | None = None) -> dict[int, dict[str, int]]:
        """Every version directory's top-level files and sizes (published or not); with
        ``version``, that directory's alone (one short listing instead of the whole prefix)."""
        import obstore

        out: dict[int, dict[str, int]] = {}
        prefix = None if version is None else f"{version_dir_name(version)}/"

        def walk(store: Any) -> None:
            for chunk in obstore.list(store, prefix=prefix, chunk_size=1000):
                for meta in chunk:
                    top, _, name = meta["path"].partition("/")
                    v = dir_version(top)
                    if v is None or not name or "/" in name:
                        continue  # not a version directory's top-level file
                    out.setdefault(v, {})[name] = int(meta["size"])

        self._call("", walk)
        return out

    def versions(self) -> list[int]:
        """Published version numbers (those with an index object), ascending."""
        return sorted(v for v, files in self.objects().items() if INDEX_FILE in files)

    def read(self, version: int, name: str, limit: int) -> bytes | None:
        """One small object (index, sidecar), or None if absent; over ``limit`` bytes is corrupt."""
        import obstore

        key = f"{version_dir_name(version)}/{check_name(name, 'file name')}"
        try:
            got = self._call(key, obstore.get, key)
        except VersionNotFound:
            return None
        if int(got.meta["size"]) > limit:  # judged before the body is read
            raise CorruptArtifact(f"{self.url}/{key} is over its {limit} byte limit")
        return bytes(self._call(key, lambda _store: got.bytes()))

    def index(self, version: int) -> PublicationIndex:
        """A published version's index (cached: a published version never changes)."""
        if version not in self._indexes:
            raw = self.read(version, INDEX_FILE, MAX_INDEX_BYTES)
            if raw is None:
                raise VersionNotFound(f"{self.url}/{version_dir_name(version)} is not published")
            index = PublicationIndex.parse(raw, default_version=version)
            if index.metadata.version != version:
                where = f"{self.url}/{version_dir_name(version)}"
                raise CorruptArtifact(f"{where}: index says version {index.metadata.version}")
            self._indexes[version] = index
        return self._indexes[version]

    def is_full(self, version: int) -> bool:
        return not self.index(version).metadata.is_delta

    # -- download ---------------------------------------------------------------------------

    def download(
        self,
        version: int,
        store_dir: Path,
        on_chunk: Callable[[int], None] | None = None,
        listing: Mapping[int, Mapping[str, int]] | None = None,
    ) -> tuple[Path, DownloadStats]:
        """Copy a published version into ``store_dir/weight_vNNNNNN`` (atomically, by one rename).

        Reads the files the version needs (its index, sidecar, the shards its index names and, for
        a full version, the other top-level files of the checkpoint such as its config), in
        streamed ``segment_bytes`` ranges on ``connections`` threads. Work already journaled by an interrupted
        call is kept. ``listing``: ``objects()`` as the caller just read it (one listing per catch-up)."""
        name = version_dir_name(version)
        final = Path(store_dir) / name
        stats = DownloadStats()
        if final.is_dir():
            return final, stats
        listed = (self.objects(version) if listing is None else listing).get(version, {})
        if INDEX_FILE not in listed:
            raise VersionNotFound(f"{self.url}/{name} is not published")
        index = self.index(version)
        wanted = {INDEX_FILE, *index.shards}
        if SIDECAR in listed:
            wanted.add(SIDECAR)
        if not index.metadata.is_delta:
            wanted |= {n for n in listed if not n.startswith(".")}
        sizes: dict[str, int] = {}
        for file in sorted(wanted):
            check_name(file, "file name in the object store")
            if file not in listed:
                raise CorruptArtifact(f"{self.url}/{name}/{file} is missing (the index names it)")
            sizes[file] = listed[file]
        partial = Path(store_dir) / f"{PARTIAL_PREFIX}{name}"
        partial.mkdir(parents=True, exist_ok=True)
        jobs: list[tuple[str, int, int, int]] = []  # file, segment start, resume offset, segment end
        journals: dict[str, _Journal] = {}
        for file, size in sizes.items():
            journal = journals[file] = _Journal(partial / file, size)
            for start in range(0, size, self.segment_bytes):
                end = min(size, start + self.segment_bytes)
                upto = min(max(journal.done.get(start, start), start), end)
                stats.add(resumed=upto - start)
                if upto < end:
                    jobs.append((file, start, upto, end))
        stats.files = len(sizes)

        def fetch(job: tuple[str, int, int, int]) -> None:
            import obstore

            file, start, offset, end = job
            key = f"{name}/{file}"
            got = self._call(key, obstore.get, key, options={"range": (offset, end)})
            stream = got.stream(min_chunk_size=self.step_bytes)
            while offset < end:
                try:
                    data = next(stream)
                except StopIteration:
                    break
                except Exception as exc:
                    raise _error(exc, f"{self.url}/{key}") from None
                journals[file].write(start, offset, memoryview(data)[: end - offset])
                offset += min(len(data), end - offset)
                stats.add(fetched=len(data))
                faults.point("bucket:mid-download")
                if on_chunk is not None:
                    on_chunk(len(data))
            if offset != end:
                raise CorruptArtifact(f"{self.url}/{key}: the range {start}-{end} ended at {offset}")

        try:
            if jobs:
                with ThreadPoolExecutor(min(self.connections, len(jobs)), thread_name_prefix="rf-download") as pool:
                    for _ in pool.map(fetch, jobs):
                        pass
        finally:
            for journal in journals.values():
                journal.close()
        for journal in journals.values():
            journal.finish()
        try:
            os.rename(partial, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # a concurrent download finished first
        return final, stats

    # -- upload and delete ------------------------------------------------------------------

    def upload(self, version_dir: Path) -> int:
        """Upload a complete version directory, index last and create-only; returns bytes sent.

        Index-less objects left under the same number by a publisher that died mid-upload are
        removed first; a published version of the same number is a ``VersionConflict``."""
        import obstore

        version_dir = Path(version_dir)
        version = dir_version(version_dir.name)
        if version is None:
            raise UnsupportedStore(f"{version_dir} is not a version directory")
        present = self.objects(version).get(version, {})
        if INDEX_FILE in present:
            raise VersionConflict(f"{self.url}/{version_dir.name} is already published")
        if present:
            self._delete_keys([f"{version_dir.name}/{n}" for n in present])
        files = sorted(
            e.name
            for e in os.scandir(version_dir)
            if e.is_file(follow_symlinks=True) and not e.name.startswith(".") and e.name != INDEX_FILE
        )
        sent = 0

        def put(file: str, mode: str = "overwrite") -> int:
            path = version_dir / file
            key = f"{version_dir.name}/{file}"
            digest = _md5(path)
            result = self._call(key, obstore.put, key, path, mode=mode)
            etag = (result.get("e_tag") or "").strip('"')
            if re.fullmatch(r"[0-9a-f]{32}", etag) and etag != digest:  # a single-part S3 upload's etag is its MD5
                raise CorruptArtifact(f"{self.url}/{key}: the stored object's MD5 differs from the file's")
            faults.point("bucket:mid-upload")
            return path.stat().st_size

        with ThreadPoolExecutor(min(self.connections, max(1, len(files))), thread_name_prefix="rf-upload") as pool:
            sent = sum(pool.map(put, files))
        return sent + put(INDEX_FILE, "create")

    def delete(self, version: int) -> bool:
        """Unpublish a version (its index first, so readers stop listing it), then its other objects."""
        files = self.objects(version).get(version, {})
        if not files:
            return False
        name = version_dir_name(version)
        if INDEX_FILE in files:
            self._delete_keys([f"{name}/{INDEX_FILE}"])
        self._delete_keys([f"{name}/{n}" for n in files if n != INDEX_FILE])
        self._indexes.pop(version, None)
        return True

    def _delete_keys(self, keys: list[str]) -> None:
        import obstore

        for i in range(0, len(keys), 1000):
            self._call(keys[i], obstore.delete, keys[i : i + 1000])


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Journal:
    """One file being downloaded: bytes written in place, each segment's progress recorded after its write.

    The journal holds ``<segment start> <written up to>`` lines; the last line of a segment wins.
    A process killed mid-step leaves that step unrecorded, so it is fetched again. The file's
    expected size heads the journal: a different size restarts the file."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.done: dict[int, int] = {}
        self._jpath = path.with_name(path.name + _JOURNAL)
        fresh = True
        with contextlib.suppress(OSError, ValueError):
            lines = self._jpath.read_text().splitlines()
            if lines and int(lines[0]) == size and path.stat().st_size == size:
                fresh = False
                for line in lines[1:]:
                    start, _, upto = line.partition(" ")
                    if upto:  # a torn last line is ignored
                        self.done[int(start)] = max(self.done.get(int(start), 0), int(upto))
        if fresh:
            with open(path, "wb") as f:
                f.truncate(size)
            self._jpath.write_text(f"{size}\n")
        self._fd = os.open(path, os.O_RDWR)
        self._jfd = os.open(self._jpath, os.O_WRONLY | os.O_APPEND)
        self._lock = threading.Lock()

    def write(self, segment: int, offset: int, data: memoryview) -> None:
        written = 0
        while written < len(data):
            written += os.pwrite(self._fd, data[written:], offset + written)
        with self._lock:
            os.write(self._jfd, f"{segment} {offset + len(data)}\n".encode())

    def close(self) -> None:
        for fd in (self._fd, self._jfd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def finish(self) -> None:
        if os.stat(self.path).st_size != self.size:
            raise CorruptArtifact(f"{self.path.name}: downloaded size differs from the listed {self.size}")
        self._jpath.unlink(missing_ok=True)
