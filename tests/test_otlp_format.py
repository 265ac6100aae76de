"""OTLP decoding and the GenAI/OpenInference mapping, on spans of the real OpenTelemetry SDK.

The agent runs are real: the ``openai`` client instrumented by
``opentelemetry-instrumentation-openai-v2`` calls the simulator, and the spans are encoded by
the SDK's own OTLP encoder (``tests/otel_agent.py``). No protobuf bytes are written by hand.
"""

from __future__ import annotations

import datetime as dt
import json
import random

import anyio
import msgspec
import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext
from otel_agent import (
    TOOL_ARGUMENTS,
    TOOL_CALL_ID,
    TOOL_RESULT,
    AgentRun,
    encode,
    encode_json,
    encode_logs_json,
    encode_logs_proto,
    encode_proto,
    evaluation_records,
    openinference_run,
    per_trace_slices,
    question,
    run_agent,
    tracer_provider,
)

from combee_stream.config import IngestConfig
from combee_stream.errors import DecodeError
from combee_stream.formats.feedback import evaluation_errors, evaluations
from combee_stream.formats.genai import NOT_CAPTURED_TASK, prompt_key, root_span, trace_from_spans
from combee_stream.formats.otlp import Encoding, decode_telemetry
from combee_stream.formats.spans import LogEvent, Span, SpanEvent
from combee_stream.otel import PromptSpanProcessor
from combee_stream.schemas import Feedback, Trace
from combee_stream.sim import SimSettings, sim_server
from combee_stream.sim.tasks import sim_tasks, task_code, wrong_code

SEED = 5
TASK = sim_tasks(1, keys=1, lessons=1, seed=SEED)[0]
# The simulated agent's prompt lacks the task's lesson: it answers another code.
ANSWER = str(wrong_code(task_code(SEED, TASK.metadata["lesson"])))
FEEDBACK = Feedback(passed=False, ground_truth=TASK.answer)
SETTINGS = IngestConfig()


@pytest.fixture(scope="module")
def runs() -> dict[str, AgentRun]:
    """The agent runs the tests read, against one simulator."""

    async def run_all() -> dict[str, AgentRun]:
        async with sim_server(SimSettings(seed=SEED)) as sim:
            url = sim.base_url
            return {
                "captured": await run_agent(
                    url,
                    TASK.question,
                    key="calc-bot",
                    version=3,
                    bullet_ids=["calc-00001", "calc-00004"],
                    conversation_id="conv-9",
                ),
                "bare": await run_agent(
                    url, TASK.question, key="calc-bot", version=2, capture_content=False
                ),
                "unkeyed": await run_agent(url, TASK.question),
                "events": await run_agent(
                    url,
                    TASK.question,
                    key="calc-bot",
                    capture_content="event_only",
                    agent_messages=False,
                ),
                "anonymous": await run_agent(
                    url,
                    TASK.question,
                    agent_name=None,
                    service_name="anon-svc",
                    tool=False,
                    agent_messages=False,
                ),
            }

    return anyio.run(run_all)


def spans_of(run: AgentRun, encoding: Encoding = "otlp_proto") -> list[Span]:
    value = encode(run.spans, encoding)
    return decode_telemetry(value, encoding, "traces").spans


def trace_of(run: AgentRun, settings: IngestConfig = SETTINGS) -> Trace:
    return trace_from_spans(spans_of(run), [], settings, feedback=FEEDBACK)


# --------------------------------------------------------------------------- decoding


def test_proto_and_json_decode_to_the_same_spans(runs: dict[str, AgentRun]) -> None:
    run = runs["captured"]
    from_proto = spans_of(run, "otlp_proto")
    assert from_proto == spans_of(run, "otlp_json")
    assert len(from_proto) == len(run.spans) == 4
    by_id = {format(s.get_span_context().span_id, "016x"): s for s in run.spans}
    for span in from_proto:
        sdk = by_id[span.span_id]
        assert span.trace_id == run.trace_id
        assert span.name == sdk.name
        assert (span.start_ns, span.end_ns) == (sdk.start_time, sdk.end_time)
        parent = sdk.parent
        assert span.parent_span_id == (format(parent.span_id, "016x") if parent else "")
        assert span.resource["service.name"] == "otel-agent"
        assert span.attributes["combee.prompt.key"] == "calc-bot"
    chat = next(s for s in from_proto if s.name == "chat sim-llm")
    assert chat.kind == 3  # SPAN_KIND_CLIENT
    assert isinstance(chat.attributes["gen_ai.usage.input_tokens"], int)
    assert chat.attributes["gen_ai.response.finish_reasons"] == ["stop"]  # arrays as lists


