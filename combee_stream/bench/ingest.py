"""``bench ingest``: what the ingest stage costs on top of reading the spans topic, and its memory
with many traces open. No LLM is involved.

A fresh spans topic is filled with synthetic agent traces in the GenAI conventions (an
``invoke_agent`` root, two ``chat`` spans with messages and an ``execute_tool`` span; built
with the ``opentelemetry-proto`` classes and serialised as the Collector's ``otlp_proto``, one
message per trace keyed by its hex id as with ``partition_traces_by_id``). Then, in one run:

- a bare aiokafka consumer reads it from the start and parses every message
  (``ExportTraceServiceRequest.FromString``): the floor of any OTLP consumer in Python;
- the ingest stage reads it from the start and writes every trace to the traces topic (decode,
  assembly, mapping, one transaction per flush with the state topic and the offsets); its time
  ends when the last trace is written, so it includes one completion gap (``ingest.gap_s``);
- memory: a second topic holds traces whose root span never comes (the traces stay open); the
  stage reads them until they all are open, and the growth of its resident memory is reported.
"""

from __future__ import annotations

import json
import tracemalloc
import uuid
from typing import Final

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from msgspec import Struct
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from combee_stream.bench.harness import (
    bulk_batch_bytes,
    fresh_topics,
    metric_total,
    rss_mb,
    with_broker,
)
from combee_stream.bench.report import Target, document, table
from combee_stream.config import Config
from combee_stream.ingest import IngestStage
from combee_stream.kafka.client import client_kwargs

_NO_LLM: Final = "No LLM: the ingest stage makes no LLM call; times are real seconds."
SPANS_PER_TRACE: Final = 4


class IngestSettings(Struct, frozen=True, kw_only=True):
    traces: int = 20_000
    open_traces: int = 10_000
    partitions: int = 3
    gap_s: float = 0.5
    seed: int = 0


class IngestReport(Struct, kw_only=True):
    settings: IngestSettings
    bare_wall_s: float
    bare_spans_per_s: float
    ingest_wall_s: float
    ingest_spans_per_s: float
    ingest_traces_per_s: float
    ratio: float  # ingest / bare (spans per second)
    open_traces: int
    rss_before_mb: float
    rss_open_mb: float
    bytes_per_open_trace: float
    targets: list[Target]
    notes: list[str]


def ingest_settings(*, quick: bool = False, seed: int = 0) -> IngestSettings:
    if quick:
        return IngestSettings(traces=2_000, open_traces=2_000, seed=seed)
    return IngestSettings(seed=seed)


def _kv(key: str, value: str | int) -> KeyValue:
    any_value = (
        AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    )
    return KeyValue(key=key, value=any_value)


def _messages(role: str, text: str) -> str:
    return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}])


def synthetic_trace(n: int, *, root: bool = True) -> tuple[bytes, bytes]:
    """(key, value) of one agent run's spans: one ExportTraceServiceRequest keyed by trace id."""
    trace_id = uuid.UUID(int=(n << 64) | 0xC0FFEE).bytes
    ids = [(n * 8 + i + 1).to_bytes(8, "big") for i in range(SPANS_PER_TRACE)]
    t0 = 1_700_000_000_000_000_000 + n * 1_000_000
    question = f"What is the net present value of case {n} at 7 % over 5 years?"
    spans = []
    for i, (name, attrs) in enumerate(
        [
            ("invoke_agent", [_kv("gen_ai.operation.name", "invoke_agent")]),
            (
                "chat",
                [
                    _kv("gen_ai.operation.name", "chat"),
                    _kv("gen_ai.request.model", "model"),
                    _kv("gen_ai.input.messages", _messages("user", question)),
                    _kv("gen_ai.output.messages", _messages("assistant", "I will compute it.")),
                    _kv("gen_ai.usage.input_tokens", 120),
                    _kv("gen_ai.usage.output_tokens", 30),
                ],
            ),
            (
                "execute_tool",
                [
                    _kv("gen_ai.operation.name", "execute_tool"),
                    _kv("gen_ai.tool.name", "calculator"),
                    _kv("gen_ai.tool.call.arguments", '{"expression": "1000 / 1.07 ** 5"}'),
                    _kv("gen_ai.tool.call.result", "712.99"),
                ],
            ),
            (
                "chat",
                [
                    _kv("gen_ai.operation.name", "chat"),
                    _kv("gen_ai.output.messages", _messages("assistant", "712.99")),
                ],
            ),
        ]
    ):
        if i == 0 and not root:
            continue
        spans.append(
            PbSpan(
                trace_id=trace_id,
                span_id=ids[i],
                parent_span_id=b"" if i == 0 else ids[0],
                name=name,
                start_time_unix_nano=t0 + i,
                end_time_unix_nano=t0 + 10 if i == 0 else t0 + i + 1,
                attributes=attrs,
            )
        )
    resource = Resource(attributes=[_kv("service.name", f"agent-{n % 10}")])
    request = ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(spans=spans)])]
    )
    return trace_id.hex().encode(), request.SerializeToString()


