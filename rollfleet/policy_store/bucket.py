"""Object-store policy stores: the store directory's layout, as keys under a bucket prefix.

``s3://bucket/prefix`` (and ``gs://``, ``az://``; any S3-compatible server through
``AWS_ENDPOINT_URL`` or ``endpoint=``) holds the same ``weight_vNNNNNN/`` directories as a store
directory, one object per file (under its upload's own prefix, below), so a downloaded copy is an
ordinary store directory that SGLang's and miles' readers understand. I/O goes through
``obstore`` (Rust ``object_store``: signing, retries, multipart); credentials come only from
each cloud's usual environment variables and files (a URL carrying some is refused), and no
error or log line carries the provider's raw message (it can quote keys).

The commit boundary inside a bucket is the index object: a version is listed only once
``weight_vNNNNNN/model.safetensors.index.json`` exists, it is uploaded after every other file of
its directory and with create-only semantics (a second publisher of the same number is refused),
and a version is deleted index first. So a reader never sees a half-written version. (A store
directory may also hold index-less plain checkpoints; a bucket may not: there the index is what
says the upload finished.)

A published version never changes: each upload writes its files under a prefix of its own,
``weight_vNNNNNN/.upload-<nonce>/<file>``, and the index pins every one of them (where it is, its
size, a blake3 of its bytes: ``metadata.rollfleet_objects``). Two publishers racing for a number
never write or delete each other's objects: the refused one deletes its own prefix, and nothing
it wrote is named by the winner's index. Readers verify each file against its pin before using
it, so an object written later under a published version cannot change what that version is. A
publisher that died mid-upload leaves a prefix no index names: retention removes it with its
version (or at once, below the newest version, if no index came).

Downloads are parallel ranged reads: each file is cut into segments (``segment_bytes``, 128 MiB),
each segment is one streamed GET of its byte range, written in place with ``pwrite``, and its
progress is journaled every ``STEP_BYTES`` (8 MiB), so a download killed midway resumes where it
stopped, to within a step (``bucket_download.py``). Few, long requests: object stores serve a
range as cheaply as a whole object, and every request costs a round trip (some servers, moto
among them, even read the whole object for each range). Each downloaded file is checked here against its pin (size,
blake3) before the version is handed on, and every tensor again where it is applied
(``materialize`` verifies them against the published checksums).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from rollfleet.policy_store.bucket_download import (
    DownloadStats,
    Segment,
    SegmentJournal,
    fetch_segments,
    open_segments,
    rename_into_place,
)
from rollfleet.policy_store.formats import new_hasher, valid_checksum
from rollfleet.policy_store.store import dir_version, version_dir_name
from rollfleet.runtime import faults
from rollfleet.runtime.backoff import TRANSIENT_RETRY
from rollfleet.runtime.secrets import has_secrets, redact_url, redact_urls
from rollfleet.schemas.errors import (
    ChecksumMismatch,
    CorruptArtifact,
    PolicyError,
    StoreAccessDenied,
    StoreUnavailable,
    UnsupportedStore,
    VersionConflict,
    VersionNotFound,
)
from rollfleet.schemas.index import INDEX_FILE, MAX_INDEX_BYTES, PublicationIndex, check_name, json_object

SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")
_URLISH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")
SEGMENT_BYTES = 128 << 20  # one ranged, streamed GET
STEP_BYTES = 8 << 20  # progress journaled this often within a segment
DEFAULT_CONNECTIONS = 8
T = TypeVar("T")
READ_PATIENCE_S = 15.0  # an idempotent read whose link keeps failing is asked again for this long
PARTIAL_PREFIX = ".partial-"
OBJECTS_KEY = "rollfleet_objects"  # in a bucket index's metadata: the objects the version is made of
UPLOAD_PREFIX = ".upload-"
PIN_FORMAT = "blake3"  # cryptographic: no second publisher can make other bytes with the same pin
_UPLOAD_DIR = re.compile(r"^\.upload-[0-9a-f]{16,64}$")


@dataclass(frozen=True)
class Pin:
    """One file of a published version: the object holding it and what its bytes must be."""

    key: str  # relative to the version directory: <upload prefix>/<file>
    size: int
    checksum: str  # PIN_FORMAT hex of the object's bytes


def pin_objects(prefix: str, files: Mapping[str, tuple[int, str]]) -> dict[str, Any]:
    """The index's ``rollfleet_objects`` entry for files uploaded under ``prefix`` ({name: (size, checksum)})."""
    return {
        "prefix": prefix,
        "checksum_format": PIN_FORMAT,
        "files": {name: {"size": size, "checksum": sum_} for name, (size, sum_) in sorted(files.items())},
    }


