"""Shared pieces of the reliability scenarios: figures, process management, result counting.

Everything here drives the real system: a real nats-server, real ``rollfleet worker``
processes, real SIGKILLs. Every wait is bounded; every process is stopped in ``finally``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.broker import EmbeddedBroker
from rollfleet.schemas import Names, RolloutPayload, SamplingParams, VersionActivated, decode_event

REPO = Path(__file__).resolve().parents[2]
BROKER_CONFIG = REPO / "broker_config"


# -- figures -----------------------------------------------------------------------------------


@dataclass
class Figures:
    """What one scenario run measured. ``problems`` lists every broken promise (empty: passed)."""

    scenario: str
    title: str
    size: dict[str, Any] = field(default_factory=dict)
    submitted: int = 0
    completed: int = 0
    failed: int = 0  # typed failures delivered as results (counted, not lost)
    duplicated: int = 0  # keys with more than one distinct result stored or delivered
    lost: int = 0  # submitted (acknowledged) keys with no outcome
    reexecuted: int = 0  # results generated on a redelivery (the holder had died)
    faults: int = 0  # kills / corruptions injected
    versions_published: int = 0
    versions_activated: int = 0
    recover_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def expect(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def summary(self) -> str:
        rec = f"{max(self.recover_s):.2f}s" if self.recover_s else "-"
        return (
            f"[{self.scenario}] {self.title}: submitted={self.submitted} completed={self.completed} "
            f"failed={self.failed} duplicated={self.duplicated} lost={self.lost} reexecuted={self.reexecuted} "
            f"faults={self.faults} published={self.versions_published} activated={self.versions_activated} "
            f"max_recover={rec} seconds={self.seconds:.1f} problems={self.problems}"
        )


# -- counting results --------------------------------------------------------------------------


class Ledger:
    """Every result message the client is handed, per idempotency key, before its own dedup.

    ``duplicated`` counts keys for which more than one *distinct* result exists: two stored
    messages on the results stream, or two different stream sequences delivered. A stored
    message redelivered to a client (its ack was lost) is the same result, not a duplicate.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.deliveries: dict[str, set[int]] = defaultdict(set)
        self.first_arrival: dict[str, float] = {}
        self.arrivals: list[float] = []  # monotonic time of every first delivery

        def counting(outcome: Any, seq: int | None) -> None:
            key = outcome.idempotency_key
            if key not in self.first_arrival:
                now = time.monotonic()
                self.first_arrival[key] = now
                self.arrivals.append(now)
            self.deliveries[key].add(seq if seq is not None else -1)

        client.observe = counting

    async def stored(self) -> dict[str, int]:
        """Messages on the results stream per subject (one subject per idempotency key)."""
        names: Names = self.client.names
        info = await self.client.js.stream_info(
            names.results_stream, subjects_filter=names.results_filter(self.client.client_id)
        )
        return {s: int(c) for s, c in (info.state.subjects or {}).items()}

    async def duplicated(self) -> int:
        stored = await self.stored()
        dup_keys = {k for k, seqs in self.deliveries.items() if len(seqs) > 1}
        extra_stored = sum(1 for c in stored.values() if c > 1)
        return len(dup_keys) + extra_stored


def start_broker(workdir: Path) -> EmbeddedBroker:
    """A scenario's own single-node broker: its store and log in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    return EmbeddedBroker(store_dir=workdir / "nats", log_file=workdir / "nats.log").start()


async def gather_outcomes(handles: dict[str, Any], timeout: float) -> tuple[dict[str, Any], dict[str, Exception]]:
    """Await every handle until one shared deadline: (results by key, typed errors by key)."""
    results: dict[str, Any] = {}
    errors: dict[str, Exception] = {}
    deadline = time.monotonic() + timeout

    async def one(key: str, handle: Any) -> None:
        try:
            results[key] = await handle.result(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            pass
        except Exception as exc:
            errors[key] = exc

    await asyncio.gather(*(one(k, h) for k, h in handles.items()))
    return results, errors


def max_gap(times: Iterable[float], start: float, end: float) -> float:
    """The longest interval in [start, end] with no event in it."""
    pts = sorted(t for t in times if start <= t <= end)
    edges = [start, *pts, end]
    return max((b - a for a, b in itertools.pairwise(edges)), default=end - start)


def job_payload(i: int, max_tokens: int = 4) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=[1 + i % 97, 2, 3], sampling=SamplingParams(max_tokens=max_tokens))


async def read_activations(js: Any, names: Names, timeout: float = 0.5) -> list[VersionActivated]:
    """Every activation announcement on the events stream so far."""
    sub = await js.pull_subscribe(names.versions_activated, stream=names.events_stream)
    out: list[VersionActivated] = []
    try:
        while True:
            msgs = await sub.fetch(256, timeout=timeout)
            for m in msgs:
                event = decode_event(m.data)
                if isinstance(event, VersionActivated):
                    out.append(event)
    except (TimeoutError, Exception):
        pass
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    return out
