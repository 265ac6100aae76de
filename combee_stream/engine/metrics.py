"""Prometheus metrics and health endpoints for one engine (its own registry: no global state)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from combee_stream.http import Health, Receive, Scope, Send, health_app

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


OTHER_KEYS = "(other)"


class KeyLabels:
    """Which keys get metric series of their own: the first ``limit`` seen, until released
    (evicted, revoked); every other key is counted under ``(other)``. So ``/metrics`` stays
    bounded however many keys pass through an instance."""

    def __init__(self, limit: int, per_key: list[Any]) -> None:
        self.limit = limit
        self._per_key = per_key  # the metrics labelled by key
        self._labelled: set[str] = set()

    def label(self, key: str) -> str:
        if key in self._labelled:
            return key
        if len(self._labelled) < self.limit:
            self._labelled.add(key)
            return key
        return OTHER_KEYS

    def release(self, key: str) -> None:
        if key in self._labelled:
            self._labelled.discard(key)
            for metric in self._per_key:
                try:
                    metric.remove(key)
                except KeyError:
                    pass  # this key had no sample in that metric


class EngineMetrics:
    def __init__(self, key_series: int = 100) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.traces_in = Counter(
            "combee_traces_in", "Trace records read", ["partition"], registry=r
        )
        self.traces_skipped = Counter(
            "combee_traces_skipped",
            "Traces already learned (at or below the watermark)",
            registry=r,
        )
        self.traces_duplicate = Counter(
            "combee_traces_duplicate",
            "Traces skipped because their key had already seen their trace id",
            registry=r,
        )
        self.dlq = Counter("combee_dlq", "Records parked in the DLQ", ["stage"], registry=r)
        self.windows = Counter("combee_windows", "Windows published", ["key"], registry=r)
        self.window_failures = Counter(
            "combee_window_failures", "Windows that failed and were retried", ["key"], registry=r
        )
        self.batch_size = Gauge("combee_batch_size", "Controller batch size", ["key"], registry=r)
        self.playbook_bullets = Gauge(
            "combee_playbook_bullets", "Bullets in the newest playbook", ["key"], registry=r
        )
        self.playbook_tokens = Gauge(
            "combee_playbook_tokens", "Tokens in the newest playbook", ["key"], registry=r
        )
        self.prompt_version = Gauge(
            "combee_prompt_version", "Newest published version", ["key"], registry=r
        )
        self.trace_to_publish = Histogram(
            "combee_trace_to_publish_seconds",
            "From reading a trace to publishing the version that learned it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.publish_lag = Histogram(
            "combee_window_seconds",
            "From a window closing to its version being published",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.consumer_lag = Gauge(
            "combee_consumer_lag",
            "High watermark minus committed offset",
            ["partition"],
            registry=r,
        )
        self.buffered = Gauge("combee_buffered_traces", "Traces read, not yet done", registry=r)
        self.backpressure_pauses = Counter(
            "combee_backpressure_pauses", "Times intake paused at engine.queue_size", registry=r
        )
        self.llm_calls = Gauge("combee_llm_calls", "LLM calls", ["role"], registry=r)
        self.llm_tokens = Gauge(
            "combee_llm_tokens",
            "LLM tokens, by direction: in, out, cached (prompt tokens the server served from "
            "its prompt cache, a subset of in)",
            ["role", "direction"],
            registry=r,
        )
        self.llm_bad_replies = Gauge(
            "combee_llm_bad_replies",
            "LLM replies that could not be used, by kind: invalid (failed the schema), "
            "truncated (cut at max_tokens)",
            ["role", "kind"],
            registry=r,
        )
        self.llm_cost = Gauge("combee_llm_cost_usd", "LLM cost", ["role"], registry=r)
        self.llm_latency = Gauge(
            "combee_llm_latency_seconds_total", "Summed LLM call time", ["role"], registry=r
        )
        self.broker_failures = Counter(
            "combee_broker_failures",
            "Failed attempts to write (publish, dlq, commit, label) or read (restore) Kafka",
            ["op"],
            registry=r,
        )
        self.gate_reviews = Counter(
            "combee_gate_reviews",
            "Candidates the publish gate reviewed, by gate and outcome (accepted, rejected; "
            "stopped: a canary whose live scores could not be trusted)",
            ["gate", "outcome"],
            registry=r,
        )
        self.live_traces = Counter(
            "combee_live_traces",
            "Scored traces read for the live canary and rollback, by outcome: sample; forged "
            "(its session's arm is served another version); unattributed (no session); "
            "no_version (names none)",
            ["outcome"],
            registry=r,
        )
        self.held_out = Counter(
            "combee_held_out_traces", "Traces kept out of learning as held-out tasks", registry=r
        )
        self.health = Health()
        self.keys = KeyLabels(
            key_series,
            [
                self.windows,
                self.batch_size,
                self.playbook_bullets,
                self.playbook_tokens,
                self.prompt_version,
            ],
        )

    @property
    def ready(self) -> bool:
        return self.health.ready

    def asgi_app(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        """``/metrics``, ``/healthz`` (the process runs) and ``/readyz`` (assigned and restored)."""
        return health_app(self.registry, self.health)


__all__ = ["OTHER_KEYS", "EngineMetrics", "KeyLabels"]