async def _fill(config: Config, topic: str, count: int, *, root: bool) -> None:
    kafka = config.kafka
    admin = AIOKafkaAdminClient(**client_kwargs(kafka))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, kafka.partitions, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        **client_kwargs(kafka), linger_ms=20, max_batch_size=bulk_batch_bytes(kafka)
    )
    await producer.start()
    try:
        for start in range(0, count, 2000):
            futures = []
            for n in range(start, min(count, start + 2000)):
                key, value = synthetic_trace(n, root=root)
                futures.append(await producer.send(topic, value=value, key=key))
            for future in futures:
                await future
    finally:
        await producer.stop()


async def _bare(config: Config, topic: str, count: int) -> float:
    consumer = AIOKafkaConsumer(
        **client_kwargs(config.kafka), group_id=None, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(config.kafka.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        seen, started = 0, anyio.current_time()
        while seen < count:
            for batch in (await consumer.getmany(timeout_ms=200, max_records=500)).values():
                for record in batch:
                    ExportTraceServiceRequest.FromString(record.value)
                    seen += 1
        return anyio.current_time() - started
    finally:
        await consumer.stop()


def _stage_config(config: Config, spans_topic: str, **ingest: object) -> Config:
    """A stage reading ``spans_topic`` into topics of its own (the harness's fresh topics)."""
    cfg = fresh_topics(config, "ingest", partitions=config.kafka.partitions)
    run = cfg.kafka.traces_topic.removesuffix(".traces")
    kafka = msgspec.structs.replace(cfg.kafka, feedback_topic=f"{run}.feedback")
    settings = msgspec.structs.replace(
        config.ingest,
        spans_topic=spans_topic,
        logs_topic=f"{run}.logs",
        state_topic=f"{run}.state",
        group_id=f"{run}.group",
        **ingest,
    )
    engine = msgspec.structs.replace(config.engine, metrics_port=0)
    return msgspec.structs.replace(cfg, kafka=kafka, ingest=settings, engine=engine)


async def _through_stage(cfg: Config, until: str, count: int) -> float:
    """Run a stage until its ``until`` metric reaches ``count``; seconds from its start."""
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        started = anyio.current_time()
        metric = getattr(stage.metrics, until)
        with anyio.fail_after(1800):
            while metric_total(metric, "_total") < count:  # noqa: ASYNC110 (polls a metric)
                await anyio.sleep(0.05)
        elapsed = anyio.current_time() - started
        stage.stop()
    return elapsed


async def run_ingest(config: Config, settings: IngestSettings) -> IngestReport:
    config = await with_broker(config)
    s = settings
    run = f"bench.ingest.{uuid.uuid4().hex[:8]}"
    kafka = msgspec.structs.replace(config.kafka, partitions=s.partitions)
    config = msgspec.structs.replace(config, kafka=kafka)
    spans = s.traces * SPANS_PER_TRACE
    # Memory first, in a process the other phases have not grown yet; tracemalloc counts the
    # Python heap the open traces hold (RSS also moves with the allocator's arenas).
    open_spans = s.open_traces * (SPANS_PER_TRACE - 1)
    await _fill(config, f"{run}.open", s.open_traces, root=False)
    cfg = _stage_config(
        config,
        f"{run}.open",
        gap_s=s.gap_s,
        trace_timeout_s=3600.0,
        max_open_traces=s.open_traces + 1,
    )
    before = rss_mb()
    tracemalloc.start()  # from before the stage: its clients' start-up is counted too
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        heap_before = 0
        with anyio.fail_after(1800):
            while metric_total(stage.metrics.spans_in, "_total") < open_spans:  # noqa: ASYNC110
                await anyio.sleep(0.1)
        heap_open = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        opened = int(metric_total(stage.metrics.open_traces))
        rss_open = rss_mb()
        stage.stop()

    await _fill(config, f"{run}.spans", s.traces, root=True)
    bare_s = await _bare(config, f"{run}.spans", s.traces)
    cfg = _stage_config(config, f"{run}.spans", gap_s=s.gap_s)
    ingest_s = await _through_stage(cfg, "traces_out", s.traces)

    ratio = (spans / ingest_s) / (spans / bare_s)
    per_trace = (heap_open - heap_before) / max(1, opened)
    targets = [
        Target(
            name="open traces bounded",
            target=f"{s.open_traces:,} open traces held in memory, none lost",
            measured=f"{opened:,} open, +{rss_open - before:.0f} MiB RSS",
            met=opened == s.open_traces,
        )
    ]
    notes = [
        f"{s.traces:,} traces x {SPANS_PER_TRACE} spans, one otlp_proto message per trace, "
        f"{s.partitions} partitions; ingest.gap_s = {s.gap_s:g} s (the stage's time includes "
        "one gap: a trace is written a gap after its last span).",
        "bare = an aiokafka consumer parsing every message with opentelemetry-proto, nothing "
        "else; ratio = ingest spans/s over bare spans/s.",
        "Memory (measured first, in a fresh process): traces with no root span stay open; "
        "bytes per open trace = Python heap allocated since the stage was created and still "
        "held once every span was read (tracemalloc; its Kafka clients included), over the "
        "open traces; RSS of the whole process (broker clients included) before and "
        "after.",
    ]
    return IngestReport(
        settings=s,
        bare_wall_s=bare_s,
        bare_spans_per_s=spans / bare_s,
        ingest_wall_s=ingest_s,
        ingest_spans_per_s=spans / ingest_s,
        ingest_traces_per_s=s.traces / ingest_s,
        ratio=ratio,
        open_traces=opened,
        rss_before_mb=before,
        rss_open_mb=rss_open,
        bytes_per_open_trace=per_trace,
        targets=targets,
        notes=notes,
    )


def markdown(report: IngestReport) -> str:
    r = report
    body = table(
        ["reader", "wall s", "spans/s", "traces/s"],
        [
            ["bare consumer (parse only)", r.bare_wall_s, r.bare_spans_per_s,
             r.bare_spans_per_s / SPANS_PER_TRACE],
            ["ingest stage", r.ingest_wall_s, r.ingest_spans_per_s, r.ingest_traces_per_s],
        ],
    )  # fmt: skip
    memory = table(
        [
            "open traces",
            "RSS before (MiB)",
            "RSS with them open (MiB)",
            "heap bytes per open trace",
        ],
        [[r.open_traces, r.rss_before_mb, r.rss_open_mb, r.bytes_per_open_trace]],
    )
    preamble = [_NO_LLM, f"ingest / bare consumer (spans/s): {r.ratio:.3f}"]
    return document(
        "Ingest: OpenTelemetry spans to traces",
        preamble,
        body + "\n\n" + memory,
        r.targets,
        r.notes,
        llm="No LLM (the ingest stage makes no LLM call)",
    )


__all__ = ["IngestReport", "IngestSettings", "ingest_settings", "markdown", "run_ingest"]
