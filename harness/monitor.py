"""The broker's own counters, for tests and benchmarks that measure what something costs it.

nats-server's monitoring endpoint (``-m <port>``) gives messages in and out (``/varz``) and the
JetStream API requests it served (``/jsz``); ``/proc`` gives the server process's CPU time.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads) so far; this process by default."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Counters:
    in_msgs: float
    out_msgs: float
    api: float  # JetStream API requests served
    cpu_s: float
    t: float  # monotonic

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.in_msgs - other.in_msgs,
            self.out_msgs - other.out_msgs,
            self.api - other.api,
            self.cpu_s - other.cpu_s,
            self.t - other.t,
        )


@dataclass
class BrokerCounters:
    """One or more nats-servers (a cluster's nodes are summed): ``(monitor port, pid)`` each."""

    servers: list[tuple[int, int]]

    def snapshot(self) -> Counters:
        totals = [0.0, 0.0, 0.0, 0.0]
        for port, pid in self.servers:
            try:
                varz = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5).read())
                jsz = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz", timeout=5).read())
            except OSError:
                continue  # a stopped node counts no more
            totals[0] += varz["in_msgs"]
            totals[1] += varz["out_msgs"]
            totals[2] += jsz.get("api", {}).get("total", 0)
            totals[3] += cpu_seconds(pid)
        return Counters(*totals, t=time.monotonic())