def pinned_files(index: PublicationIndex, where: str) -> dict[str, Pin]:
    """Every file a bucket index pins, by name, checked: a bucket version is only what its index pins.

    An index without pins (another tool's upload, or an older rollfleet's) is ``CorruptArtifact``:
    nothing would say which bytes are the version's."""
    doc = index.metadata.extra.get(OBJECTS_KEY)
    if not isinstance(doc, dict):
        raise CorruptArtifact(f"{where}: the index pins no objects ({OBJECTS_KEY}); republish the version")
    prefix, fmt, files = doc.get("prefix"), doc.get("checksum_format"), doc.get("files")
    if not isinstance(prefix, str) or not _UPLOAD_DIR.match(prefix):
        raise CorruptArtifact(f"{where}: {OBJECTS_KEY}.prefix is not an upload prefix: {str(prefix)[:80]!r}")
    if fmt != PIN_FORMAT or not isinstance(files, dict):
        raise CorruptArtifact(f"{where}: {OBJECTS_KEY} must pin files with {PIN_FORMAT} checksums")
    out: dict[str, Pin] = {}
    for name, pin in files.items():
        check_name(name, "file name in the index's pins")
        size = pin.get("size") if isinstance(pin, dict) else None
        checksum = pin.get("checksum") if isinstance(pin, dict) else None
        if name == INDEX_FILE or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CorruptArtifact(f"{where}: the pin of {name!r} is malformed")
        if not valid_checksum(PIN_FORMAT, checksum):
            raise CorruptArtifact(f"{where}: the pin of {name!r} has no {PIN_FORMAT} checksum")
        out[name] = Pin(f"{prefix}/{name}", size, str(checksum).lower())
    missing = sorted(set(index.shards) - set(out))
    if missing:
        raise CorruptArtifact(f"{where}: the index names {missing[0]!r} but pins no object for it")
    return out


@dataclass(frozen=True)
class _Indexed:
    raw: bytes
    index: PublicationIndex
    tag: str | None  # the index object's e_tag when read: a listing with another one means it was replaced


def is_store_url(store: str | os.PathLike[str]) -> bool:
    """Whether ``store`` names an object store rather than a directory.

    ``Path("s3://b/p")`` collapses to ``s3:/b/p``; that form counts as a URL too, so a path object
    made from a URL is refused or served, never written as a local folder named ``s3:``.
    """
    return _URLISH.match(os.fspath(store)) is not None


