"""The message conventions of agent telemetry: what a span and its events say the model was sent
and answered, read the same whatever wrote them.

The GenAI semantic conventions (current: ``gen_ai.input.messages`` / ``gen_ai.output.messages``
as attributes or on ``gen_ai.client.inference.operation.details`` events; older:
``gen_ai.prompt.N.*`` / ``gen_ai.completion.N.*`` attributes and the
``gen_ai.{system,user,assistant,tool}.message`` / ``gen_ai.choice`` events, as span events or log
records) and OpenInference (``openinference.span.kind``, ``llm.input_messages.N.message.*``,
``input.value`` / ``output.value``, ``tool.name``) come out as :class:`Message` lists of
:class:`Part` s per span (:func:`span_view`); which kind a span is (agent, LLM, tool) and the
attribute lookups are here too. :mod:`~combee_stream.formats.genai` maps them to a trace.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal, NamedTuple

from combee_stream.formats.spans import LogEvent, Span, SpanEvent
from combee_stream.schemas import encode

_DETAILS_EVENT: Final = "gen_ai.client.inference.operation.details"

_AGENT_OPERATIONS: Final = frozenset({"invoke_agent", "create_agent", "invoke_workflow"})

_LLM_OPERATIONS: Final = frozenset({"chat", "text_completion", "generate_content"})

_EVENT_ROLES: Final = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}

USER_ROLES: Final = ("user", "human")

_INDEXED = re.compile(r"(\d+)\.(.+)")

PartType = Literal["text", "reasoning", "tool_call", "tool_result"]


class Part(NamedTuple):
    type: PartType
    content: str
    name: str | None = None
    id: str | None = None


class Message(NamedTuple):
    role: str
    parts: list[Part]
    time_ns: int

    @property
    def text(self) -> str:
        return "\n".join(part.content for part in self.parts if part.type == "text")


class SpanView(NamedTuple):
    """A span with the messages read from it and its events."""

    span: Span
    inputs: list[Message]  # GenAI semconv, current or older
    outputs: list[Message]
    oi_inputs: list[Message]  # OpenInference
    oi_outputs: list[Message]


def _operation(span: Span) -> str:
    value = span.attributes.get("gen_ai.operation.name")
    return value if isinstance(value, str) else ""


def _oi_kind(span: Span) -> str:
    value = span.attributes.get("openinference.span.kind")
    return value.upper() if isinstance(value, str) else ""


def is_agent(span: Span) -> bool:
    return _operation(span) in _AGENT_OPERATIONS or _oi_kind(span) in ("AGENT", "CHAIN")


def is_llm(span: Span) -> bool:
    return _operation(span) in _LLM_OPERATIONS or _oi_kind(span) == "LLM"


def is_tool(span: Span) -> bool:
    return _operation(span) == "execute_tool" or _oi_kind(span) == "TOOL"


def first_str(spans: Iterable[Span], attribute: str, *, resource: bool = False) -> str | None:
    for span in spans:
        value = (span.resource if resource else span.attributes).get(attribute)
        if isinstance(value, str) and value:
            return value
    return None


def first_attribute(spans: Iterable[Span], *attributes: str) -> Any:
    for span in spans:
        for attribute in attributes:
            value = span.attributes.get(attribute)
            if value is not None and value != "":
                return value
    return None


def _event_key(event: SpanEvent) -> tuple[str, int, bytes, bytes]:
    return (event.name, event.time_ns, encode(event.attributes), encode(event.body))


def distinct_events(events: Iterable[SpanEvent]) -> list[SpanEvent]:
    """Events once each: an instrumentation may send one both as a span event and a log."""
    seen: dict[tuple[str, int, bytes, bytes], SpanEvent] = {}
    for event in events:
        seen.setdefault(_event_key(event), event)
    return list(seen.values())


def events_by_span(
    ordered: Sequence[Span], logs: Sequence[LogEvent]
) -> list[tuple[Span, list[SpanEvent]]]:
    """Each span with its events and the log events that name it; log events that name no
    span of the trace go to the root."""
    extra: dict[str, list[SpanEvent]] = {span.span_id: [] for span in ordered}
    root_id = ordered[0].span_id
    for log in logs:
        extra.get(log.span_id, extra[root_id]).append(log.event)
    return [
        (
            span,
            sorted(distinct_events([*span.events, *extra[span.span_id]]), key=lambda e: e.time_ns),
        )
        for span in ordered
    ]


def text_of(value: Any) -> str:
    """A value as text: strings as they are, anything else as compact JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return encode(value).decode()


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def _semconv_part(raw: Any) -> Part | None:
    """One part of a semconv message: ``{"type": "text", "content": ...}`` and kin."""
    if not isinstance(raw, dict):
        return None
    kind = raw.get("type")
    content = raw.get("content", raw.get("text"))
    if kind == "text" and isinstance(content, str):
        return Part("text", content)
    if kind in ("reasoning", "thinking") and isinstance(content, str):
        return Part("reasoning", content)
    ident = raw.get("id")
    ident = ident if isinstance(ident, str) and ident else None
    if kind == "tool_call":
        name = raw.get("name")
        return Part(
            "tool_call",
            text_of(raw.get("arguments")),
            name if isinstance(name, str) else None,
            ident,
        )
    if kind == "tool_call_response":
        return Part("tool_result", text_of(raw.get("response", raw.get("result"))), None, ident)
    return None


