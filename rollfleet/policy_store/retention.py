"""Which versions a store keeps.

Kept: version 0 (the base; hard links make it nearly free), the newest full version and every
version after it, the last ``keep_last`` versions, and — so that each kept version stays
reachable — the newest full version at or below the oldest of those and every version in
between. Everything older is deleted by renaming it to a hidden ``.trash-*`` name first (so a
reader sees it vanish at once, never half-deleted) and then removing it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from rollfleet.policy_store.layout import fsync_dir
from rollfleet.policy_store.store import list_versions, read_index, version_dir_name
from rollfleet.schemas.errors import PolicyError

TRASH_PREFIX = ".trash-"


def plan_retention(kinds: Mapping[int, bool], keep_last: int) -> set[int]:
    """Versions to keep, given ``{version: is_full}``."""
    if not kinds:
        return set()
    versions = sorted(kinds)
    latest = versions[-1]
    fulls = [v for v in versions if kinds[v]]
    newest_full = fulls[-1] if fulls else versions[0]
    lo = min(newest_full, latest - max(keep_last, 1) + 1)
    anchors = [v for v in fulls if v <= lo]
    anchor = anchors[-1] if anchors else versions[0]
    keep = {v for v in versions if v >= anchor}
    if 0 in kinds:
        keep.add(0)
    return keep


def apply_retention(store: Path, keep_last: int) -> list[int]:
    """Delete what :func:`plan_retention` does not keep; returns the deleted versions."""
    store = Path(store)
    kinds: dict[int, bool] = {}
    for v in list_versions(store):
        try:
            kinds[v] = not read_index(store / version_dir_name(v)).metadata.is_delta
        except PolicyError:
            kinds[v] = False  # unreadable: never an anchor
    keep = plan_retention(kinds, keep_last)
    deleted = []
    for v in sorted(set(kinds) - keep):
        src = store / version_dir_name(v)
        trash = store / f"{TRASH_PREFIX}{src.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(src, trash)
        except FileNotFoundError:
            continue
        deleted.append(v)
        shutil.rmtree(trash, ignore_errors=True)
    if deleted:
        fsync_dir(store)
    return deleted
