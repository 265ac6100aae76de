"""One trace's OpenTelemetry spans as a native :class:`~combee_stream.schemas.Trace`.

The messages come from the GenAI semantic conventions and OpenInference, read by
:mod:`~combee_stream.formats.messages` (every convention and version it knows); this module maps
a trace's spans and their messages to the fields of a trace:

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

A trace's feedback, its evaluation events and the rule they follow, is in
:mod:`~combee_stream.formats.feedback`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from combee_stream.config import IngestConfig
from combee_stream.errors import DecodeError
from combee_stream.formats.messages import (
    USER_ROLES,
    Message,
    Part,
    SpanView,
    events_by_span,
    first_attribute,
    first_str,
    is_agent,
    is_llm,
    is_tool,
    number,
    span_view,
    text_of,
)
from combee_stream.formats.spans import LogEvent, Span
from combee_stream.schemas import Feedback, Key, Step, Trace, check_id, decode, encode

NOT_CAPTURED_TASK: Final = (
    "(the agent's input was not captured: enable message content capture in its instrumentation)"
)

BULLET_IDS_ATTRIBUTE: Final = "combee.bullet_ids"

_STATUS_ERROR: Final = 2


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
        value = first_str(ordered, attribute)
        if value is None:
            value = first_str(ordered, attribute, resource=True)
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
    views = [span_view(span, events) for span, events in events_by_span(ordered, logs)]
    task = _task(views)
    captured = task is not None
    if task is None:
        if not any(is_agent(s) or is_llm(s) or is_tool(s) for s in ordered):
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


def _start_key(span: Span) -> tuple[int, int, str]:
    return (span.start_ns, span.end_ns, span.span_id)


def _ordered(spans: Sequence[Span]) -> list[Span]:
    """The root first, then the others by start time."""
    root = root_span(spans)
    rest = sorted((span for span in spans if span is not root), key=_start_key)
    return rest if root is None else [root, *rest]


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
    value = first_attribute(ordered, attribute)
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
    value = first_str(ordered, attribute)
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


def _task(views: Sequence[SpanView]) -> str | None:
    for messages in (v.inputs for v in views):
        users = [m.text for m in messages if m.role in USER_ROLES and m.text.strip()]
        if users:
            return users[-1]  # in a conversation the latest turn; earlier ones are history
    root_input = views[0].span.attributes.get("input.value")
    if isinstance(root_input, str) and root_input.strip():
        return root_input
    for messages in (v.oi_inputs for v in views):
        users = [m.text for m in messages if m.role in USER_ROLES and m.text.strip()]
        if users:
            return users[-1]
    return None


def _is_reply(message: Message) -> bool:
    return message.role not in USER_ROLES and message.role not in ("system", "developer", "tool")


def _last_reply_text(messages: Sequence[Message]) -> str:
    texts = [m.text for m in messages if _is_reply(m) and m.text.strip()]
    return texts[-1] if texts else ""


def _output(views: Sequence[SpanView]) -> str:
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


def _tool_call(span: Span) -> Part:
    """The call a tool span made. OpenInference's ``tool.parameters`` is the tool's parameter
    schema, not the call's arguments: ``input.value`` is."""
    name = text_of(first_attribute([span], "gen_ai.tool.name", "tool.name")) or span.name
    arguments = text_of(first_attribute([span], "gen_ai.tool.call.arguments", "input.value"))
    call_id = text_of(first_attribute([span], "gen_ai.tool.call.id", "tool_call.id"))
    return Part("tool_call", arguments, name, call_id or None)


def _signature(call: Part) -> str:
    return f"{call.name}\n{call.content}"


def _tool_result(span: Span) -> str:
    return text_of(first_attribute([span], "gen_ai.tool.call.result", "output.value"))


def _error_text(span: Span) -> str:
    return span.status_message or text_of(span.attributes.get("error.type")) or "failed"


def _steps(views: Sequence[SpanView], limit: int) -> list[Step]:
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
        if is_tool(view.span):
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
        if is_tool(span):
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
        if is_agent(span):
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
        if not outputs and is_llm(span):
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


def _tokens(views: Sequence[SpanView]) -> tuple[int, int] | None:
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
            if is_agent(view.span) != agents:
                continue
            for side, candidates in enumerate(names):
                count = number(first_attribute([view.span], *candidates))
                if count is not None:
                    found = True
                    totals[side] += int(count)
        if found:
            return totals[0], totals[1]
    return None


def _metadata(views: Sequence[SpanView], captured: bool) -> dict[str, str]:
    spans = [view.span for view in views]
    metadata = {"source": "otlp", "content_captured": "true" if captured else "false"}
    agent = first_attribute(spans, "gen_ai.agent.name", "agent.name")
    if agent is not None:
        metadata["agent"] = text_of(agent)
    conversation = first_attribute(spans, "gen_ai.conversation.id", "session.id")
    if conversation is not None:
        metadata["conversation"] = text_of(conversation)
    model = first_attribute(
        [s for s in spans if is_llm(s)],
        "gen_ai.response.model",
        "gen_ai.request.model",
        "llm.model_name",
    )
    if model is not None:
        metadata["model"] = text_of(model)
    tokens = _tokens(views)
    if tokens is not None:
        metadata["tokens_in"], metadata["tokens_out"] = str(tokens[0]), str(tokens[1])
    return metadata


__all__ = [
    "BULLET_IDS_ATTRIBUTE",
    "NOT_CAPTURED_TASK",
    "prompt_key",
    "root_span",
    "trace_from_spans",
]
