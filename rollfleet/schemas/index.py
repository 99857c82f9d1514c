"""The publication index: ``weight_vNNNNNN/model.safetensors.index.json``.

This is the file miles' disk-delta path writes and SGLang's ``/pull_weights`` reads::

    {"metadata": {"version": "000007", "base_version": "000006", "delta_encoding": "xor",
                  "compression_format": "zstd", "checksum_format": "xxh3-128"},
     "weight_map": {"<hf tensor name>": "<shard file>", ...}}

A *full* version is an ordinary Hugging Face index: no ``delta_encoding`` (``base_version``
may still name its lineage). A plain HF index without our metadata is a full version too; its
number then comes from the directory name (``default_version``), as SGLang's puller reads it.
Version numbers travel as zero-padded six-digit strings because the foreign readers compare
them as strings; here they are parsed to ints.

Parsing is strict and fails closed: malformed input raises :class:`CorruptArtifact`, a name
that could escape its directory raises :class:`HostileName`. Whether an encoding, compression
or checksum format is *known* is the policy store's decision (``policy_store.formats``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from rollfleet.schemas.bounded_json import load_json
from rollfleet.schemas.errors import CorruptArtifact, HostileName

INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a weight_map of a few hundred thousand tensors still fits
MAX_NAME_LEN = 1024
_VERSION = re.compile(r"^[0-9]{1,12}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_KNOWN_META = ("version", "base_version", "delta_encoding", "compression_format", "checksum_format")


def version_str(version: int) -> str:
    """The wire form of a version number: at least six digits, zero-padded."""
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    return f"{version:06d}"


def parse_version(value: object, what: str = "version") -> int:
    """A version from its wire form (digit string, or a plain non-negative int)."""
    if isinstance(value, bool):
        raise CorruptArtifact(f"{what} must be a version number, got {value!r}")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and _VERSION.match(value):
        return int(value)
    raise CorruptArtifact(f"{what} must be a zero-padded version number, got {value!r}")


def check_name(name: object, what: str) -> str:
    """Reject names that could escape a directory or confuse a filesystem.

    Used for shard file names and tensor names alike: no path separators, no ``..``,
    nothing absolute, no control characters, not empty, bounded length.
    """
    if not isinstance(name, str):
        raise CorruptArtifact(f"{what} must be a string, got {type(name).__name__}")
    bad = (
        not name
        or len(name) > MAX_NAME_LEN
        or "/" in name
        or "\\" in name
        or ".." in name
        or name in (".", "~")
        or name.startswith("~")
        or (len(name) > 1 and name[1] == ":")  # drive-letter absolute paths
        or _CONTROL.search(name) is not None
    )
    if bad:
        raise HostileName(f"hostile {what}: {name!r}")
    return name


@dataclass(frozen=True)
class IndexMetadata:
    version: int
    base_version: int | None = None
    delta_encoding: str | None = None  # None: a full version
    compression_format: str | None = None
    checksum_format: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys we do not interpret, kept verbatim

    @property
    def is_delta(self) -> bool:
        return self.delta_encoding is not None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out["version"] = version_str(self.version)
        if self.base_version is not None:
            out["base_version"] = version_str(self.base_version)
        for key in ("delta_encoding", "compression_format", "checksum_format"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


@dataclass(frozen=True)
class PublicationIndex:
    metadata: IndexMetadata
    weight_map: dict[str, str]  # tensor name -> shard file name

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def to_bytes(self) -> bytes:
        doc = {"metadata": self.metadata.to_json(), "weight_map": dict(sorted(self.weight_map.items()))}
        return json.dumps(doc, indent=2).encode()

    @classmethod
    def parse(cls, raw: bytes | str, default_version: int | None = None) -> PublicationIndex:
        """Parse and validate an index file's content."""
        return cls.from_json(_load_index_json(raw), default_version)

    @classmethod
    def from_json(cls, doc: object, default_version: int | None = None) -> PublicationIndex:
        """``default_version``: the number of a plain HF index (no version, no delta_encoding)."""
        weight_map = _weight_map(doc)
        meta = doc.get("metadata")  # type: ignore[union-attr]
        if meta is None and default_version is not None:
            meta = {}
        if not isinstance(meta, dict):
            raise CorruptArtifact("index.metadata must be an object")
        if "version" in meta:
            version = parse_version(meta["version"], "metadata.version")
        elif default_version is not None and meta.get("delta_encoding") is None:
            version = default_version
        else:
            raise CorruptArtifact("index.metadata.version is missing")
        base = meta.get("base_version")
        base_version = None if base is None else parse_version(base, "metadata.base_version")
        strings: dict[str, str | None] = {}
        for key in ("delta_encoding", "compression_format", "checksum_format"):
            value = meta.get(key)
            if value is not None and (not isinstance(value, str) or not value or len(value) > 64):
                raise CorruptArtifact(f"index.metadata.{key} must be a short string, got {value!r}")
            strings[key] = value
        if strings["delta_encoding"] is not None:
            if base_version is None:
                raise CorruptArtifact("a delta index must name its base_version")
            if base_version >= version:
                raise CorruptArtifact(f"delta version {version} names base {base_version}, which is not older")
            for key in ("compression_format", "checksum_format"):
                if strings[key] is None:
                    raise CorruptArtifact(f"a delta index must declare {key}")
        extra = {k: v for k, v in meta.items() if k not in _KNOWN_META}
        return cls(
            IndexMetadata(
                version=version,
                base_version=base_version,
                delta_encoding=strings["delta_encoding"],
                compression_format=strings["compression_format"],
                checksum_format=strings["checksum_format"],
                extra=extra,
            ),
            weight_map,
        )


def _weight_map(doc: object) -> dict[str, str]:
    if not isinstance(doc, dict):
        raise CorruptArtifact("index must be a JSON object")
    wmap = doc.get("weight_map")
    if not isinstance(wmap, dict):
        raise CorruptArtifact("index.weight_map must be an object")
    for name, shard in wmap.items():
        check_name(name, "tensor name in weight_map")
        check_name(shard, f"shard file name for {name!r}")
    return dict(wmap)


def json_object(raw: bytes | str, what: str, max_bytes: int = MAX_INDEX_BYTES) -> dict[str, Any]:
    """``raw`` parsed as a JSON object; CorruptArtifact naming ``what`` when it is not one (or is
    larger than ``max_bytes``, or nested too deep: ``bounded.load_json``)."""
    doc = load_json(raw, what=what, max_bytes=max_bytes, error=CorruptArtifact)
    if not isinstance(doc, dict):
        raise CorruptArtifact(f"{what} is not a JSON object")
    return doc


def _load_index_json(raw: bytes | str) -> object:
    return json_object(raw, "index")


def parse_weight_map(raw: bytes | str) -> dict[str, str]:
    """The weight_map of any HF index (an ordinary checkpoint need not carry our metadata)."""
    return _weight_map(_load_index_json(raw))