def test_json_with_snake_case_keys_decodes_the_same(runs: dict[str, AgentRun]) -> None:
    run = runs["captured"]
    value = encode_json(run.spans, snake_case=True)
    assert b'"resource_spans"' in value and b'"trace_id"' in value
    assert decode_telemetry(value, "otlp_json", "traces").spans == spans_of(run)


def test_json_reads_base64_ids_too(runs: dict[str, AgentRun]) -> None:
    """protobuf's plain JSON mapping (base64 ids), which some exporters write."""
    run = runs["captured"]
    plain = json.dumps(MessageToDict(encode_spans(run.spans))).encode()
    assert decode_telemetry(plain, "otlp_json", "traces").spans == spans_of(run)


@pytest.mark.parametrize("cut", [1, 7, 0.5, 0.9])
def test_truncated_protobuf_is_rejected(runs: dict[str, AgentRun], cut: float) -> None:
    value = encode_proto(runs["captured"].spans)
    end = len(value) - cut if isinstance(cut, int) else int(len(value) * cut)
    with pytest.raises(DecodeError, match=r"OTLP protobuf|carries no span|-byte"):
        decode_telemetry(value[:end], "otlp_proto", "traces")


def test_wrong_encoding_is_rejected(runs: dict[str, AgentRun]) -> None:
    spans = runs["captured"].spans
    with pytest.raises(DecodeError):
        decode_telemetry(encode_json(spans), "otlp_proto", "traces")
    with pytest.raises(DecodeError, match="not OTLP JSON"):
        decode_telemetry(encode_proto(spans), "otlp_json", "traces")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("encoding", ["otlp_proto", "otlp_json"])
def test_random_bytes_are_rejected(seed: int, encoding: Encoding) -> None:
    value = random.Random(seed).randbytes(64 + 40 * seed)
    with pytest.raises(DecodeError):
        decode_telemetry(value, encoding, "traces")
    with pytest.raises(DecodeError):
        decode_telemetry(value, encoding, "logs")


def test_empty_and_wrong_signal_are_rejected(runs: dict[str, AgentRun]) -> None:
    with pytest.raises(DecodeError, match="empty value"):
        decode_telemetry(b"", "otlp_proto", "traces")
    with pytest.raises(DecodeError, match="carries no span"):
        decode_telemetry(b"{}", "otlp_json", "traces")
    records = evaluation_records(runs["captured"].spans[0], name="accuracy", score=1.0)
    with pytest.raises(DecodeError, match="OTLP JSON logs, not traces"):
        decode_telemetry(encode_logs_json(records), "otlp_json", "traces")
    with pytest.raises(DecodeError, match="OTLP protobuf traces, not logs"):
        decode_telemetry(encode_proto(runs["captured"].spans), "otlp_proto", "logs")


# A log record's trace id (field 9, bytes) is read as a span's attributes (field 9, KeyValues):
# this id is a valid KeyValue (0x0a 0x0e: a 14-byte key), so protobuf parses the logs request
# as traces; the other, like most random ids, does not parse. Fixed ids: both cases every run.
@pytest.mark.parametrize(
    "trace_id",
    [0x0A0E6162636465666768696A6B6C6D6E, 0x0123456789ABCDEF0123456789ABCDEF],
    ids=["parses-as-traces", "does-not-parse"],
)
def test_logs_protobuf_on_the_spans_topic_is_named_whatever_its_ids(trace_id: int) -> None:
    judged = ReadableSpan(name="judged", context=SpanContext(trace_id, 0x1122334455667788, False))
    value = encode_logs_proto(evaluation_records(judged, name="accuracy", score=1.0))
    assert decode_telemetry(value, "otlp_proto", "logs").logs[0].trace_id == f"{trace_id:032x}"
    with pytest.raises(DecodeError, match=r"^OTLP protobuf logs, not traces: read from the wrong"):
        decode_telemetry(value, "otlp_proto", "traces")


