"""One trace's OpenTelemetry spans as a native :class:`~combee_stream.schemas.Trace`.

Reads the GenAI semantic conventions (current: ``gen_ai.input.messages`` /
``gen_ai.output.messages`` as attributes or on ``gen_ai.client.inference.operation.details``
events; older: ``gen_ai.prompt.N.*`` / ``gen_ai.completion.N.*`` attributes and the
``gen_ai.{system,user,assistant,tool}.message`` / ``gen_ai.choice`` events, as span events or log
records) and OpenInference (``openinference.span.kind``, ``llm.input_messages.N.message.*``,
``input.value`` / ``output.value``, ``tool.name``).

| Trace field        | Taken from                                                                 |
| ------------------ | -------------------------------------------------------------------------- |
| ``key``            | the first of ``ingest.key_attributes`` (default ``combee.prompt.key``,     |
|                    | ``gen_ai.agent.name``, ``service.name``) on a span (root first, then by    |
|                    | start), else on a span's resource                                          |
| ``prompt_version`` | ``ingest.version_attribute`` (``combee.prompt.version``), root first;      |
|                    | negative (a fallback prompt): 0; absent: None (no live sample)             |
| ``session``        | ``ingest.session_attribute`` (``combee.session.id``), root first           |
| ``trace_id``       | the trace id, 32 lowercase hex characters                                  |
| ``task``           | the latest user message of the earliest span with input messages           |
|                    | (``gen_ai.input.messages``, ``gen_ai.prompt.N``, ``gen_ai.user.message``); |
|                    | else the root's ``input.value``; else OpenInference                        |
|                    | ``llm.input_messages.N``. System messages and                              |
|                    | ``gen_ai.system_instructions`` are never the task: they are the prompt     |
|                    | being learned                                                              |
| ``steps``          | in time order: each LLM span's output messages (text: ``message``,         |
|                    | reasoning: ``thought``, requested tool calls: ``tool_call`` with name and  |
|                    | arguments); each ``execute_tool`` / OpenInference ``TOOL`` span: a         |
|                    | ``tool_call`` (``gen_ai.tool.call.arguments`` / ``input.value``, unless an |
|                    | output requested it) then an ``observation`` (``gen_ai.tool.call.result``  |
|                    | / ``output.value``); tool results and assistant turns that only later      |
|                    | input messages show (older instrumentations), once each. Agent spans       |
|                    | (``invoke_agent``, ``AGENT``, ``CHAIN``) give no step. Contents cut to     |
|                    | ``ingest.max_step_chars``                                                  |
| ``output``         | the root's last assistant text (``gen_ai.output.messages``) or its         |
|                    | ``output.value``; else the last assistant text of any span                 |
| ``bullet_ids``     | ``combee.bullet_ids`` (a list, or comma-separated), over all spans         |
| ``started_at``     | the root span's start                                                      |
| ``finished_at``    | the root span's end                                                        |
| ``metadata``       | ``source``: ``otlp``; ``agent``: ``gen_ai.agent.name`` (or                 |
|                    | ``agent.name``); ``conversation``: ``gen_ai.conversation.id`` (or          |
|                    | ``session.id``); ``model``: the first LLM span's model; ``tokens_in`` /    |
|                    | ``tokens_out``: ``gen_ai.usage.input_tokens`` / ``output_tokens`` (or      |
|                    | ``llm.token_count.prompt`` / ``completion``) summed over the non-agent     |
|                    | spans (the agent spans' totals only when no other span counts);            |
|                    | ``content_captured``: ``true`` / ``false``                                 |

The root is the span whose parent is empty or not among the spans (the earliest if several).

Message content is opt-in in every instrumentation. Without it a trace still maps as long as it
has an agent, LLM or tool span: the task becomes :data:`NOT_CAPTURED_TASK`,
``metadata["content_captured"]`` is ``"false"``, an LLM span becomes an ``action`` step naming
it (``chat gpt-4o-mini (content not captured)``) and a tool span a ``tool_call`` / ``observation``
pair with placeholders. A trace with neither user text nor such a span raises ``DecodeError``.

:func:`evaluations` reads ``gen_ai.evaluation.result`` events (span events or log records) as
:class:`~combee_stream.schemas.Feedback`; :func:`evaluation_errors` names those that give no
result (a failed evaluator's ``error.type``).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal, NamedTuple

import msgspec

from combee_stream.config import IngestConfig
from combee_stream.errors import DecodeError
from combee_stream.formats.spans import EVALUATION_EVENT, LogEvent, Span, SpanEvent
from combee_stream.schemas import Feedback, Key, Step, Trace, check_id, decode, encode

NOT_CAPTURED_TASK: Final = (
    "(the agent's input was not captured: enable message content capture in its instrumentation)"
)
BULLET_IDS_ATTRIBUTE: Final = "combee.bullet_ids"
_DETAILS_EVENT: Final = "gen_ai.client.inference.operation.details"
_AGENT_OPERATIONS: Final = frozenset({"invoke_agent", "create_agent", "invoke_workflow"})
_LLM_OPERATIONS: Final = frozenset({"chat", "text_completion", "generate_content"})
_EVENT_ROLES: Final = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
_USER_ROLES: Final = ("user", "human")
_STATUS_ERROR: Final = 2
_INDEXED = re.compile(r"(\d+)\.(.+)")

PartType = Literal["text", "reasoning", "tool_call", "tool_result"]


class _Part(NamedTuple):
    type: PartType
    content: str
    name: str | None = None
    id: str | None = None


class _Message(NamedTuple):
    role: str
    parts: list[_Part]
    time_ns: int

    @property
    def text(self) -> str:
        return "\n".join(part.content for part in self.parts if part.type == "text")


class _View(NamedTuple):
    """A span with the messages read from it and its events."""

    span: Span
    inputs: list[_Message]  # GenAI semconv, current or older
    outputs: list[_Message]
    oi_inputs: list[_Message]  # OpenInference
    oi_outputs: list[_Message]


# --------------------------------------------------------------------------- public


def root_span(spans: Sequence[Span]) -> Span | None:
    """The span whose parent is empty or not among ``spans`` (the earliest if several)."""
    ids = {span.span_id for span in spans}
    roots = [span for span in spans if not span.parent_span_id or span.parent_span_id not in ids]
    return min(roots, key=_start_key, default=None)


def prompt_key(spans: Sequence[Span], settings: IngestConfig) -> str | None:
    """The first of ``settings.key_attributes`` that a span (root first, then by start) or,
    failing that, a span's resource carries; None when none does."""
    ordered = _ordered(spans)
    for attribute in settings.key_attributes:
        value = _first_str(ordered, attribute)
        if value is None:
            value = _first_str(ordered, attribute, resource=True)
        if value is not None:
            return value
    return None


