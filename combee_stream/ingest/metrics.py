"""Prometheus metrics of the ingest stage: in the engine's registry (and on its ``/metrics``)
when both share a process (``run --ingest otel``); served on ``ingest.metrics_port`` by
``ingest otel`` alone, with the engine's ``/healthz`` and ``/readyz`` (ready: reading)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from combee_stream.http import Health, Receive, Scope, Send, health_app
from combee_stream.ingest.assembler import Rejected, Written
from combee_stream.kafka.dlq import DeadLetter

_ASSEMBLY_BUCKETS: Final = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        self.records_in = Counter(
            "combee_ingest_records", "Telemetry records read", ["topic"], registry=r
        )
        self.spans_in = Counter("combee_ingest_spans", "Spans decoded", registry=r)
        self.open_traces = Gauge(
            "combee_ingest_open_traces", "Traces being assembled (not yet written)", registry=r
        )
        self.orphan_traces = Gauge(
            "combee_ingest_orphan_traces",
            "Open traces with no ended root span yet (ingest.max_orphan_traces bounds them)",
            registry=r,
        )
        self.traces_out = Counter(
            "combee_ingest_traces", "Traces assembled and written to the traces topic", registry=r
        )
        self.assembly = Histogram(
            "combee_ingest_assembly_seconds",
            "From a trace's first span to its being written",
            buckets=_ASSEMBLY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "combee_ingest_rejected",
            "Dead-lettered: undecodable records (decode) and traces or feedback that could "
            "not be assembled or joined (no_root, span_flood, orphan_feedback, ...)",
            ["kind"],
            registry=r,
        )
        self.feedback_joined = Counter(
            "combee_ingest_feedback_joined", "Traces written with feedback", registry=r
        )
        self.without_feedback = Counter(
            "combee_ingest_without_feedback",
            "Traces written without feedback (none came within ingest.feedback_wait_s)",
            registry=r,
        )
        self.evaluation_errors = Counter(
            "combee_ingest_evaluation_errors",
            "gen_ai.evaluation.result events of written traces that gave no result: the "
            "evaluator failed (error) or said nothing (empty); not feedback",
            ["kind"],
            registry=r,
        )
        self.pauses = Counter(
            "combee_ingest_pauses", "Times input paused at ingest.max_open_traces", registry=r
        )
        self.rebalances = Counter(
            "combee_ingest_rebalances",
            "Restarts from the committed offsets on a rebalance",
            registry=r,
        )
        self.health = Health()  # assigned: a session is reading
        self.restarts = Counter(
            "combee_ingest_restarts",
            "Restarts from the committed offsets on a Kafka error",
            registry=r,
        )

    def asgi_app(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        """``/metrics``, ``/healthz`` and ``/readyz``, as the engine serves them."""
        return health_app(self.registry, self.health)

    def observe(self, item: Written | Rejected | DeadLetter) -> None:
        """One item made durable."""
        if isinstance(item, Written):
            self.traces_out.inc()
            self.assembly.observe(item.assembly_s)
            (self.feedback_joined if item.feedback_items else self.without_feedback).inc()
            for error in item.evaluation_errors:
                self.evaluation_errors.labels("empty" if error == "empty" else "error").inc()
        elif isinstance(item, Rejected):
            self.rejected.labels(item.kind).inc()
        else:
            self.rejected.labels("decode").inc()


__all__ = ["IngestMetrics"]
