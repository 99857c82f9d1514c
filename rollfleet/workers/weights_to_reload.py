"""Which tensors an activation reloads: those whose bytes in the checkpoint differ from those the
engine holds, never only what the last deltas changed.

A version materialized but never activated (its prepare, staging or activation failed, or a newer
version failed on the way) has moved the checkpoint past the engine, and a later delta's tensors
alone would leave the engine with a mix of versions. The engine's tensors are known by their
checksums ("fmt:hex": those of the checkpoint it loaded, then of each version it activated).
Pure: plain data in, a list of names out.
"""

from __future__ import annotations

from dataclasses import replace

from rollfleet.policy_store import MaterializeResult


def to_reload(engine_sums: dict[str, str] | None, result: MaterializeResult) -> list[str]:
    """The tensors whose bytes in the checkpoint differ from those the engine holds (all that
    the materialization touched, where what the engine holds is not known)."""
    if engine_sums is None or not result.checksums:
        return list(result.changed)
    return [name for name, digest in result.checksums.items() if engine_sums.get(name) != digest]


def combined(first: MaterializeResult, then: MaterializeResult) -> MaterializeResult:
    """Two materializations in a row, as one step from ``first.previous_version``."""
    order = {name: i for i, name in enumerate(then.changed + first.changed)}
    changed = sorted(set(first.changed) | set(then.changed), key=order.__getitem__)
    changed_bytes = first.changed_bytes + then.changed_bytes
    total = then.total_bytes or first.total_bytes
    return replace(
        then,
        previous_version=first.previous_version,
        changed=changed,
        applied=first.applied + then.applied,
        wire_bytes=first.wire_bytes + then.wire_bytes,
        changed_bytes=changed_bytes,
        density=min(1.0, changed_bytes / total) if total else 0.0,
        seconds=first.seconds + then.seconds,
    )