def trace_from_spans(
    spans: Sequence[Span],
    logs: Sequence[LogEvent],
    settings: IngestConfig,
    *,
    feedback: Feedback,
) -> Trace:
    """One trace's spans (and its log events) as a ``Trace``; DecodeError(reason) if they
    cannot make one."""
    if not spans:
        raise DecodeError("no span to make a trace of")
    if len({span.trace_id for span in spans}) > 1:
        raise DecodeError("the spans belong to more than one trace")
    ordered = _ordered(spans)
    root = ordered[0]
    if 0 < root.end_ns < root.start_ns:
        raise DecodeError(
            f"its root span {root.span_id} ({root.name[:80]!r}) ends before it starts "
            f"(start {_time(root.start_ns)}, end {_time(root.end_ns)}): a clock or an "
            "instrumentation is wrong, and its times would be the trace's"
        )
    key = _checked_key(ordered, settings)
    views = [_view(span, events) for span, events in _events_by_span(ordered, logs)]
    task = _task(views)
    captured = task is not None
    if task is None:
        if not any(_is_agent(s) or _is_llm(s) or _is_tool(s) for s in ordered):
            raise DecodeError(
                "no task: no user message and no GenAI or OpenInference agent, LLM or tool span "
                "in the trace (is it an agent's trace?)"
            )
        task = NOT_CAPTURED_TASK
    try:
        trace = Trace(
            key=key,
            trace_id=root.trace_id,
            task=task,
            feedback=feedback,
            output=_output(views),
            steps=_steps(views, settings.max_step_chars),
            prompt_version=_version(ordered, settings.version_attribute),
            session=_session(ordered, settings.session_attribute),
            bullet_ids=_bullet_ids(ordered),
            started_at=_time(root.start_ns),
            finished_at=_time(root.end_ns),
            metadata=_metadata(views, captured),
        )
    except ValueError as exc:  # a task of NUL characters, say
        raise DecodeError(f"invalid Trace: {exc}") from None
    # Constraints (key pattern, id length...) are checked on decode only: the round trip makes
    # sure what the ingest writes is what the engine will read.
    return decode(encode(trace), Trace)


