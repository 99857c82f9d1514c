"""MessagePack encoding with validation on decode and typed errors."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from rollfleet.schemas.errors import InvalidRequest, UnsupportedSchema
from rollfleet.schemas.messages import SCHEMA_VERSION, JobAddress, RolloutJob, StoredOutcome, VersionEvent

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
    except RecursionError:  # nested deeper than the interpreter recurses (in an Any field)
        raise InvalidRequest(f"{name} nests deeper than this process can decode") from None


def decode_outcome(data: bytes) -> StoredOutcome:
    """A result, a failure, or the head of a result stored in chunks."""
    return decode(data, StoredOutcome, what="rollout outcome")


def decode_event(data: bytes) -> VersionEvent:
    return decode(data, VersionEvent, what="version event")


def decode_job(data: bytes, *, max_bytes: int) -> RolloutJob:
    """A job this worker can run, or why not: ``UnsupportedSchema`` for a job written for a newer
    schema (refused even when it decodes: a field this worker skips may change what it asks),
    ``InvalidRequest`` for one that is malformed. ``job_address`` still finds where either is
    answered."""
    try:
        job: RolloutJob = decode(data, RolloutJob, max_bytes=max_bytes, what="rollout job")
    except InvalidRequest as exc:
        address = job_address(data) if len(data) <= max_bytes else None
        if address is None or address.schema <= SCHEMA_VERSION:
            raise
        raise _newer(address.schema, undecodable_fields(data), exc.message) from None
    if job.schema > SCHEMA_VERSION:
        raise _newer(job.schema, (), "")
    return job


def _newer(schema: int, fields: tuple[str, ...], why: str) -> UnsupportedSchema:
    said = f"; it cannot decode {', '.join(fields)}" if fields else (f" ({why})" if why else "")
    return UnsupportedSchema(
        f"the job is of schema {schema}, newer than this worker's {SCHEMA_VERSION}{said}: upgrade the worker",
        schema=schema,
        supported=SCHEMA_VERSION,
        fields=fields,
    )


def job_address(data: bytes) -> JobAddress | None:
    """Where a job's answer goes and how its caller recognises it (job id, key, client,
    fingerprint) and its schema, from a job that may not decode as a whole; None when not even
    these do."""
    try:
        return decode(data, JobAddress, what="job address")  # (the other fields are skipped)
    except InvalidRequest:
        return None


def undecodable_fields(data: bytes) -> tuple[str, ...]:
    """The fields of a job whose values do not decode as this worker's ``RolloutJob`` declares
    them, each tried on its own (so no error's text is read to find them)."""
    try:
        doc = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return ()
    if not isinstance(doc, dict):
        return ()
    bad = []
    for field in msgspec.structs.fields(RolloutJob):
        if field.encode_name in doc:
            try:
                msgspec.convert(doc[field.encode_name], field.type)
            except (msgspec.ValidationError, RecursionError):
                bad.append(field.encode_name)
    return tuple(bad)
