"""The adversary's freezes nest: two overlapping SIGSTOP windows of one process keep it frozen
until the last one ends, as the oracle reads the union of the windows (a real process)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from reliability.adversary.machine import Freezes


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _settled(pid: int, want: str) -> str:
    for _ in range(200):  # (a signal is delivered asynchronously)
        if (state := _state(pid)) == want:
            return state
        time.sleep(0.005)
    return _state(pid)


def test_overlapping_freezes_thaw_only_when_the_last_ends() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    freezes = Freezes()
    try:
        freezes.stop(proc)
        assert _settled(proc.pid, "T") == "T"
        freezes.stop(proc)  # a second freeze while the first lasts
        freezes.cont(proc)  # the first ends: still frozen, the second's window goes on
        time.sleep(0.05)
        assert _state(proc.pid) == "T"
        freezes.cont(proc)
        assert _settled(proc.pid, "S") == "S"
        freezes.stop(proc)
        proc.kill()
        proc.wait(5)
        freezes.cont(proc)  # killed while frozen: nothing to thaw, no error
    finally:
        proc.kill()
        proc.wait(5)