def evaluations(
    spans: Sequence[Span], logs: Sequence[LogEvent], settings: IngestConfig
) -> list[Feedback]:
    """Every ``gen_ai.evaluation.result`` event of the spans and logs, in time order, as
    Feedback (:func:`result_feedback`): ``score.value`` -> score, ``score.label`` ->
    passed, ``gen_ai.evaluation.name`` (label): ``explanation`` -> text. Events that give no
    result are not feedback: :func:`evaluation_errors` names them."""
    results = (_evaluation(event, settings) for event in _evaluation_events(spans, logs))
    return [result for result in results if result is not None]


def evaluation_errors(spans: Sequence[Span], logs: Sequence[LogEvent]) -> list[str]:
    """The evaluation events that give no result, in time order: their ``error.type`` (the
    evaluator failed) or ``"empty"`` (no score, label or explanation). They say nothing about
    the run, so they are no outcome; the ingest stage counts and logs them."""
    results = (_evaluation_error(event) for event in _evaluation_events(spans, logs))
    return [result for result in results if result is not None]


def _evaluation_events(spans: Sequence[Span], logs: Sequence[LogEvent]) -> list[SpanEvent]:
    events = [event for span in spans for event in span.events if event.name == EVALUATION_EVENT]
    events += [log.event for log in logs if log.event.name == EVALUATION_EVENT]
    return sorted(_distinct(events), key=lambda event: event.time_ns)


# --------------------------------------------------------------------------- spans


def _start_key(span: Span) -> tuple[int, int, str]:
    return (span.start_ns, span.end_ns, span.span_id)


def _ordered(spans: Sequence[Span]) -> list[Span]:
    """The root first, then the others by start time."""
    root = root_span(spans)
    rest = sorted((span for span in spans if span is not root), key=_start_key)
    return rest if root is None else [root, *rest]


def _operation(span: Span) -> str:
    value = span.attributes.get("gen_ai.operation.name")
    return value if isinstance(value, str) else ""


def _oi_kind(span: Span) -> str:
    value = span.attributes.get("openinference.span.kind")
    return value.upper() if isinstance(value, str) else ""


def _is_agent(span: Span) -> bool:
    return _operation(span) in _AGENT_OPERATIONS or _oi_kind(span) in ("AGENT", "CHAIN")


def _is_llm(span: Span) -> bool:
    return _operation(span) in _LLM_OPERATIONS or _oi_kind(span) == "LLM"


def _is_tool(span: Span) -> bool:
    return _operation(span) == "execute_tool" or _oi_kind(span) == "TOOL"


def _first_str(spans: Iterable[Span], attribute: str, *, resource: bool = False) -> str | None:
    for span in spans:
        value = (span.resource if resource else span.attributes).get(attribute)
        if isinstance(value, str) and value:
            return value
    return None


def _first(spans: Iterable[Span], *attributes: str) -> Any:
    for span in spans:
        for attribute in attributes:
            value = span.attributes.get(attribute)
            if value is not None and value != "":
                return value
    return None


def _checked_key(ordered: Sequence[Span], settings: IngestConfig) -> str:
    key = prompt_key(ordered, settings)
    if key is None:
        raise DecodeError(
            f"no prompt key: none of {', '.join(settings.key_attributes)} is set on a span "
            "or its resource"
        )
    try:
        return msgspec.convert(key, Key)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"prompt key {key[:80]!r} is not a valid key: {exc}") from None


