"""MessagePack encoding with validation on decode and typed errors."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.messages import StoredOutcome, VersionEvent

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, type_: Any, *, max_bytes: int | None = None, what: str | None = None) -> Any:
    """Decode and validate; any failure is an ``InvalidRequest`` naming what was wrong."""
    name = what or getattr(type_, "__name__", str(type_))
    if max_bytes is not None and len(data) > max_bytes:
        raise InvalidRequest(f"{name} is {len(data)} bytes, over the limit of {max_bytes}")
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{name} has an invalid field: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{name} is not valid MessagePack: {exc}") from None


def decode_outcome(data: bytes) -> StoredOutcome:
    """A result, a failure, or the head of a result stored in chunks."""
    return decode(data, StoredOutcome, what="rollout outcome")


def decode_event(data: bytes) -> VersionEvent:
    return decode(data, VersionEvent, what="version event")