def test_bad_ids_are_rejected(runs: dict[str, AgentRun]) -> None:
    request = encode_spans(runs["captured"].spans)
    request.resource_spans[0].scope_spans[0].spans[0].trace_id = bytes(range(12))
    with pytest.raises(DecodeError, match="span 0 has a 12-byte trace id"):
        decode_telemetry(request.SerializeToString(), "otlp_proto", "traces")
    document = json.loads(encode_json(runs["captured"].spans))
    document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["spanId"] = "not-an-id!"
    with pytest.raises(DecodeError, match="spanId 'not-an-id!' is neither hex nor base64"):
        decode_telemetry(json.dumps(document).encode(), "otlp_json", "traces")


# --------------------------------------------------------------------------- mapping


def test_instrumented_agent_maps_to_a_trace(runs: dict[str, AgentRun]) -> None:
    run = runs["captured"]
    spans = spans_of(run)
    trace = trace_of(run)
    assert trace.key == "calc-bot"  # combee.prompt.key, stamped by PromptSpanProcessor
    assert trace.prompt_version == 3
    assert trace.trace_id == run.trace_id
    assert trace.task == TASK.question  # the agent span's input, not the system prompt
    assert trace.output == ANSWER  # the agent span's output message
    assert trace.feedback == FEEDBACK
    assert [(s.kind, s.name) for s in trace.steps] == [
        ("message", None),
        ("tool_call", "calculator"),
        ("observation", "calculator"),
        ("message", None),
    ]
    assert json.loads(trace.steps[0].content)["final_answer"] == ANSWER  # the chat's reply
    assert json.loads(trace.steps[1].content) == TOOL_ARGUMENTS
    assert trace.steps[2].content == TOOL_RESULT
    assert trace.bullet_ids == ["calc-00001", "calc-00004"]
    root = root_span(spans)
    assert root is not None and root.name == "invoke_agent calc-agent"
    assert trace.started_at is not None and trace.finished_at is not None
    # A datetime holds whole microseconds: the span's nanoseconds, truncated (compared as
    # integers: as float seconds near 1.8e9 a truncated microsecond can look like more than 1e-6).
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    micro = dt.timedelta(microseconds=1)
    assert (trace.started_at - epoch) // micro == root.start_ns // 1000
    assert (trace.finished_at - epoch) // micro == root.end_ns // 1000
    chats = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(chats) == 2
    tokens_in = sum(s.attributes["gen_ai.usage.input_tokens"] for s in chats)
    tokens_out = sum(s.attributes["gen_ai.usage.output_tokens"] for s in chats)
    assert trace.metadata == {
        "source": "otlp",
        "content_captured": "true",
        "agent": "calc-agent",
        "conversation": "conv-9",
        "model": "sim-llm",
        "tokens_in": str(tokens_in),
        "tokens_out": str(tokens_out),
    }


def test_without_agent_messages_the_chat_spans_give_task_and_output(
    runs: dict[str, AgentRun],
) -> None:
    run = runs["anonymous"]  # no gen_ai.input/output.messages on the agent span, no tool
    trace = trace_of(run)
    assert trace.task == question(TASK.question)  # the chat's user message, not its system one
    assert json.loads(trace.output)["final_answer"] == ANSWER  # the last chat reply
    assert [s.kind for s in trace.steps] == ["message"]


