"""Per-process clock skew for tests and the machine adversary: libfaketime, preloaded into a child
process (``LD_PRELOAD``, ``FAKETIME=<offset>``). Found where Debian's ``faketime`` package puts it,
or else in the ``libfaketime`` Python package (in the ``test`` extra), which carries the library
built for x86-64 Linux: so a fresh clone's ``make test`` runs the clock-skew tests too."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
)
# Where the ``libfaketime`` package keeps the library it carries (python-libfaketime's layout).
_VENDORED = Path("vendor") / "libfaketime" / "src"
_VENDORED_NAMES = ("libfaketimeMT.so.1", "libfaketime.so.1")
# ELF e_machine of the machines this runs on: a library built for another is not preloaded by the
# dynamic linker (it says so and goes on), and the child's clock would not move.
_ELF_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}


def skewed_environment(lib: str, skew_s: float) -> dict[str, str]:
    """The environment that runs a child process's wall clock ``skew_s`` seconds off this one's.
    Only the wall clock: a host's clock error is in the time it reads and stamps, and a process's
    monotonic clock is its own, never compared across processes. (Faking monotonic time too makes
    the vendored library hang every timed sleep and wait: ``time.sleep(1.0)`` never returned.)"""
    return {"LD_PRELOAD": lib, "FAKETIME": f"{skew_s:+.3f}", "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1"}  # fmt: skip


def faketime_library() -> str | None:
    """libfaketime's library to preload: Debian's multi-threaded build if installed, else the one
    the ``libfaketime`` package carries, if it is built for this machine; None if neither."""
    found = next((lib for lib in FAKETIME_LIBS if Path(lib).is_file()), None)
    return found or _vendored_library()


def _vendored_library() -> str | None:
    spec = importlib.util.find_spec("libfaketime")  # (located, not imported: it needs nothing run)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        for name in _VENDORED_NAMES:
            lib = Path(location) / _VENDORED / name
            if lib.is_file() and _built_for_this_machine(lib):
                return str(lib)
    return None


def _built_for_this_machine(lib: Path) -> bool:
    """Whether ``lib`` is a 64-bit little-endian ELF object for this machine's architecture."""
    want = _ELF_MACHINE.get(platform.machine().lower())
    try:
        with open(lib, "rb") as f:
            header = f.read(20)
    except OSError:
        return False
    if want is None or len(header) < 20 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        return False
    return int.from_bytes(header[18:20], "little") == want