def check_store(store: str | os.PathLike[str]) -> str | Path:
    """A directory path, or a URL whose scheme rollfleet serves; anything else is refused in one line.

    A URL that carries credentials (``s3://KEY:SECRET@bucket/p``, a signed query) is refused too,
    naming it redacted: credentials live in the environment or ``store_options``, so no URL that
    logs, errors and the registry print can hold one."""
    text = os.fspath(store)
    m = _URLISH.match(text)
    if m is None:
        return Path(text)
    if "://" not in text:  # s3:/bucket/prefix: a URL that went through pathlib
        text = text.replace(":/", "://", 1)
    if has_secrets(text):
        raise UnsupportedStore(
            f"{redact_url(text)}: a store URL must not carry credentials; give them in the environment "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, "
            "...) or in store_options"
        )
    scheme = m.group(1).lower()
    if scheme == "file":  # file:///abs/path is a directory
        return Path(urlparse(text).path)
    if scheme not in SCHEMES:
        raise UnsupportedStore(
            f"cannot serve a policy store at {os.fspath(store)!r}: give a directory, or an s3://, gs:// or az:// URL"
        )
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
            said = redact_urls(_redact(str(exc).splitlines()[0] if str(exc) else type(exc).__name__))[:300]
            raise UnsupportedStore(f"cannot open the object store {self.url}: {said}") from None
        # Indexes read, revalidated by every listing (a version deleted and published again under
        # the same number is another version) and dropped once unlisted: bounded by the bucket.
        self._indexes: dict[int, _Indexed] = {}

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    def _patiently(self, read: Callable[[], T]) -> T:
        """An idempotent read (a listing, a small object) asked again, whole, while the store is
        unreachable, for up to READ_PATIENCE_S: obstore asks a request again for only about 2 s of
        reset connections, and a replica catching up through a flaky link would fail its try.
        (Ranged downloads resume on their own; writes are never asked again blindly.)"""
        until = time.monotonic() + READ_PATIENCE_S
        for attempt in itertools.count():
            try:
                return read()
            except StoreUnavailable:
                if time.monotonic() >= until:
                    raise
                time.sleep(TRANSIENT_RETRY.delay_s(attempt))
        raise AssertionError("unreachable")  # (itertools.count never ends)

    def _call(self, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self._store, *args, **kwargs)
        except PolicyError:
            raise
        except Exception as exc:
            raise _error(exc, f"{self.url}/{where}" if where else self.url) from None

    # -- listing ----------------------------------------------------------------------------

    def objects(self, version: int | None = None) -> dict[int, dict[str, int]]:
        """Every version directory's objects and sizes (published or not), by key relative to the
        directory (``.upload-<nonce>/<file>``, the index); with ``version``, that directory's
        alone (one short listing instead of the whole prefix). Cached indexes are revalidated."""
        import obstore

        out: dict[int, dict[str, int]] = {}
        tags: dict[int, str | None] = {}
        prefix = None if version is None else f"{version_dir_name(version)}/"

        def walk(store: Any) -> None:
            for chunk in obstore.list(store, prefix=prefix, chunk_size=1000):
                for meta in chunk:
                    top, _, name = meta["path"].partition("/")
                    v = dir_version(top)
                    if v is None or not name or name.count("/") > 1:
                        continue  # not a version directory's file
                    out.setdefault(v, {})[name] = int(meta["size"])
                    if name == INDEX_FILE:
                        tags[v] = _tag(meta)

        def listing() -> None:
            out.clear()
            tags.clear()
            self._call("", walk)

        self._patiently(listing)
        for v in [v for v in self._indexes if version is None or v == version]:
            if v not in tags or tags[v] is None or tags[v] != self._indexes[v].tag:
                del self._indexes[v]  # unpublished, or replaced by another publication of the number
        return out

    def versions(self) -> list[int]:
        """Published version numbers (those with an index object), ascending."""
        return sorted(v for v, files in self.objects().items() if INDEX_FILE in files)

    def read(self, version: int, name: str, limit: int) -> tuple[bytes, str | None] | None:
        """One small object (the index) and its e_tag, or None if absent; over ``limit`` bytes is corrupt."""
        import obstore

        key = f"{version_dir_name(version)}/{check_name(name, 'file name')}"

        def get() -> tuple[bytes, str | None] | None:
            try:
                got = self._call(key, obstore.get, key)
            except VersionNotFound:
                return None
            if int(got.meta["size"]) > limit:  # judged before the body is read
                raise CorruptArtifact(f"{self.url}/{key} is over its {limit} byte limit")
            return bytes(self._call(key, lambda _store: got.bytes())), _tag(got.meta)

        return self._patiently(get)

    def _indexed(self, version: int) -> _Indexed:
        if version not in self._indexes:
            got = self.read(version, INDEX_FILE, MAX_INDEX_BYTES)
            where = f"{self.url}/{version_dir_name(version)}"
            if got is None:
                raise VersionNotFound(f"{where} is not published")
            index = PublicationIndex.parse(got[0], default_version=version)
            if index.metadata.version != version:
                raise CorruptArtifact(f"{where}: index says version {index.metadata.version}")
            self._indexes[version] = _Indexed(got[0], index, got[1])
        return self._indexes[version]

    def index(self, version: int) -> PublicationIndex:
        """A published version's index (cached until a listing shows it replaced or gone)."""
        return self._indexed(version).index

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
        listed = (self.objects(version) if listing is None else listing).get(version, {})
        if INDEX_FILE not in listed:
            raise VersionNotFound(f"{self.url}/{name} is not published")
        indexed = self._indexed(version)
        if final.is_dir():
            if _read_or_none(final / INDEX_FILE) == indexed.raw:
                return final, stats
            shutil.rmtree(final)  # a copy of another publication of this number
        pins = pinned_files(indexed.index, f"{self.url}/{name}")
        _check_listed(f"{self.url}/{name}", pins, listed)
        partial = Path(store_dir) / f"{PARTIAL_PREFIX}{name}"
        partial.mkdir(parents=True, exist_ok=True)
        segments, journals = open_segments(partial, pins, self.segment_bytes, stats)
        stats.files = len(pins) + 1

        def fetch(segment: Segment) -> None:
            self._fetch_segment(name, pins[segment[0]], journals[segment[0]], segment, stats, on_chunk)

        fetch_segments(segments, journals, fetch, self.connections)
        _verify_pinned(partial, pins, f"{self.url}/{name}", self.connections)
        (partial / INDEX_FILE).write_bytes(indexed.raw)  # the bytes every pin was checked against
        rename_into_place(partial, final)
        return final, stats

    def _fetch_segment(
        self,
        name: str,
        pin: Pin,
        journal: SegmentJournal,
        segment: Segment,
        stats: DownloadStats,
        on_chunk: Callable[[int], None] | None,
    ) -> None:
        """One segment of a pinned object: a ranged GET from its resume offset, streamed into its
        file and journal ``step_bytes`` at a time."""
        import obstore

        _, start, offset, end = segment
        key = f"{name}/{pin.key}"
        got = self._call(key, obstore.get, key, options={"range": (offset, end)})
        stream = got.stream(min_chunk_size=self.step_bytes)
        while offset < end:
            try:
                data = next(stream)
            except StopIteration:
                break
            except Exception as exc:
                raise _error(exc, f"{self.url}/{key}") from None
            journal.write(start, offset, memoryview(data)[: end - offset])
            offset += min(len(data), end - offset)
            stats.add(fetched=len(data))
            faults.point("bucket:mid-download")
            if on_chunk is not None:
                on_chunk(len(data))
        if offset != end:
            raise CorruptArtifact(f"{self.url}/{key}: the range {start}-{end} ended at {offset}")

    # -- upload and delete ------------------------------------------------------------------

    def upload(self, version_dir: Path) -> int:
        """Upload a complete version directory; returns bytes sent.

        Its files go under a prefix of this upload's own (never another publisher's objects),
        then the index, create-only, pinning each of them: a published version of the same number
        is a ``VersionConflict``, and this upload's objects are then deleted by this upload."""
        import obstore

        version_dir = Path(version_dir)
        version = dir_version(version_dir.name)
        if version is None:
            raise UnsupportedStore(f"{version_dir} is not a version directory")
        if INDEX_FILE in self.objects(version).get(version, {}):
            raise VersionConflict(f"{self.url}/{version_dir.name} is already published")
        if not (version_dir / INDEX_FILE).is_file():
            raise CorruptArtifact(f"{version_dir} has no {INDEX_FILE}: not a complete version")
        doc = json_object((version_dir / INDEX_FILE).read_bytes(), f"{version_dir.name}/{INDEX_FILE}")
        files = sorted(
            e.name
            for e in os.scandir(version_dir)
            if e.is_file(follow_symlinks=True) and not e.name.startswith(".") and e.name != INDEX_FILE
        )
        prefix = f"{UPLOAD_PREFIX}{secrets.token_hex(8)}"
        keys = [f"{version_dir.name}/{prefix}/{file}" for file in files]

        def put(file: str) -> tuple[int, str]:
            path = version_dir / file
            key = f"{version_dir.name}/{prefix}/{file}"
            md5, pin = _digests(path)
            result = self._call(key, obstore.put, key, path)  # under our own prefix: nobody else's to overwrite
            etag = (result.get("e_tag") or "").strip('"')
            if re.fullmatch(r"[0-9a-f]{32}", etag) and etag != md5:  # a single-part S3 upload's etag is its MD5
                raise CorruptArtifact(f"{self.url}/{key}: the stored object's MD5 differs from the file's")
            faults.point("bucket:mid-upload")
            return path.stat().st_size, pin

        try:
            with ThreadPoolExecutor(min(self.connections, max(1, len(files))), thread_name_prefix="rf-upload") as pool:
                pinned = dict(zip(files, pool.map(put, files), strict=True))
        except BaseException:
            self._discard(keys)
            raise
        meta = doc.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise CorruptArtifact(f"{version_dir.name}/{INDEX_FILE}: metadata must be an object")
        meta[OBJECTS_KEY] = pin_objects(prefix, pinned)
        body = json.dumps(doc, indent=2).encode()
        index_key = f"{version_dir.name}/{INDEX_FILE}"
        try:
            self._call(index_key, obstore.put, index_key, body, mode="create")
        except VersionConflict:
            self._discard(keys)  # refused: no index will ever name these objects
            raise
        # (Any other failure may have stored the index: the objects stay, published or leftovers.)
        return sum(size for size, _ in pinned.values()) + len(body)

    def _discard(self, keys: list[str]) -> None:
        """Best effort: this upload's own objects, which no index names (retention takes what stays)."""
        with contextlib.suppress(PolicyError):
            self._delete_keys(keys)

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