def test_messages_sent_as_log_events_join_their_spans(runs: dict[str, AgentRun]) -> None:
    """``event_only`` capture: the chat messages travel in ``operation.details`` log records."""
    run = runs["events"]
    spans = spans_of(run)
    assert not any("gen_ai.input.messages" in s.attributes for s in spans)
    logs = decode_telemetry(encode_logs_proto(run.logs), "otlp_proto", "logs").logs
    assert [log.event.name for log in logs] == ["gen_ai.client.inference.operation.details"] * 2
    chats = [s.span_id for s in spans if s.name == "chat sim-llm"]
    assert [log.span_id for log in logs] == chats
    assert decode_telemetry(encode_logs_json(run.logs), "otlp_json", "logs").logs == logs
    trace = trace_from_spans(spans, logs, SETTINGS, feedback=FEEDBACK)
    assert trace.task == question(TASK.question)
    assert [(s.kind, s.name) for s in trace.steps] == [
        ("message", None),
        ("tool_call", "calculator"),
        ("observation", "calculator"),
        ("message", None),
    ]
    assert json.loads(trace.output)["final_answer"] == ANSWER
    assert trace.metadata["content_captured"] == "true"
    without_logs = trace_from_spans(spans, [], SETTINGS, feedback=FEEDBACK)
    assert without_logs.task == NOT_CAPTURED_TASK


def test_key_falls_back_to_agent_name_then_service_name(runs: dict[str, AgentRun]) -> None:
    assert trace_of(runs["unkeyed"]).key == "calc-agent"  # gen_ai.agent.name
    assert trace_of(runs["unkeyed"]).prompt_version is None  # not said: no version, not 0
    assert trace_of(runs["anonymous"]).key == "anon-svc"  # the resource's service.name
    assert prompt_key(spans_of(runs["captured"]), SETTINGS) == "calc-bot"
    only_service = IngestConfig(key_attributes=["service.name"])
    assert prompt_key(spans_of(runs["captured"]), only_service) == "otel-agent"
    nothing = IngestConfig(key_attributes=["no.such.attribute"])
    assert prompt_key(spans_of(runs["captured"]), nothing) is None
    with pytest.raises(DecodeError, match=r"no prompt key: none of no\.such\.attribute"):
        trace_of(runs["captured"], nothing)


def test_content_not_captured_gives_a_placeholder_trace(runs: dict[str, AgentRun]) -> None:
    spans = spans_of(runs["bare"])
    assert not any("gen_ai.input.messages" in s.attributes for s in spans)
    trace = trace_of(runs["bare"])
    assert trace.task == NOT_CAPTURED_TASK
    assert trace.metadata["content_captured"] == "false"
    assert trace.output == ""
    assert [(s.kind, s.content) for s in trace.steps] == [
        ("action", "chat sim-llm (content not captured)"),
        ("tool_call", "(arguments not captured)"),
        ("observation", "(result not captured)"),
        ("action", "chat sim-llm (content not captured)"),
    ]
    assert trace.key == "calc-bot" and trace.prompt_version == 2
    assert int(trace.metadata["tokens_in"]) > 0  # usage is not content: still there


def test_step_contents_are_cut(runs: dict[str, AgentRun]) -> None:
    trace = trace_of(runs["captured"], IngestConfig(max_step_chars=12))
    assert all(len(step.content) <= 12 for step in trace.steps)
    assert trace.steps[0].content.endswith("…")
    assert trace.steps[2].content == TOOL_RESULT  # short enough: whole


def test_openinference_spans_map() -> None:
    run = openinference_run("What is 6 * 7?")
    spans = decode_telemetry(encode_json(run.spans), "otlp_json", "traces").spans
    trace = trace_from_spans(spans, [], SETTINGS, feedback=FEEDBACK)
    assert trace.key == "oi-agent"  # no combee or gen_ai key: service.name
    assert trace.task == "What is 6 * 7?"  # the AGENT span's input.value
    assert trace.output == "42"
    assert [(s.kind, s.name, s.content) for s in trace.steps] == [
        ("message", None, "I will use the calculator."),
        ("tool_call", "calculator", json.dumps(TOOL_ARGUMENTS)),  # requested by the LLM
        ("observation", "calculator", TOOL_RESULT),  # the TOOL span's output.value
        ("message", None, "It is 42."),
    ]
    assert trace.metadata["tokens_in"] == "80" and trace.metadata["tokens_out"] == "17"
    assert trace.metadata["conversation"] == "session-7"
    assert trace.metadata["agent"] == "oi-calc"
    assert trace.metadata["model"] == "gpt-4o-mini"


