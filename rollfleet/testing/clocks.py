"""Per-process clock skew for tests and the machine adversary: libfaketime, where installed."""

from __future__ import annotations

from pathlib import Path

FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
)


def faketime_library() -> str | None:
    """libfaketime's multi-threaded build (Debian's ``faketime`` package), if installed."""
    return next((lib for lib in FAKETIME_LIBS if Path(lib).is_file()), None)
