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
        # Sessions: where their turns ran.
        self.session_turns = Counter(
            "rollfleet_client_session_turns_total", "Turns of sessions answered", ("client_id",), registry=self.registry
        ).labels(client_id=client_id)
        self.affinity_hits = Counter(
            "rollfleet_client_affinity_hits_total",
            "Turns served by the replica that served their session's previous turn",
            ("client_id",),
            registry=self.registry,
        ).labels(client_id=client_id)
        self.affinity_fallbacks = Counter(
            "rollfleet_client_affinity_fallbacks_total",
            "Sticky turns moved to the shared subjects (the replica busy, gone or incompatible)",
            ("client_id", "reason"),
            registry=self.registry,
        )
        self.prefix_tokens_reused = Counter(
            "rollfleet_client_prefix_tokens_reused_total",
            "Prompt tokens of session turns served from a replica's cached context",
            ("client_id",),
            registry=self.registry,
        ).labels(client_id=client_id)
        self.cancelled = Counter(
            "rollfleet_client_cancelled_total",
            "Jobs cancelled, by what the cancel did (withdrawn, stopped, answered, unknown)",
            ("client_id", "outcome"),
            registry=self.registry,
        )
