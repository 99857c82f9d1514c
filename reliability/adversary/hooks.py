"""Storage hooks the adversary hands to ``rollfleet worker --pre-read-hook``.

``slow_read``: a slow mount. Before each read of the store (a listing, each version
directory) it sleeps for the seconds written in the file named by ``RF_ADV_SLOW_READ`` (no
file, or an empty one: no delay). The adversary writes and removes that file while replicas
prepare versions; the hook itself never decides anything.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "RF_ADV_SLOW_READ"
MAX_SLEEP_S = 30.0


def slow_read(path: Path) -> None:
    control = os.environ.get(ENV)
    if not control:
        return
    try:
        seconds = float(Path(control).read_text().strip() or 0.0)
    except (OSError, ValueError):
        return
    if seconds > 0:
        time.sleep(min(seconds, MAX_SLEEP_S))