def _manual_spans(build: str) -> list[Span]:
    """Spans written by hand through the real SDK, for conventions the instrumented run does
    not produce (reasoning parts, tool calls requested in output messages, older events)."""
    provider, collector = tracer_provider(service_name="manual-agent")
    tracer = provider.get_tracer("tests.manual")
    with tracer.start_as_current_span(
        "invoke_agent planner",
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "planner"},
    ):
        if build == "semconv":
            output = [
                {
                    "role": "assistant",
                    "parts": [
                        {"type": "reasoning", "content": "The user wants a product."},
                        {
                            "type": "tool_call",
                            "id": TOOL_CALL_ID,
                            "name": "calculator",
                            "arguments": TOOL_ARGUMENTS,
                        },
                    ],
                }
            ]
            with tracer.start_as_current_span(
                "chat gpt-4o-mini",
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.input.messages": json.dumps(
                        [
                            {"role": "system", "parts": [{"type": "text", "content": "SYSTEM"}]},
                            {"role": "user", "parts": [{"type": "text", "content": "6 times 7?"}]},
                        ]
                    ),
                    "gen_ai.output.messages": json.dumps(output),
                },
            ):
                pass
            with tracer.start_as_current_span(
                "execute_tool calculator",
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "calculator",
                    "gen_ai.tool.call.id": TOOL_CALL_ID,
                    "gen_ai.tool.call.arguments": json.dumps(TOOL_ARGUMENTS),
                    "gen_ai.tool.call.result": TOOL_RESULT,
                },
            ):
                pass
        else:  # semconv <= 1.30: prompt/completion attributes and message events
            with tracer.start_as_current_span(
                "chat gpt-4o-mini",
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.prompt.0.role": "system",
                    "gen_ai.prompt.0.content": "SYSTEM",
                    "gen_ai.prompt.1.role": "user",
                    "gen_ai.prompt.1.content": "6 times 7?",
                    "gen_ai.completion.0.role": "assistant",
                    "gen_ai.completion.0.tool_calls.0.id": TOOL_CALL_ID,
                    "gen_ai.completion.0.tool_calls.0.name": "calculator",
                    "gen_ai.completion.0.tool_calls.0.arguments": json.dumps(TOOL_ARGUMENTS),
                },
            ):
                pass
            with tracer.start_as_current_span(
                "chat gpt-4o-mini", attributes={"gen_ai.operation.name": "chat"}
            ) as chat:
                chat.add_event("gen_ai.user.message", {"content": "6 times 7?"})
                chat.add_event("gen_ai.tool.message", {"content": TOOL_RESULT, "id": TOOL_CALL_ID})
                chat.add_event("gen_ai.choice", {"content": "It is 42.", "index": 0})
    provider.shutdown()
    return decode_telemetry(encode_proto(collector.spans), "otlp_proto", "traces").spans


def test_tool_call_requested_in_output_messages_is_listed_once() -> None:
    trace = trace_from_spans(_manual_spans("semconv"), [], SETTINGS, feedback=FEEDBACK)
    assert trace.key == "planner"
    assert trace.task == "6 times 7?"  # the system message is not the task
    assert [(s.kind, s.name, s.content) for s in trace.steps] == [
        ("thought", None, "The user wants a product."),
        ("tool_call", "calculator", json.dumps(TOOL_ARGUMENTS, separators=(",", ":"))),
        ("observation", "calculator", TOOL_RESULT),
    ]


def test_older_genai_attributes_and_events_map() -> None:
    trace = trace_from_spans(_manual_spans("legacy"), [], SETTINGS, feedback=FEEDBACK)
    assert trace.task == "6 times 7?"
    assert [(s.kind, s.name, s.content) for s in trace.steps] == [
        ("tool_call", "calculator", json.dumps(TOOL_ARGUMENTS)),
        ("observation", "calculator", TOOL_RESULT),  # a tool message event, named by its id
        ("message", None, "It is 42."),
    ]
    assert trace.output == "It is 42."


