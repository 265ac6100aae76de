"""An instrumented agent for tests, and the OTLP encodings the Collector's kafka exporter writes.

``await run_agent(sim.base_url, "What is 6 * 7?", key="calc-bot")`` runs a small agent with the
real OpenTelemetry SDK: an ``invoke_agent`` span around two chat completions of the real
``openai`` client (instrumented by ``opentelemetry-instrumentation-openai-v2``) against the
simulator, with an ``execute_tool`` span between them. It returns the finished spans. Then:

- ``encode_proto(spans)`` / ``encode_json(spans)``: one ``ExportTraceServiceRequest`` as the
  kafka exporter's ``otlp_proto`` / ``otlp_json`` encodings write it (the SDK's own OTLP
  encoder; JSON with hex ids and numeric enums, as the Collector writes);
- ``per_trace_slices(spans, encoding)``: ``(key, value)`` records, one request per trace id keyed
  by its hex id, as the exporter writes with ``partition_traces_by_id``;
- ``evaluation_records(span, ...)`` + ``encode_logs_proto`` / ``encode_logs_json``:
  ``gen_ai.evaluation.result`` log records emitted through the SDK's LoggerProvider.

Content capture is set with the instrumentation's own environment variables for the run only.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import openai
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanKind, Status, StatusCode

from combee_stream.formats.otlp import Encoding
from combee_stream.otel import PromptSpanProcessor
from combee_stream.sim.app import CHAT_MODEL

CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
SEMCONV_ENV = "OTEL_SEMCONV_STABILITY_OPT_IN"
TOOL_CALL_ID = "call_calc_1"
TOOL_RESULT = "42"
TOOL_ARGUMENTS = {"expression": "6 * 7"}


class SpanCollector(SpanExporter):
    """Keeps every finished span (``SimpleSpanProcessor`` exports each as it ends)."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def tracer_provider(
    *, service_name: str = "otel-agent", processors: Sequence[Any] = ()
) -> tuple[TracerProvider, SpanCollector]:
    """A provider of its own (never the global one) that collects its spans."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    for processor in processors:
        provider.add_span_processor(processor)
    collector = SpanCollector()
    provider.add_span_processor(SimpleSpanProcessor(collector))
    return provider, collector


@contextlib.contextmanager
def _env(values: Mapping[str, str | None]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


Capture = Literal["span_only", "event_only", "span_and_event"]


@contextlib.contextmanager
def instrumented(
    provider: TracerProvider,
    *,
    capture: Capture | None,
    logger_provider: LoggerProvider | None = None,
) -> Iterator[None]:
    """The openai client instrumented for the block, capturing message content on spans, in
    ``gen_ai.client.inference.operation.details`` log events, or both (None: not at all). The
    instrumentation reads its settings when it instruments, and its instrumentor is a
    singleton: one block at a time."""
    settings = {
        SEMCONV_ENV: "gen_ai_latest_experimental",  # writes gen_ai.input/output.messages
        CAPTURE_ENV: capture,
    }
    with _env(settings):
        instrumentor = OpenAIInstrumentor()
        instrumentor.instrument(tracer_provider=provider, logger_provider=logger_provider)
        try:
            yield
        finally:
            instrumentor.uninstrument()


def question(task: str) -> str:
    """The user message the agent sends: the simulator's agent answers a ``<question>``."""
    return f"<question>\n{task}\n</question>"


def _messages_attribute(role: str, text: str) -> str:
    return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}])


@dataclass(frozen=True)
class AgentRun:
    spans: list[ReadableSpan]
    task: str  # the agent's input (what the trace's task should be)
    output: str  # the agent's final answer
    trace_id: str  # hex
    logs: list[ReadableLogRecord] = field(default_factory=list)  # event_only capture

    @property
    def root(self) -> ReadableSpan:
        return next(span for span in self.spans if span.parent is None)