def _body_parts(body: Mapping[str, Any], role: str) -> list[Part]:
    """Parts of a message in the OpenAI shape (``content``, ``tool_calls``), which the older
    GenAI events and some instrumentations' message attributes use."""
    parts: list[Part] = []
    content = body.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "\n".join(
            item["text"]
            for item in content
            if isinstance(item, dict) and isinstance(item.get("text"), str)
        )
    if isinstance(content, str) and content:
        if role == "tool":
            ident = body.get("tool_call_id") or body.get("id")
            parts.append(Part("tool_result", content, None, text_of(ident) or None))
        else:
            parts.append(Part("text", content))
    calls = body.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else call
        name = function.get("name")
        parts.append(
            Part(
                "tool_call",
                text_of(function.get("arguments")),
                name if isinstance(name, str) else None,
                text_of(call.get("id")) or None,
            )
        )
    return parts


def _semconv_messages(value: Any, time_ns: int) -> list[Message]:
    """``gen_ai.input.messages`` / ``gen_ai.output.messages`` (a JSON string or a list)."""
    value = _loads(value)
    if isinstance(value, dict):
        value = [value]
    messages = []
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, dict):
            continue
        role = item.get("role")
        role = role if isinstance(role, str) else ""
        raw_parts = item.get("parts")
        parts = [p for raw in raw_parts or [] if (p := _semconv_part(raw)) is not None]
        if not isinstance(raw_parts, list):
            parts = _body_parts(item, role)
        messages.append(Message(role, parts, time_ns))
    return messages


def _indexed(attributes: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Flattened lists (``prefix.0.role``, ``prefix.0.content``, ...) as a list of dicts."""
    found: dict[int, dict[str, Any]] = {}
    lead = prefix + "."
    for name, value in attributes.items():
        if name.startswith(lead) and (match := _INDEXED.fullmatch(name[len(lead) :])):
            found.setdefault(int(match.group(1)), {})[match.group(2)] = value
    return [found[index] for index in sorted(found)]


def _strip(fields: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {name.removeprefix(prefix): value for name, value in fields.items()}


def _flat_messages(attributes: Mapping[str, Any], prefix: str, time_ns: int) -> list[Message]:
    """Flattened messages: older GenAI ``gen_ai.prompt.N.role`` / ``.content`` /
    ``.tool_calls.M.name``, and OpenInference ``llm.input_messages.N.message.role`` /
    ``.message.content`` / ``.message.contents.M.message_content.text`` /
    ``.message.tool_calls.M.tool_call.function.name``."""
    messages = []
    for raw in _indexed(attributes, prefix):
        fields = _strip(raw, "message.")
        role = fields.get("role")
        role = role if isinstance(role, str) else ""
        body: dict[str, Any] = {"content": fields.get("content")}
        # OpenInference multi-part contents
        texts = [item.get("message_content.text") for item in _indexed(fields, "contents")]
        if body["content"] is None and texts:
            body["content"] = "\n".join(text for text in texts if isinstance(text, str))
        body["tool_call_id"] = fields.get("tool_call_id")
        body["tool_calls"] = [
            {
                "id": call.get("id"),
                "function": {
                    "name": call.get("function.name", call.get("name")),
                    "arguments": call.get("function.arguments", call.get("arguments")),
                },
            }
            for call in (_strip(c, "tool_call.") for c in _indexed(fields, "tool_calls"))
        ]
        messages.append(Message(role, _body_parts(body, role), time_ns))
    return messages


def event_body(event: SpanEvent) -> dict[str, Any]:
    """An event's payload: its body (a map, or text as ``content``) over its attributes."""
    body = event.body
    if isinstance(body, str):
        body = {"content": body}
    return {**event.attributes, **(body if isinstance(body, dict) else {})}


def _event_messages(events: Sequence[SpanEvent], *, inputs: bool) -> list[Message]:
    """The older GenAI message events (semconv up to 1.30)."""
    messages = []
    for event in events:
        body = event_body(event)
        if inputs and event.name in _EVENT_ROLES:
            role = body.get("role")
            role = role if isinstance(role, str) and role else _EVENT_ROLES[event.name]
            messages.append(Message(role, _body_parts(body, role), event.time_ns))
        elif not inputs and event.name == "gen_ai.choice":
            message = body.get("message")
            message = message if isinstance(message, dict) else body
            role = message.get("role")
            role = role if isinstance(role, str) and role else "assistant"
            messages.append(Message(role, _body_parts(message, role), event.time_ns))
        elif event.name == ("gen_ai.content.prompt" if inputs else "gen_ai.content.completion"):
            attribute = "gen_ai.prompt" if inputs else "gen_ai.completion"
            messages += _semconv_messages(body.get(attribute), event.time_ns)
    return messages


def span_view(span: Span, events: list[SpanEvent]) -> SpanView:
    attrs = span.attributes
    start, end = span.start_ns, span.end_ns or span.start_ns
    sides: list[list[Message]] = []
    for side, at, legacy in (
        ("input", start, "gen_ai.prompt"),
        ("output", end, "gen_ai.completion"),
    ):
        messages = _semconv_messages(attrs.get(f"gen_ai.{side}.messages"), at)
        for event in events:
            if not messages and event.name == _DETAILS_EVENT:
                messages = _semconv_messages(
                    event.attributes.get(f"gen_ai.{side}.messages"), event.time_ns or at
                )
        messages = messages or _flat_messages(attrs, legacy, at)
        sides.append(messages or _event_messages(events, inputs=side == "input"))
    return SpanView(
        span,
        inputs=sides[0],
        outputs=sides[1],
        oi_inputs=_flat_messages(attrs, "llm.input_messages", start),
        oi_outputs=_flat_messages(attrs, "llm.output_messages", end),
    )


def number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


__all__ = [
    "USER_ROLES",
    "Message",
    "Part",
    "PartType",
    "SpanView",
    "distinct_events",
    "event_body",
    "events_by_span",
    "first_attribute",
    "first_str",
    "is_agent",
    "is_llm",
    "is_tool",
    "number",
    "span_view",
    "text_of",
]