def _version(ordered: Sequence[Span], attribute: str) -> int | None:
    value = _first(ordered, attribute)
    if value is None:
        return None  # not said: unknown, not version 0
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DecodeError(f"{attribute} is {value!r}, not a version number")
    return max(value, 0)  # a fallback prompt is version -1: no learned version


def _session(ordered: Sequence[Span], attribute: str) -> str | None:
    """The session id, or None when absent or not a valid id: the trace is still learned, it
    is only no live sample."""
    value = _first_str(ordered, attribute)
    if value is None or len(value) > 200:
        return None
    try:
        check_id(value, "session")
    except ValueError:
        return None
    return value


def _bullet_ids(ordered: Sequence[Span]) -> list[str]:
    ids: dict[str, None] = {}
    for span in ordered:
        value = span.attributes.get(BULLET_IDS_ATTRIBUTE)
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, list):
            ids.update((item.strip(), None) for item in items if isinstance(item, str))
    ids.pop("", None)
    return list(ids)


def _time(ns: int) -> dt.datetime | None:
    if ns <= 0:
        return None
    seconds, rest = divmod(ns, 1_000_000_000)
    return dt.datetime.fromtimestamp(seconds, dt.UTC) + dt.timedelta(microseconds=rest // 1000)


# --------------------------------------------------------------------------- events


def _event_key(event: SpanEvent) -> tuple[str, int, bytes, bytes]:
    return (event.name, event.time_ns, encode(event.attributes), encode(event.body))


def _distinct(events: Iterable[SpanEvent]) -> list[SpanEvent]:
    """Events once each: an instrumentation may send one both as a span event and a log."""
    seen: dict[tuple[str, int, bytes, bytes], SpanEvent] = {}
    for event in events:
        seen.setdefault(_event_key(event), event)
    return list(seen.values())


def _events_by_span(
    ordered: Sequence[Span], logs: Sequence[LogEvent]
) -> list[tuple[Span, list[SpanEvent]]]:
    """Each span with its events and the log events that name it; log events that name no
    span of the trace go to the root."""
    extra: dict[str, list[SpanEvent]] = {span.span_id: [] for span in ordered}
    root_id = ordered[0].span_id
    for log in logs:
        extra.get(log.span_id, extra[root_id]).append(log.event)
    return [
        (span, sorted(_distinct([*span.events, *extra[span.span_id]]), key=lambda e: e.time_ns))
        for span in ordered
    ]


# --------------------------------------------------------------------------- messages


def _text_of(value: Any) -> str:
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


def _semconv_part(raw: Any) -> _Part | None:
    """One part of a semconv message: ``{"type": "text", "content": ...}`` and kin."""
    if not isinstance(raw, dict):
        return None
    kind = raw.get("type")
    content = raw.get("content", raw.get("text"))
    if kind == "text" and isinstance(content, str):
        return _Part("text", content)
    if kind in ("reasoning", "thinking") and isinstance(content, str):
        return _Part("reasoning", content)
    ident = raw.get("id")
    ident = ident if isinstance(ident, str) and ident else None
    if kind == "tool_call":
        name = raw.get("name")
        return _Part(
            "tool_call",
            _text_of(raw.get("arguments")),
            name if isinstance(name, str) else None,
            ident,
        )
    if kind == "tool_call_response":
        return _Part("tool_result", _text_of(raw.get("response", raw.get("result"))), None, ident)
    return None


def _body_parts(body: Mapping[str, Any], role: str) -> list[_Part]:
    """Parts of a message in the OpenAI shape (``content``, ``tool_calls``), which the older
    GenAI events and some instrumentations' message attributes use."""
    parts: list[_Part] = []
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
            parts.append(_Part("tool_result", content, None, _text_of(ident) or None))
        else:
            parts.append(_Part("text", content))
    calls = body.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else call
        name = function.get("name")
        parts.append(
            _Part(
                "tool_call",
                _text_of(function.get("arguments")),
                name if isinstance(name, str) else None,
                _text_of(call.get("id")) or None,
            )
        )
    return parts


def _semconv_messages(value: Any, time_ns: int) -> list[_Message]:
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
        messages.append(_Message(role, parts, time_ns))
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


def _flat_messages(attributes: Mapping[str, Any], prefix: str, time_ns: int) -> list[_Message]:
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
        messages.append(_Message(role, _body_parts(body, role), time_ns))
    return messages


def _event_body(event: SpanEvent) -> dict[str, Any]:
    """An event's payload: its body (a map, or text as ``content``) over its attributes."""
    body = event.body
    if isinstance(body, str):
        body = {"content": body}
    return {**event.attributes, **(body if isinstance(body, dict) else {})}


def _event_messages(events: Sequence[SpanEvent], *, inputs: bool) -> list[_Message]:
    """The older GenAI message events (semconv up to 1.30)."""
    messages = []
    for event in events:
        body = _event_body(event)
        if inputs and event.name in _EVENT_ROLES:
            role = body.get("role")
            role = role if isinstance(role, str) and role else _EVENT_ROLES[event.name]
            messages.append(_Message(role, _body_parts(body, role), event.time_ns))
        elif not inputs and event.name == "gen_ai.choice":
            message = body.get("message")
            message = message if isinstance(message, dict) else body
            role = message.get("role")
            role = role if isinstance(role, str) and role else "assistant"
            messages.append(_Message(role, _body_parts(message, role), event.time_ns))
        elif event.name == ("gen_ai.content.prompt" if inputs else "gen_ai.content.completion"):
            attribute = "gen_ai.prompt" if inputs else "gen_ai.completion"
            messages += _semconv_messages(body.get(attribute), event.time_ns)
    return messages


def _view(span: Span, events: list[SpanEvent]) -> _View:
    attrs = span.attributes
    start, end = span.start_ns, span.end_ns or span.start_ns
    sides: list[list[_Message]] = []
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
    return _View(
        span,
        inputs=sides[0],
        outputs=sides[1],
        oi_inputs=_flat_messages(attrs, "llm.input_messages", start),
        oi_outputs=_flat_messages(attrs, "llm.output_messages", end),
    )


# --------------------------------------------------------------------------- fields


def _task(views: Sequence[_View]) -> str | None:
    for messages in (v.inputs for v in views):
        users = [m.text for m in messages if m.role in _USER_ROLES and m.text.strip()]
        if users:
            return users[-1]  # in a conversation the latest turn; earlier ones are history
    root_input = views[0].span.attributes.get("input.value")
    if isinstance(root_input, str) and root_input.strip():
        return root_input
    for messages in (v.oi_inputs for v in views):
        users = [m.text for m in messages if m.role in _USER_ROLES and m.text.strip()]
        if users:
            return users[-1]
    return None


def _is_reply(message: _Message) -> bool:
    return message.role not in _USER_ROLES and message.role not in ("system", "developer", "tool")


def _last_reply_text(messages: Sequence[_Message]) -> str:
    texts = [m.text for m in messages if _is_reply(m) and m.text.strip()]
    return texts[-1] if texts else ""


def _output(views: Sequence[_View]) -> str:
    root = views[0]
    text = _last_reply_text(root.outputs or root.oi_outputs)
    if text:
        return text
    value = root.span.attributes.get("output.value")
    if isinstance(value, str) and value.strip():
        return value
    for view in sorted(views, key=lambda v: v.span.end_ns, reverse=True):
        text = _last_reply_text(view.outputs or view.oi_outputs)
        if text:
            return text
    return ""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _tool_call(span: Span) -> _Part:
    """The call a tool span made. OpenInference's ``tool.parameters`` is the tool's parameter
    schema, not the call's arguments: ``input.value`` is."""
    name = _text_of(_first([span], "gen_ai.tool.name", "tool.name")) or span.name
    arguments = _text_of(_first([span], "gen_ai.tool.call.arguments", "input.value"))
    call_id = _text_of(_first([span], "gen_ai.tool.call.id", "tool_call.id"))
    return _Part("tool_call", arguments, name, call_id or None)


def _signature(call: _Part) -> str:
    return f"{call.name}\n{call.content}"


def _tool_result(span: Span) -> str:
    return _text_of(_first([span], "gen_ai.tool.call.result", "output.value"))


def _error_text(span: Span) -> str:
    return span.status_message or _text_of(span.attributes.get("error.type")) or "failed"


def _steps(views: Sequence[_View], limit: int) -> list[Step]:
    timed: list[tuple[int, int, Step]] = []

    def add(time_ns: int, kind: Any, content: str, name: str | None = None) -> None:
        step = Step(kind=kind, content=_cut(content, limit), name=name)
        timed.append((time_ns, len(timed), step))

    # What outputs and tool spans show already: older instrumentations repeat it in the input
    # messages of every later call, so those give only what nothing else showed. A call is
    # known by its id and by its name + arguments (some conventions give no id).
    requested: set[str] = set()  # tool calls an LLM output requested
    requested_without_id: set[str] = set()
    called: set[str] = set()  # tool calls shown
    answered: set[str] = set()  # tool results shown (ids and contents)
    said: set[str] = set()  # assistant texts shown
    names: dict[str, str] = {}  # tool call id -> tool name
    for view in views:
        if _is_tool(view.span):
            call = _tool_call(view.span)
            called.update(filter(None, [call.id, _signature(call)]))
            answered.update(filter(None, [call.id, _tool_result(view.span)]))
            continue
        for message in view.outputs or view.oi_outputs:
            for part in message.parts:
                if part.type == "tool_call":
                    requested.update(filter(None, [part.id, _signature(part)]))
                    if not part.id:
                        requested_without_id.add(_signature(part))
                elif part.type == "text":
                    said.add(part.content)
        for message in (*view.inputs, *view.oi_inputs, *view.outputs, *view.oi_outputs):
            for part in message.parts:
                if part.type == "tool_call" and part.id and part.name:
                    names[part.id] = part.name
    called |= requested

    for view in views:
        span = view.span
        if _is_tool(span):
            call = _tool_call(span)
            # A call the LLM's output requested is listed there already.
            listed = (call.id or _signature(call)) in requested or (
                _signature(call) in requested_without_id
            )
            if not listed:
                content = call.content or "(arguments not captured)"
                add(span.start_ns, "tool_call", content, call.name)
            result = _tool_result(span)
            if span.status_code == _STATUS_ERROR:
                result = f"error: {_error_text(span)}" + (f"\n{result}" if result else "")
            end = span.end_ns or span.start_ns
            add(end, "observation", result or "(result not captured)", call.name)
            continue
        if _is_agent(span):
            continue  # its children carry the steps; its output is the trace's output
        outputs = view.outputs or view.oi_outputs
        for message in outputs:
            if not _is_reply(message):
                continue
            for part in message.parts:
                if part.type == "text":
                    add(message.time_ns, "message", part.content)
                elif part.type == "reasoning":
                    add(message.time_ns, "thought", part.content)
                elif part.type == "tool_call":
                    add(message.time_ns, "tool_call", part.content, part.name)
        if not outputs and _is_llm(span):
            what = "content not captured"
            if span.status_code == _STATUS_ERROR:
                what = f"error: {_error_text(span)}"
            add(span.end_ns or span.start_ns, "action", f"{span.name} ({what})")
        for message in view.inputs or view.oi_inputs:
            for part in message.parts:
                if part.type == "tool_result":
                    keys = {key for key in (part.id, part.content) if key}
                    if not keys & answered:
                        answered |= keys
                        add(message.time_ns, "observation", part.content, names.get(part.id or ""))
                elif not _is_reply(message):
                    continue
                elif part.type == "tool_call":
                    keys = {key for key in (part.id, _signature(part)) if key}
                    if not keys & called:
                        called |= keys
                        add(message.time_ns, "tool_call", part.content, part.name)
                elif part.type == "text" and part.content not in said:
                    said.add(part.content)
                    add(message.time_ns, "message", part.content)
    return [step for _, _, step in sorted(timed, key=lambda item: (item[0], item[1]))]


def _number(value: Any) -> float | None:
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


def _tokens(views: Sequence[_View]) -> tuple[int, int] | None:
    """Token usage summed over the spans that are not agent spans (an agent span's usage, when
    set, totals its children's); the agent spans' only when no other span counts tokens."""
    names = (
        ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt"),
        (
            "gen_ai.usage.output_tokens",
            "gen_ai.usage.completion_tokens",
            "llm.token_count.completion",
        ),
    )
    for agents in (False, True):
        found = False
        totals = [0, 0]
        for view in views:
            if _is_agent(view.span) != agents:
                continue
            for side, candidates in enumerate(names):
                count = _number(_first([view.span], *candidates))
                if count is not None:
                    found = True
                    totals[side] += int(count)
        if found:
            return totals[0], totals[1]
    return None


def _metadata(views: Sequence[_View], captured: bool) -> dict[str, str]:
    spans = [view.span for view in views]
    metadata = {"source": "otlp", "content_captured": "true" if captured else "false"}
    agent = _first(spans, "gen_ai.agent.name", "agent.name")
    if agent is not None:
        metadata["agent"] = _text_of(agent)
    conversation = _first(spans, "gen_ai.conversation.id", "session.id")
    if conversation is not None:
        metadata["conversation"] = _text_of(conversation)
    model = _first(
        [s for s in spans if _is_llm(s)],
        "gen_ai.response.model",
        "gen_ai.request.model",
        "llm.model_name",
    )
    if model is not None:
        metadata["model"] = _text_of(model)
    tokens = _tokens(views)
    if tokens is not None:
        metadata["tokens_in"], metadata["tokens_out"] = str(tokens[0]), str(tokens[1])
    return metadata


# --------------------------------------------------------------------------- evaluations


def _evaluation_error(event: SpanEvent) -> str | None:
    """Why the event gives no result (its ``error.type``, or ``"empty"``); None when it does."""
    attrs = _event_body(event)
    if attrs.get("error.type"):
        return _text_of(attrs["error.type"])  # the evaluator failed: no verdict on the trace
    fields = ("gen_ai.evaluation.score.value", "gen_ai.evaluation.score.label")
    has_result = any(attrs.get(f) is not None for f in fields)
    return None if has_result or _text_of(attrs.get("gen_ai.evaluation.explanation")) else "empty"


def _evaluation(event: SpanEvent, settings: IngestConfig) -> Feedback | None:
    if _evaluation_error(event) is not None:
        return None
    attrs = _event_body(event)
    return result_feedback(
        settings,
        name=_text_of(attrs.get("gen_ai.evaluation.name")),
        score=_number(attrs.get("gen_ai.evaluation.score.value")),
        label=_text_of(attrs.get("gen_ai.evaluation.score.label")),
        explanation=_text_of(attrs.get("gen_ai.evaluation.explanation")),
    )


def result_feedback(
    settings: IngestConfig,
    *,
    name: str,
    score: float | None,
    label: str,
    explanation: str,
    by: str = "",
) -> Feedback | None:
    """One evaluator's result (an evaluation event, an OpenInference annotation) as Feedback:
    a score in [0, 1] is the score (the engine's scale; another scale, 0-100 say, cannot be
    averaged with it, so it goes into the text); a label in ``ingest.pass_labels`` /
    ``fail_labels`` sets ``passed`` (no label: unset, whatever the score); the text is
    ``name score (label, by): explanation``. None when it says nothing."""
    in_range = score is not None and 0.0 <= score <= 1.0
    verdict = label.strip().lower().replace(" ", "_").replace("-", "_")
    passed = (
        True
        if verdict in settings.pass_labels
        else False
        if verdict in settings.fail_labels
        else None
    )
    said = ", ".join(filter(None, [label, by]))
    shown = f"{score:g}" if score is not None and not in_range else ""
    head = " ".join(filter(None, [name, shown, f"({said})" if said else ""]))
    if not (label or shown or explanation):
        head = ""  # a name alone says nothing about the run
    text = f"{head}: {explanation}" if head and explanation else explanation or head
    if not in_range and passed is None and not text:
        return None
    return Feedback(score=score if in_range else None, passed=passed, text=text or None)


__all__ = [
    "BULLET_IDS_ATTRIBUTE",
    "EVALUATION_EVENT",
    "NOT_CAPTURED_TASK",
    "evaluation_errors",
    "evaluations",
    "prompt_key",
    "result_feedback",
    "root_span",
    "trace_from_spans",
]
