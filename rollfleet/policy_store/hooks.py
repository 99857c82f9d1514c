"""Storage hooks: what makes writes visible on object-store mounts.

A hook is given as a callable or as an importable path, ``"package.module:function"`` (or
``"package.module.function"``). The post-write hook runs after each publication as
``hook(version_dir: Path, record: VersionRecord)``; the pre-read hook runs before the
replica lists the store and before it reads each version directory, as ``hook(path: Path)``.
These mirror miles' ``--custom-update-weight-post-write-path`` and SGLang's
``--sglang-custom-pull-weights-pre-read-hook``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rollfleet.schemas.errors import PolicyError

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
