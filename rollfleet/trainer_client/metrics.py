"""Prometheus metrics of one client, on their own registry (serve it from the trainer if wanted)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ClientMetrics:
    def __init__(self, client_id: str) -> None:
        self.registry = CollectorRegistry()
        self.contract_violations = Counter(
            "rollfleet_client_contract_violations_total",
            "Results that came back outside the constraint they were submitted with (never handed out)",
            ("client_id",),
            registry=self.registry,
        ).labels(client_id=client_id)