def test_spans_that_cannot_make_a_trace_are_rejected(runs: dict[str, AgentRun]) -> None:
    with pytest.raises(DecodeError, match="no span"):
        trace_from_spans([], [], SETTINGS, feedback=FEEDBACK)
    mixed = spans_of(runs["captured"]) + spans_of(runs["bare"])
    with pytest.raises(DecodeError, match="more than one trace"):
        trace_from_spans(mixed, [], SETTINGS, feedback=FEEDBACK)
    by_operation = IngestConfig(key_attributes=["gen_ai.operation.name"])
    assert trace_of(runs["captured"], by_operation).key == "invoke_agent"  # the root's
    bad_key = IngestConfig(key_attributes=["gen_ai.tool.call.arguments"])
    with pytest.raises(DecodeError, match="is not a valid key"):
        trace_of(runs["captured"], bad_key)
    provider, collector = tracer_provider(service_name="web")
    with provider.get_tracer("web").start_as_current_span("GET /health"):
        pass
    web = decode_telemetry(encode_proto(collector.spans), "otlp_proto", "traces").spans
    with pytest.raises(DecodeError, match="no task"):
        trace_from_spans(web, [], SETTINGS, feedback=FEEDBACK)


# --------------------------------------------------------------------------- evaluations


def test_evaluations_from_span_events_and_log_records(runs: dict[str, AgentRun]) -> None:
    run = runs["captured"]
    chat = next(s for s in run.spans if s.name == "chat sim-llm")
    records = [
        *evaluation_records(
            chat, name="correctness", score=0.0, label="incorrect", explanation="off by one"
        ),
        *evaluation_records(None, name="orphan", label="pass"),  # no trace: untraced
        *evaluation_records(run.root, name="judge", label="timeout"),
    ]
    provider, collector = tracer_provider()
    with provider.get_tracer("tests.evaluator").start_as_current_span("evaluate") as span:
        span.add_event(
            "gen_ai.evaluation.result",
            {
                "gen_ai.evaluation.name": "relevance",
                "gen_ai.evaluation.score.value": 0.75,
                "gen_ai.evaluation.score.label": "relevant",
            },
        )
        span.add_event(
            "gen_ai.evaluation.result",
            {"gen_ai.evaluation.name": "toxicity", "error.type": "TimeoutError"},
        )
    spans = decode_telemetry(encode_proto(collector.spans), "otlp_proto", "traces").spans
    encoded: list[tuple[bytes, Encoding]] = [
        (encode_logs_proto(records), "otlp_proto"),
        (encode_logs_json(records), "otlp_json"),
    ]
    for value, encoding in encoded:
        telemetry = decode_telemetry(value, encoding, "logs")
        logs = telemetry.logs
        assert [log.event.name for log in logs] == ["gen_ai.evaluation.result"] * 2
        [orphan] = telemetry.untraced  # feedback that names no trace is kept, not dropped
        assert orphan.attributes["gen_ai.evaluation.name"] == "orphan"
        assert logs[0].trace_id == run.trace_id
        assert logs[0].span_id == format(chat.get_span_context().span_id, "016x")
        assert logs[0].resource["service.name"] == "evaluator"
        feedback = evaluations(spans, logs, SETTINGS)
        assert feedback == [
            Feedback(score=0.0, passed=False, text="correctness (incorrect): off by one"),
            Feedback(text="judge (timeout)"),  # a label that says neither pass nor fail
            Feedback(score=0.75, passed=True, text="relevance (relevant)"),
        ]
        assert evaluation_errors(spans, logs) == ["TimeoutError"], "the failed evaluator"


def test_log_events_of_a_trace_join_its_spans(runs: dict[str, AgentRun]) -> None:
    """Message events sent as log records (not span events) count like span events."""
    spans = spans_of(runs["bare"])
    chat = next(s for s in spans if s.name == "chat sim-llm")
    user = LogEvent(
        trace_id=chat.trace_id,
        span_id=chat.span_id,
        event=SpanEvent(
            name="gen_ai.user.message", time_ns=chat.start_ns, body={"content": "hi there"}
        ),
    )
    trace = trace_from_spans(spans, [user], SETTINGS, feedback=FEEDBACK)
    assert trace.task == "hi there"
    assert trace.metadata["content_captured"] == "true"


# --------------------------------------------------------------------------- agent side


