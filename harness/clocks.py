"""Per-process clock skew for tests and the machine adversary: libfaketime, preloaded into a child
process (``LD_PRELOAD``, ``FAKETIME=<offset>``). Taken from the ``libfaketime`` Python package (in
the ``test`` extra), which carries the library built for x86-64 Linux, so a fresh clone's ``make
test`` runs the clock-skew tests too; else from where Debian's ``faketime`` package puts it. A
library is used only once a skewed child has been seen to read the skew and still sleep."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import subprocess
import sys
import time
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
    Only the wall clock where the library allows it: a host's clock error is in the time it reads
    and stamps, and a process's monotonic clock is its own, never compared across processes."""
    setting = _working_setting(lib)
    return _environment(lib, skew_s, setting if setting is not None else _MONOTONIC_SETTINGS[0])


def _environment(lib: str, skew_s: float, setting: dict[str, str]) -> dict[str, str]:
    return {"LD_PRELOAD": lib, "FAKETIME": f"{skew_s:+.3f}", "FAKETIME_NO_CACHE": "1", **setting}


def faketime_library() -> str | None:
    """libfaketime's library to preload: the one the ``libfaketime`` package (the test extra) carries
    if it is built for this machine, else Debian's multi-threaded build; of those, the first whose
    skewed child really sleeps and waits. None if none does. (Debian's 0.9.10 does neither under
    Python, either way its monotonic clock is set, so it is only the fallback.)"""
    vendored = _vendored_library()
    candidates = ([vendored] if vendored else []) + [lib for lib in FAKETIME_LIBS if Path(lib).is_file()]
    return next((lib for lib in candidates if _working_setting(lib) is not None), None)


# Builds disagree on the monotonic clock, so each setting is tried: the vendored build hangs every
# timed sleep and wait unless told not to fake it (``time.sleep(1.0)`` never returned); Debian's
# 0.9.10 fails ``time.sleep`` with EINVAL when told so, and hangs ``Event.wait`` when not.
_MONOTONIC_SETTINGS: tuple[dict[str, str], ...] = ({"FAKETIME_DONT_FAKE_MONOTONIC": "1"}, {})
_PROBE = "import threading, time; time.sleep(0.01); threading.Event().wait(0.01); print(time.time())"
_PROBE_SKEW_S = -2.0


@functools.cache
def _working_setting(lib: str) -> dict[str, str] | None:
    """The first monotonic setting under which a child preloaded with ``lib`` sleeps, waits and reads
    a skewed wall clock; None if none does (or the library does not load)."""
    for setting in _MONOTONIC_SETTINGS:
        env = {**os.environ, **_environment(lib, _PROBE_SKEW_S, setting)}
        before = time.time()
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=5)
            read = float(out.stdout.strip())
        except (subprocess.TimeoutExpired, OSError, ValueError):
            continue
        if out.returncode == 0 and abs(read - before - _PROBE_SKEW_S) < 1.0:
            return setting
    return None


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
