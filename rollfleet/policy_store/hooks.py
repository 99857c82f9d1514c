"""Storage hooks (object-store mounts) and the crash-test pause points.

A hook is given as a callable or as an importable path, ``"package.module:function"`` (or
``"package.module.function"``). The post-write hook runs after each publication as
``hook(version_dir: Path, record: VersionRecord)``; the pre-read hook runs before the
replica lists the store and before it reads each version directory, as ``hook(path: Path)``.
These mirror miles' ``--custom-update-weight-post-write-path`` and SGLang's
``--sglang-custom-pull-weights-pre-read-hook``.

Test hook: when the environment variable ``ROLLFLEET_TEST_PAUSE_AT`` names a pause point
(see :data:`PAUSE_POINTS`), the process prints ``PAUSED <point>`` to stdout and sleeps there,
so a test can SIGKILL a real process at a known place. Unset in production: a dict lookup.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rollfleet.schemas.errors import PolicyError

PAUSE_ENV = "ROLLFLEET_TEST_PAUSE_AT"
PAUSE_POINTS = (
    "publish:after-shard",  # a shard is written and fsynced, no index yet
    "publish:before-rename",  # the whole temporary directory is complete
    "publish:after-rename",  # visible, before the store directory is fsynced and the hook runs
    "apply:mid-version",  # some tensors of a delta are applied in place, marker removed
    "apply:before-marker",  # the whole delta is applied and verified, marker not yet written
    "seed:mid-copy",  # part of a full version is copied into the staging directory
)

Hook = Callable[..., Any]


def resolve_hook(hook: str | Hook | None) -> Hook | None:
    """A callable from a callable or an import path; a bad path is a clear error at setup."""
    if hook is None or callable(hook):
        return hook
    module, sep, attr = hook.partition(":")
    if not sep:
        module, _, attr = hook.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PolicyError(f"cannot import hook {hook!r}: {exc}") from None
    if not callable(fn):
        raise PolicyError(f"hook {hook!r} is not callable")
    return fn


def pause_point(name: str) -> None:
    """Sleep forever at ``name`` when the test environment asks for it."""
    if os.environ.get(PAUSE_ENV) == name:
        sys.stdout.write(f"PAUSED {name}\n")
        sys.stdout.flush()
        while True:
            time.sleep(3600)
