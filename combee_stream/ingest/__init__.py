"""Ingest: agent telemetry (OpenTelemetry spans, log events, late feedback) assembled into
native traces and re-keyed by prompt key into the traces topic, exactly once.

``assembler`` holds the logic (no Kafka), ``stage`` the consume-transform-produce loop,
``cli`` the ``combee-stream ingest otel`` command.
"""

from __future__ import annotations

from combee_stream.ingest.assembler import Assembler, combine_feedback
from combee_stream.ingest.metrics import IngestMetrics
from combee_stream.ingest.stage import IngestStage

__all__ = ["Assembler", "IngestMetrics", "IngestStage", "combine_feedback"]