async def run_agent(
    base_url: str,
    task: str,
    key: str | None = None,
    *,
    version: int = 0,
    agent_name: str | None = "calc-agent",
    service_name: str = "otel-agent",
    capture_content: bool | Capture = True,
    tool: bool = True,
    conversation_id: str | None = None,
    bullet_ids: Sequence[str] = (),
    system_prompt: str = "You are a careful calculator agent.",
    agent_messages: bool = True,
) -> AgentRun:
    """One agent run against the simulator at ``base_url``: ``invoke_agent`` > ``chat``,
    ``execute_tool`` (with ``tool``), ``chat``. With ``key``, a :class:`PromptSpanProcessor`
    stamps ``key`` and ``version`` on every span; ``bullet_ids`` go on the root span. With
    ``agent_messages`` (and content capture) the root carries the agent's own input (``task``)
    and output (the final answer) as ``gen_ai.input/output.messages``, as agent frameworks
    write them; without, only the chat spans carry messages. ``capture_content`` True is
    ``"span_only"``; with ``"event_only"`` the chat messages are in ``AgentRun.logs``."""
    capture: Capture | None = "span_only" if capture_content is True else capture_content or None
    on_spans = capture in ("span_only", "span_and_event")
    logger_provider = LoggerProvider(resource=Resource.create({"service.name": service_name}))
    log_exporter = InMemoryLogRecordExporter()
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(log_exporter))
    processors = [PromptSpanProcessor(key, lambda: version)] if key is not None else []
    provider, collector = tracer_provider(service_name=service_name, processors=processors)
    tracer = provider.get_tracer("tests.otel_agent")
    user_message = question(task)
    attributes: dict[str, Any] = {"gen_ai.operation.name": "invoke_agent"}
    if agent_name is not None:
        attributes["gen_ai.agent.name"] = agent_name
    if conversation_id is not None:
        attributes["gen_ai.conversation.id"] = conversation_id
    span_name = f"invoke_agent {agent_name}" if agent_name else "invoke_agent"
    with instrumented(provider, capture=capture, logger_provider=logger_provider):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="sim", max_retries=0)
        try:
            with tracer.start_as_current_span(
                span_name, kind=SpanKind.INTERNAL, attributes=attributes
            ) as root:
                if on_spans and agent_messages:
                    root.set_attribute("gen_ai.input.messages", _messages_attribute("user", task))
                messages: list[Any] = [
                    {"role": "system", "content": system_prompt},
                    {"role": "user", "content": user_message},
                ]
                reply = await client.chat.completions.create(model=CHAT_MODEL, messages=messages)
                content = reply.choices[0].message.content or ""
                if tool:
                    with tracer.start_as_current_span(
                        "execute_tool calculator",
                        kind=SpanKind.INTERNAL,
                        attributes={
                            "gen_ai.operation.name": "execute_tool",
                            "gen_ai.tool.name": "calculator",
                            "gen_ai.tool.type": "function",
                            "gen_ai.tool.call.id": TOOL_CALL_ID,
                        },
                    ) as tool_span:
                        if capture:  # arguments and results are opt-in content too
                            tool_span.set_attribute(
                                "gen_ai.tool.call.arguments", json.dumps(TOOL_ARGUMENTS)
                            )
                            tool_span.set_attribute("gen_ai.tool.call.result", TOOL_RESULT)
                    messages += [
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": TOOL_CALL_ID,
                                    "type": "function",
                                    "function": {
                                        "name": "calculator",
                                        "arguments": json.dumps(TOOL_ARGUMENTS),
                                    },
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": TOOL_RESULT},
                    ]
                    reply = await client.chat.completions.create(
                        model=CHAT_MODEL, messages=messages
                    )
                    content = reply.choices[0].message.content or ""
                output = str(json.loads(content)["final_answer"])
                if on_spans and agent_messages:
                    root.set_attribute(
                        "gen_ai.output.messages", _messages_attribute("assistant", output)
                    )
                if bullet_ids:
                    root.set_attribute("combee.bullet_ids", list(bullet_ids))
                trace_id = format(root.get_span_context().trace_id, "032x")
        finally:
            await client.close()
    provider.shutdown()
    logger_provider.shutdown()
    logs = list(log_exporter.get_finished_logs())
    return AgentRun(list(collector.spans), task, output, trace_id, logs)


def openinference_run(task: str, *, service_name: str = "oi-agent") -> AgentRun:
    """An agent traced by hand with OpenInference attributes (as its instrumentations write
    them): AGENT > LLM (requests a tool call), TOOL, LLM (answers)."""
    provider, collector = tracer_provider(service_name=service_name)
    tracer = provider.get_tracer("openinference.instrumentation.test")
    arguments = json.dumps(TOOL_ARGUMENTS)
    with tracer.start_as_current_span(
        "agent",
        attributes={
            "openinference.span.kind": "AGENT",
            "input.value": task,
            "session.id": "session-7",
            "agent.name": "oi-calc",
        },
    ) as root:
        with tracer.start_as_current_span(
            "ChatCompletion",
            attributes={
                "openinference.span.kind": "LLM",
                "llm.model_name": "gpt-4o-mini",
                "llm.input_messages.0.message.role": "system",
                "llm.input_messages.0.message.content": "You are a calculator agent.",
                "llm.input_messages.1.message.role": "user",
                "llm.input_messages.1.message.content": task,
                "llm.output_messages.0.message.role": "assistant",
                "llm.output_messages.0.message.content": "I will use the calculator.",
                "llm.output_messages.0.message.tool_calls.0.tool_call.id": TOOL_CALL_ID,
                "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "calculator",
                "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": (
                    arguments
                ),
                "llm.token_count.prompt": 30,
                "llm.token_count.completion": 12,
            },
        ):
            pass
        with tracer.start_as_current_span(
            "calculator",
            attributes={
                "openinference.span.kind": "TOOL",
                "tool.name": "calculator",
                "tool.parameters": '{"type": "object"}',  # the tool's schema, not the call
                "input.value": arguments,
                "output.value": TOOL_RESULT,
            },
        ):
            pass
        with tracer.start_as_current_span(
            "ChatCompletion",
            attributes={
                "openinference.span.kind": "LLM",
                "llm.model_name": "gpt-4o-mini",
                "llm.input_messages.0.message.role": "user",
                "llm.input_messages.0.message.content": task,
                "llm.input_messages.1.message.role": "tool",
                "llm.input_messages.1.message.tool_call_id": TOOL_CALL_ID,
                "llm.input_messages.1.message.content": TOOL_RESULT,
                "llm.output_messages.0.message.role": "assistant",
                "llm.output_messages.0.message.contents.0.message_content.type": "text",
                "llm.output_messages.0.message.contents.0.message_content.text": "It is 42.",
                "llm.token_count.prompt": 50,
                "llm.token_count.completion": 5,
            },
        ):
            pass
        root.set_attribute("output.value", "42")
        root.set_status(Status(StatusCode.OK))
        trace_id = format(root.get_span_context().trace_id, "032x")
    provider.shutdown()
    return AgentRun(list(collector.spans), task, "42", trace_id)


