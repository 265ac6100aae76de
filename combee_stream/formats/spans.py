"""The span model every telemetry format decodes into (OTLP protobuf, OTLP JSON, ...).

A decoder turns one Kafka message into spans and log events; the GenAI mapping
(:mod:`combee_stream.formats.genai`) turns one trace's spans and events into a ``Trace``; the
ingest stage (:mod:`combee_stream.ingest`) sits between them and assembles traces. Ids are
lowercase hex (32 characters for a trace, 16 for a span) whatever the wire carried.
"""

from __future__ import annotations

from typing import Any, Final

from msgspec import Struct

# The GenAI semantic conventions' evaluation result event (a span event or a log record).
EVALUATION_EVENT: Final = "gen_ai.evaluation.result"


class SpanEvent(Struct, frozen=True, kw_only=True):
    """An event of a span, or a log record tied to a span (``gen_ai.*`` events are sent both
    ways): its name, when, and its attributes; a log record's body is kept under ``body``."""

    name: str
    time_ns: int = 0
    attributes: dict[str, Any] = {}
    body: Any = None


class Span(Struct, frozen=True, kw_only=True):
    trace_id: str
    span_id: str
    parent_span_id: str = ""  # "" for a root span
    name: str
    kind: int = 0  # OTLP SpanKind number
    start_ns: int = 0
    end_ns: int = 0  # 0 while not ended (a span is exported only when ended)
    attributes: dict[str, Any] = {}  # values: str, bool, int, float, list of them, or dict
    events: list[SpanEvent] = []
    resource: dict[str, Any] = {}  # the attributes of the span's resource (service.name, ...)
    scope: str = ""  # the instrumentation scope's name
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    status_message: str = ""


class LogEvent(Struct, frozen=True, kw_only=True):
    """A log record that names a trace (evaluation results, message events): the trace it
    belongs to, its span when it names one, and the event itself."""

    trace_id: str
    span_id: str = ""
    event: SpanEvent
    resource: dict[str, Any] = {}


class Telemetry(Struct, frozen=True, kw_only=True):
    """What one Kafka message of a telemetry topic carried."""

    spans: list[Span] = []
    logs: list[LogEvent] = []
    # Evaluation results (feedback) in log records that name no trace: they cannot join one,
    # and feedback is never dropped silently (the stage dead-letters them).
    untraced: list[SpanEvent] = []


__all__ = ["EVALUATION_EVENT", "LogEvent", "Span", "SpanEvent", "Telemetry"]