def _check_listed(where: str, pins: Mapping[str, Pin], listed: Mapping[str, int]) -> None:
    """Every object the index pins is listed, at its pinned size (before any byte is fetched)."""
    for pin in pins.values():
        if pin.key not in listed:
            raise CorruptArtifact(f"{where}/{pin.key} is missing (the index pins it)")
        if listed[pin.key] != pin.size:
            raise ChecksumMismatch(f"{where}/{pin.key} is {listed[pin.key]} bytes; the index pins {pin.size}")


def _verify_pinned(partial: Path, pins: Mapping[str, Pin], where: str, connections: int) -> None:
    """Every downloaded file's bytes hash to its pin; a file that does not is deleted, so the next
    attempt fetches it afresh instead of resuming it."""

    def verify(file: str) -> None:
        got = _digests(partial / file)[1]
        if got != pins[file].checksum:
            (partial / file).unlink()  # fetched afresh next time, not resumed
            raise ChecksumMismatch(
                f"{where}/{pins[file].key}: its bytes hash to {got}, the index pins {pins[file].checksum}"
            )

    with ThreadPoolExecutor(min(connections, max(1, len(pins))), thread_name_prefix="rf-verify") as pool:
        for _ in pool.map(verify, sorted(pins)):
            pass


def _digests(path: Path) -> tuple[str, str]:
    """(MD5, ``PIN_FORMAT`` checksum) of a file's bytes, read once."""
    md5 = hashlib.md5(usedforsecurity=False)
    pin = new_hasher(PIN_FORMAT)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            md5.update(block)
            pin.update(block)
    return md5.hexdigest(), pin.hexdigest()


def _tag(meta: Mapping[str, Any]) -> str | None:
    tag = meta.get("e_tag")
    return tag.strip('"') if isinstance(tag, str) and tag else None


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None