# --------------------------------------------------------------------------- encodings


def _hex_ids(document: Any) -> Any:
    """protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants trace/span ids in hex."""
    if isinstance(document, list):
        return [_hex_ids(item) for item in document]
    if not isinstance(document, dict):
        return document
    out = {}
    for name, value in document.items():
        if name in ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"):
            out[name] = base64.b64decode(value).hex()
        else:
            out[name] = _hex_ids(value)
    return out


def to_json(request: Message, *, snake_case: bool = False) -> bytes:
    """A request in the OTLP/JSON encoding the Collector writes (numeric enums, hex ids);
    ``snake_case`` keys (proto field names) as some other writers use."""
    document = MessageToDict(
        request, use_integers_for_enums=True, preserving_proto_field_name=snake_case
    )
    return json.dumps(_hex_ids(document)).encode()


def encode_proto(spans: Sequence[ReadableSpan]) -> bytes:
    return encode_spans(spans).SerializeToString()


def encode_json(spans: Sequence[ReadableSpan], *, snake_case: bool = False) -> bytes:
    return to_json(encode_spans(spans), snake_case=snake_case)


def encode(spans: Sequence[ReadableSpan], encoding: Encoding) -> bytes:
    return encode_proto(spans) if encoding == "otlp_proto" else encode_json(spans)


def per_trace_slices(
    spans: Sequence[ReadableSpan], encoding: Encoding = "otlp_proto"
) -> list[tuple[bytes, bytes]]:
    """``(key, value)`` Kafka records: one request per trace id, keyed by the hex trace id, in
    first-seen order (what the kafka exporter writes with ``partition_traces_by_id``)."""
    by_trace: dict[int, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        by_trace[span.get_span_context().trace_id].append(span)
    return [
        (format(trace_id, "032x").encode(), encode(group, encoding))
        for trace_id, group in by_trace.items()
    ]


def evaluation_records(
    span: ReadableSpan | None,
    *,
    name: str,
    score: float | None = None,
    label: str | None = None,
    explanation: str | None = None,
    error_type: str | None = None,
    service_name: str = "evaluator",
) -> list[ReadableLogRecord]:
    """One ``gen_ai.evaluation.result`` event emitted through the SDK's LoggerProvider, tied to
    ``span`` (its trace and span ids), or to no trace when ``span`` is None."""
    provider = LoggerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = InMemoryLogRecordExporter()
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    attributes: dict[str, Any] = {"gen_ai.evaluation.name": name}
    if score is not None:
        attributes["gen_ai.evaluation.score.value"] = score
    if label is not None:
        attributes["gen_ai.evaluation.score.label"] = label
    if explanation is not None:
        attributes["gen_ai.evaluation.explanation"] = explanation
    if error_type is not None:  # the evaluator failed (no result)
        attributes["error.type"] = error_type
    context = (
        trace.set_span_in_context(NonRecordingSpan(span.get_span_context()))
        if span is not None
        else None
    )
    provider.get_logger("tests.otel_agent.evaluator").emit(
        event_name="gen_ai.evaluation.result", attributes=attributes, context=context
    )
    provider.shutdown()
    return list(exporter.get_finished_logs())


def encode_logs_proto(records: Sequence[ReadableLogRecord]) -> bytes:
    return encode_logs(records).SerializeToString()


def encode_logs_json(records: Sequence[ReadableLogRecord]) -> bytes:
    return to_json(encode_logs(records))


__all__ = [
    "TOOL_ARGUMENTS",
    "TOOL_CALL_ID",
    "TOOL_RESULT",
    "AgentRun",
    "Capture",
    "SpanCollector",
    "encode",
    "encode_json",
    "encode_logs_json",
    "encode_logs_proto",
    "encode_proto",
    "evaluation_records",
    "instrumented",
    "openinference_run",
    "per_trace_slices",
    "question",
    "run_agent",
    "to_json",
    "tracer_provider",
]
