"""Stopping child processes politely, then firmly."""

from __future__ import annotations

import signal
import subprocess


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
