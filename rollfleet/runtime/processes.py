"""Child processes: tied to their parent's life, stopped politely, then firmly."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for a child that must not outlive this process (PDEATHSIG on Linux: the
    child gets SIGTERM, so it drains, when its parent dies for any reason, SIGKILL included)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


def terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` (SIGTERM: drain and exit), then SIGKILL if it has not exited in time.
    Returns the exit code (None for no process)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode
