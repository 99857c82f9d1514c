"""A KV bucket as the rest of rollfleet uses it: reads, compare-and-set writes and deletes, with
every error the broker gives typed once (``broker.errors.typed``).

- a key that is not there (never written, deleted, purged, or aged out) is ``NotFound`` from
  ``get`` and ``None`` from ``read``: only ever when the broker said so;
- a write conditional on a revision (``create``: on none; ``update`` and ``delete``: on
  ``last``) that the key moved past is ``Fenced``, carrying the key and that revision;
- a broker that did not answer, or refused otherwise, is a ``BrokerError``: whether an
  unanswered write was stored is unknown, and each caller decides what that means.
"""

from __future__ import annotations

from typing import NamedTuple

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollfleet.broker.errors import typed_errors
from rollfleet.schemas.errors import NotFound


class KVEntry(NamedTuple):
    key: str
    value: bytes  # (b"" where the broker stored none)
    revision: int


class KVBucket:
    """One KV bucket: the port every room outside ``broker/`` reads and writes a bucket through."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv  # (for ``broker/``'s own readers and watchers: ``kv.read_latest``, ``watch``)

    async def get(self, key: str) -> KVEntry:
        """The key's value and revision; ``NotFound`` if there is none."""
        with typed_errors(key=key):
            entry = await self.kv.get(key)
        return KVEntry(entry.key or key, entry.value or b"", entry.revision or 0)

    async def read(self, key: str) -> KVEntry | None:
        """The key's value and revision; None if the broker says there is none."""
        try:
            return await self.get(key)
        except NotFound:
            return None

    async def create(self, key: str, value: bytes) -> int:
        """Write the key's first value; its revision. ``Fenced`` if the key has one already."""
        with typed_errors(key=key):
            return await self.kv.create(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        """Write over the key's value at revision ``last``; the new revision. ``Fenced`` if it moved."""
        with typed_errors(key=key, revision=last):
            return await self.kv.update(key, value, last=last)

    async def put(self, key: str, value: bytes) -> int:
        """Write the key whatever is there; its revision."""
        with typed_errors(key=key):
            return await self.kv.put(key, value)

    async def delete(self, key: str, last: int | None = None) -> None:
        """Delete the key (only its value at revision ``last`` if given: ``Fenced`` if it moved)."""
        with typed_errors(key=key, revision=last):
            await self.kv.delete(key, last=last)


async def open_bucket(js: JetStreamContext, name: str) -> KVBucket:
    """The bucket ``name``; ``NotFound`` if the broker has none of that name."""
    with typed_errors(key=name):
        return KVBucket(await js.key_value(name))
