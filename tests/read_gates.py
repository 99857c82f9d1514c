"""A pre-read hook whose reads of each store version wait at a gate the test opens.

``rollfleet worker --pre-read-hook read_gates:gated_read`` with ``RF_TEST_READ_GATES`` naming a
directory: a read of ``weight_v<N>`` blocks until the file ``<dir>/<N>`` exists, as a read from
a wedged mount that recovers does; the store's listing is never held. Kept free of heavy imports:
the worker process imports it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "RF_TEST_READ_GATES"


def gated_read(path: Path, *args: object) -> None:
    name = Path(path).name
    gates = os.environ.get(ENV)
    if not gates or not name.startswith("weight_v"):
        return
    gate = Path(gates) / str(int(name.removeprefix("weight_v")))
    while not gate.exists():
        time.sleep(0.05)
