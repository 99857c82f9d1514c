"""One digest for a whole set of tensors, from their per-tensor checksums.

The trainer (``PolicyPublisher.checksums``) and a replica (its engine's live parameters)
compute it the same way, so comparing two short strings proves the replica serves exactly
the trainer's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import xxhash


def weights_digest(checksums: Mapping[str, str]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(checksums):
        h.update(f"{name}={checksums[name]}\n".encode())
    return h.hexdigest()


def content_digest(checksums: Mapping[str, str]) -> bytes:
    """The 8-byte digest of a version's content: every tensor's final-state checksum as
    ``"fmt:hex"`` (as a materialized checkpoint's marker records them, ``MaterializeResult.checksums``).
    The same tensors' bytes give the same digest whichever chain of deltas or store they came
    from; what a replay coordinate records for each version a sample was generated at. 64 bits
    (the first half of ``weights_digest``'s 128) tell versions apart by accident, and keep the
    coordinate on every result small; the store's per-tensor checksums guard the bytes."""
    return bytes.fromhex(weights_digest(checksums))[:8]
