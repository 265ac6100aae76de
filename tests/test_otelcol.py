"""Smoke test of the real OpenTelemetry Collector (``tests/otelcol``, see otel_support.py):
spans sent by the OpenTelemetry Python SDK over OTLP/HTTP come out on a Kafka topic of the
test broker, one message per trace, keyed by the trace id, in OTLP protobuf or OTLP JSON.

Needs Go for the first build (``make otelcol-prepare``): skipped without it, failed when CI=true.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Final

import anyio
import otel_support
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import murmur2
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from otel_support import Encoding, Hasher, run_collector

otelcol_binary = otel_support.otelcol_binary  # the session fixture, for this module

PARTITIONS: Final = 3
HEX_TRACE_ID: Final = re.compile(r"^[0-9a-f]{32}$")

Spans = dict[str, list[str]]  # trace id (32 hex) -> span names


async def _create_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()


def _send_spans(http_endpoint: str) -> Spans:
    """Two spans of one trace (a root and its child) and one span of another, exported in one
    OTLP/HTTP request; returns what was sent, by trace id."""
    provider = TracerProvider(resource=Resource.create({"service.name": "combee-otel-smoke"}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{http_endpoint}/v1/traces", timeout=10))
    )
    tracer = provider.get_tracer("combee.test")
    sent: Spans = defaultdict(list)
    with tracer.start_as_current_span("agent.run") as root:
        with tracer.start_as_current_span("llm.chat") as child:
            sent[format(child.get_span_context().trace_id, "032x")].append("llm.chat")
        sent[format(root.get_span_context().trace_id, "032x")].append("agent.run")
    with tracer.start_as_current_span("agent.other") as other:
        sent[format(other.get_span_context().trace_id, "032x")].append("agent.other")
    assert provider.force_flush(timeout_millis=10_000)
    provider.shutdown()
    return dict(sent)


def _expected_partition(key: bytes, hasher: Hasher) -> int:
    """The partition the exporter's sticky-key partitioner picks for ``key``."""
    if hasher == "murmur2":  # as the Java client and aiokafka's default partitioner
        return (int(murmur2(key)) & 0x7FFFFFFF) % PARTITIONS
    digest = 0x811C9DC5  # Sarama's: int32(FNV-1a 32) % n, negated when negative
    for byte in key:
        digest = ((digest ^ byte) * 0x01000193) & 0xFFFFFFFF
    signed = digest - (1 << 32) if digest >= 1 << 31 else digest
    return abs(signed) % PARTITIONS


def _decode(value: bytes, encoding: Encoding) -> list[tuple[str, str]]:
    """(trace id as 32 hex, span name) of every span in one message's value."""
    if encoding == "otlp_proto":
        request = ExportTraceServiceRequest.FromString(value)
        return [
            (span.trace_id.hex(), span.name)
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
    document: dict[str, Any] = json.loads(value)
    found: list[tuple[str, str]] = []
    for resource in document["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                assert HEX_TRACE_ID.match(span["traceId"]), span["traceId"]  # hex, not base64
                found.append((span["traceId"], span["name"]))
    return found


async def _read_spans(
    bootstrap: str, topic: str, encoding: Encoding, expected: int, limit_s: float = 60.0
) -> tuple[Spans, list[Any]]:
    """Spans by trace id from ``topic`` once ``expected`` have arrived, and the records."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
    )
    await consumer.start()
    spans: Spans = defaultdict(list)
    records: list[Any] = []
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        with anyio.move_on_after(limit_s):
            while sum(len(names) for names in spans.values()) < expected:
                for batch in (await consumer.getmany(timeout_ms=500)).values():
                    for record in batch:
                        records.append(record)
                        for trace_id, name in _decode(record.value, encoding):
                            spans[trace_id].append(name)
    finally:
        await consumer.stop()
    return dict(spans), records


@pytest.mark.kafka
@pytest.mark.timeout(900)  # the first build, when `make otelcol-prepare` has not run
@pytest.mark.parametrize(
    ("encoding", "hasher"), [("otlp_proto", "sarama_compat"), ("otlp_json", "murmur2")]
)
def test_collector_writes_sdk_spans_to_kafka_keyed_by_trace(
    otelcol_binary: Path, kafka_bootstrap: str, unique: str, encoding: Encoding, hasher: Hasher
) -> None:
    topic = f"t.otlp.{unique}"
    anyio.run(_create_topic, kafka_bootstrap, topic)
    with run_collector(
        kafka_bootstrap,
        encoding=encoding,
        partition_traces_by_id=True,
        traces_topic=topic,
        hasher=hasher,
        binary=otelcol_binary,
    ) as collector:
        started = time.monotonic()
        sent = _send_spans(collector.http_endpoint)
        got, records = anyio.run(_read_spans, kafka_bootstrap, topic, encoding, 3)
        assert sum(len(names) for names in got.values()) == 3, (got, time.monotonic() - started)

    assert len(sent) == 2 and all(HEX_TRACE_ID.match(trace_id) for trace_id in sent)
    assert {t: sorted(names) for t, names in got.items()} == {
        t: sorted(names) for t, names in sent.items()
    }
    for record in records:
        in_message = {trace_id for trace_id, _ in _decode(record.value, encoding)}
        assert in_message == {record.key.decode()}, (record.key, in_message)
        assert record.partition == _expected_partition(record.key, hasher), record