def test_prompt_span_processor_follows_the_served_version() -> None:
    served = {"version": 4}
    processor = PromptSpanProcessor(
        "calc-bot", lambda: served["version"], bullet_ids=lambda: ["calc-00002"]
    )
    provider, collector = tracer_provider(processors=[processor])
    tracer = provider.get_tracer("tests.agent")
    with tracer.start_as_current_span("first"):
        pass
    served["version"] = 5
    with tracer.start_as_current_span("second"):
        pass
    provider.shutdown()
    stamped = [
        (
            dict(s.attributes or {})["combee.prompt.key"],
            dict(s.attributes or {})["combee.prompt.version"],
            tuple(dict(s.attributes or {})["combee.bullet_ids"]),
        )
        for s in collector.spans
    ]
    assert stamped == [("calc-bot", 4, ("calc-00002",)), ("calc-bot", 5, ("calc-00002",))]


def test_the_session_travels_from_the_agent_to_the_trace() -> None:
    """PromptSpanProcessor stamps the session the prompt was served to; the trace carries it,
    so the live canary can check the version was that session's. An id that is not one (a
    newline in it) is dropped, the trace still learned."""
    traces = []
    for session in ("agent-7", "bad\nid", None):
        processor = PromptSpanProcessor("calc-bot", 3, session=session)
        provider, collector = tracer_provider(processors=[processor])
        tracer = provider.get_tracer("tests.agent")
        agent = {"gen_ai.operation.name": "invoke_agent", "input.value": "What is 2 + 2?"}
        with tracer.start_as_current_span("invoke_agent", attributes=agent):
            pass
        provider.shutdown()
        spans = decode_telemetry(encode_proto(collector.spans), "otlp_proto", "traces").spans
        traces.append(trace_from_spans(spans, [], SETTINGS, feedback=FEEDBACK))
    assert [(t.session, t.prompt_version) for t in traces] == [("agent-7", 3), (None, 3), (None, 3)]


def test_prompt_span_processor_following_a_client() -> None:
    class Current(msgspec.Struct):
        key: str
        version: int

    class Client:
        def __init__(self) -> None:
            self.prompt = Current("support-bot", -1)  # a fallback prompt

        def current(self) -> Current:
            return self.prompt

    client = Client()
    provider, collector = tracer_provider(processors=[PromptSpanProcessor.following(client)])
    tracer = provider.get_tracer("tests.agent")
    agent = {"gen_ai.operation.name": "invoke_agent"}
    with tracer.start_as_current_span("invoke_agent", attributes=agent):
        pass
    client.prompt = Current("support-bot", 7)
    with tracer.start_as_current_span("invoke_agent", attributes=agent):
        pass
    provider.shutdown()
    versions = [dict(s.attributes or {})["combee.prompt.version"] for s in collector.spans]
    assert versions == [-1, 7]
    assert all("combee.session.id" not in (s.attributes or {}) for s in collector.spans)
    first = decode_telemetry(encode_proto(collector.spans[:1]), "otlp_proto", "traces").spans
    assert prompt_key(first, SETTINGS) == "support-bot"
    trace = trace_from_spans(first, [], SETTINGS, feedback=FEEDBACK)
    assert trace.prompt_version == 0  # a fallback prompt (-1) is no learned version
    assert trace.task == NOT_CAPTURED_TASK  # an agent span without content still maps


def test_per_trace_slices_key_one_request_per_trace(runs: dict[str, AgentRun]) -> None:
    both = [*runs["captured"].spans, *runs["bare"].spans]
    encodings: tuple[Encoding, ...] = ("otlp_proto", "otlp_json")
    for encoding in encodings:
        slices = per_trace_slices(both, encoding)
        assert [key.decode() for key, _ in slices] == [
            runs["captured"].trace_id,
            runs["bare"].trace_id,
        ]
        for key, value in slices:
            spans = decode_telemetry(value, encoding, "traces").spans
            assert {s.trace_id for s in spans} == {key.decode()}
            assert len(spans) == 4


def test_run_agent_leaves_the_client_uninstrumented(runs: dict[str, AgentRun]) -> None:
    import openai.resources.chat.completions as completions
    from wrapt import ObjectProxy

    assert runs  # the runs instrumented the client, each for its own block only
    assert not isinstance(vars(completions.AsyncCompletions)["create"], ObjectProxy)
