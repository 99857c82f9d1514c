"""Prometheus metrics of one worker, on their own registry (several workers may share a process)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector

from rollfleet.schemas import VersionActivated

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


_FOLD_AT = 1024


class _Deferred:
    """Per-job observations queued here and folded into their metric when it is collected (a
    scrape) or once many are queued, so the request path does not take prometheus_client's
    locks per job. (A deque: the scrape thread folds while the event loop appends.)"""

    __slots__ = ("_apply", "_queue")

    def __init__(self, apply: Callable[[Any], None]) -> None:
        self._apply = apply
        self._queue: deque[Any] = deque()

    def observe(self, value: Any) -> None:
        self._queue.append(value)
        if len(self._queue) >= _FOLD_AT:
            self.fold()

    def fold(self) -> None:
        queue = self._queue
        while queue:
            try:
                value = queue.popleft()
            except IndexError:
                return
            self._apply(value)


class _FoldFirst(Collector):
    """Registered before the metrics: folds the deferred observations when a scrape begins."""

    def __init__(self, deferred: list[_Deferred]) -> None:
        self._deferred = deferred

    def collect(self) -> Iterable[Any]:
        for d in self._deferred:
            d.fold()
        return []


class _Declare:
    """Declaring a worker's metrics in its registry, each with the worker's labels."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._r, self._labels = registry, labels

    def counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, (*self._labels, *extra), registry=self._r)

    def count(self, name: str, doc: str) -> Any:  # a counter of this worker (its labels bound)
        return self.counter(name, doc).labels(**self._labels)

    def gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, tuple(self._labels), registry=self._r).labels(**self._labels)

    def hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        return Histogram(name, doc, tuple(self._labels), buckets=buckets, registry=self._r).labels(**self._labels)


class WorkerMetrics:
    def __init__(self, worker_id: str, engine: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"worker_id": worker_id, "engine": engine}
        deferred: list[_Deferred] = []
        self.registry.register(_FoldFirst(deferred))
        d = _Declare(self.registry, labels)
        counter, count, gauge, hist = d.counter, d.count, d.gauge, d.hist
        self._labels = labels
        self._job_children: dict[str, Counter] = {}
        self._jobs = counter("rollfleet_jobs_total", "Jobs finished, by outcome (ok or an error code)", ("outcome",))
        self.queue_wait = _Deferred(
            hist("rollfleet_queue_wait_seconds", "Submit to start of generation", _LATENCY_BUCKETS).observe
        )
        self.generation = _Deferred(
            hist("rollfleet_generation_seconds", "Generation time per job", _LATENCY_BUCKETS).observe
        )
        self._outcomes = _Deferred(self._count_outcome)
        deferred += [self.queue_wait, self.generation, self._outcomes]
        self.in_flight = gauge("rollfleet_jobs_in_flight", "Jobs running now")
        self.active_version = gauge("rollfleet_active_version", "Policy version being served")
        self.engine_down = gauge("rollfleet_engine_down", "1 while the engine is dead or hung (no jobs are taken)")
        self.prepare = hist(
            "rollfleet_prepare_seconds", "Pull + apply + verify + stage per activation", _LATENCY_BUCKETS
        )
        self.pause = hist("rollfleet_pause_seconds", "Engine pause per activation", _PAUSE_BUCKETS)
        self.wire_bytes = count("rollfleet_wire_bytes_total", "Bytes of version files read")
        self.density = gauge("rollfleet_update_density", "Changed fraction of the model in the last activation")
        self.activations = count("rollfleet_activations_total", "Versions activated")
        self.prepare_failures = count("rollfleet_prepare_failures_total", "Failed prepares")
        self.drain = hist(
            "rollfleet_exact_drain_seconds", "Wait for exact jobs of the old version before a pause", _LATENCY_BUCKETS
        )
        self.contract_violations = count(
            "rollfleet_contract_violations_total", "Results outside their constraint (never stored)"
        )
        self._declare_sessions_and_resumes(d)
        self.port: int | None = None

    def _declare_sessions_and_resumes(self, d: _Declare) -> None:
        count, gauge = d.count, d.gauge
        # Sessions: what the engine's prefix cache saved, and what it holds.
        self.prefix_tokens_reused = count(
            "rollfleet_prefix_tokens_reused_total", "Prompt tokens served from a session's cached context"
        )
        self.session_turns = count("rollfleet_session_turns_total", "Turns of sessions served")
        self.session_rebuilds = count(
            "rollfleet_session_cache_rebuilds_total", "Session turns whose cache was stale (rebuilt on new weights)"
        )
        # Resumable jobs: checkpoints written and what resumes kept or had to generate again.
        self.resumed_jobs = count(
            "rollfleet_resumed_jobs_total", "Resumable jobs continued from another run's checkpoint"
        )
        self.tokens_kept = count(
            "rollfleet_resume_tokens_kept_total", "Output tokens kept from checkpoints instead of generated again"
        )
        self.tokens_regenerated = count(
            "rollfleet_resume_tokens_regenerated_total", "Checkpointed tokens generated again (checkpoint unusable)"
        )
        self.tokens_generated = count(
            "rollfleet_resumable_tokens_generated_total", "Output tokens this worker generated for resumable jobs"
        )
        self.tokens_checkpointed = count(
            "rollfleet_tokens_checkpointed_total", "Output tokens of resumable jobs stored in checkpoints"
        )
        self.checkpoints = count("rollfleet_checkpoints_total", "Checkpoint records stored")
        self.checkpoint_bytes = count("rollfleet_checkpoint_bytes_total", "Bytes of checkpoint records stored")
        self.superseded = count(
            "rollfleet_superseded_runs_total", "Runs that found their job taken over elsewhere (nothing stored)"
        )
        self.sessions = gauge("rollfleet_sessions", "Sessions whose context the engine holds")
        self.session_cache_bytes = gauge("rollfleet_session_cache_bytes", "Bytes of session contexts held")

    def job(self, outcome: str) -> None:
        self._outcomes.observe(outcome)

    def observe_activation(self, activation: VersionActivated) -> None:
        """What one activation cost, as it was announced."""
        self.prepare.observe(activation.prepare_s)
        self.pause.observe(activation.pause_s)
        self.wire_bytes.inc(activation.wire_bytes)
        self.density.set(activation.density)
        self.activations.inc()
        self.drain.observe(activation.drain_s)

    def observe_turn(self, cached_tokens: int, cache_rebuilt: bool) -> None:
        """A session's turn answered: the prefix it reused, and whether its cache was rebuilt."""
        self.session_turns.inc()
        self.prefix_tokens_reused.inc(cached_tokens)
        if cache_rebuilt:
            self.session_rebuilds.inc()

    def _count_outcome(self, outcome: str) -> None:
        child = self._job_children.get(outcome)
        if child is None:  # one labelled child per outcome, looked up once
            child = self._job_children[outcome] = self._jobs.labels(**self._labels, outcome=outcome)
        child.inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics; port 0 picks a free one. Returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(server.server_address[1])
        self._server = server
        return self.port

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
