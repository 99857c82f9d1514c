"""Histories for the oracle's pure tests: an ``Oracle`` built from a trainer's journal and from what
the harness and the wiretap saw, every part a test does not name left empty. One place, so a field
the oracle comes to read is added here once and not in each test's copy of a timeline."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from reliability.adversary.oracle import Oracle
from rollfleet.schemas import Names

_TIMELINE: dict[str, Any] = {
    "workers": [], "broker_down": [], "commits": [], "hidden": [], "corrupt": [], "consumers_deleted": [],
    "trainers": [], "second_clients": [], "events": [], "stores_lost": [],
}  # fmt: skip
_TAP: dict[str, Any] = {"deliveries": [], "published": [], "acks": {}, "claims": [], "stored_jobs": {}, "fleet": [],
                        "gaps": []}  # fmt: skip
_CFG: dict[str, Any] = {"seed": 1, "ack_wait": 5.0, "duplicate_window": 60.0, "max_deliver": 10, "duration": 10}


def echo_worker(worker_id: str, start: float, **fields: Any) -> SimpleNamespace:
    """A worker process of the harness's timeline: started at ``start``, still running."""
    return SimpleNamespace(**{"worker_id": worker_id, "engine": "echo", "start": start, "end": None,
                              "paused_at": None, "how": "", "armed": None, **fields})  # fmt: skip


def history_oracle(
    journal: list[dict[str, Any]],
    *,
    timeline: dict[str, Any] | None = None,
    tap: dict[str, Any] | None = None,
    cfg: dict[str, Any] | None = None,
    stored: dict[str, Any] | None = None,
    weights: Any = None,
    namespace: str = "adv",
    build: bool = True,
) -> Oracle:
    """The oracle of one history: ``timeline``, ``tap`` and ``cfg`` name only what differs from an
    empty run (10 s, ack wait 5 s, duplicate window 60 s); built (``_build``) unless told not."""
    oracle = Oracle(
        cfg=SimpleNamespace(**{**_CFG, **(cfg or {})}),
        timeline=SimpleNamespace(**{**_TIMELINE, **(timeline or {})}),
        tap=SimpleNamespace(**{**_TAP, **(tap or {})}),
        trainer=journal, rogue=[], activations=[], stored=stored or {}, finals={}, weights=weights,
        names=Names(namespace),
    )  # fmt: skip
    if build:
        oracle._build()
    return oracle
