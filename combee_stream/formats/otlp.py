"""OTLP decoding: one Kafka message of the Collector's kafka exporter as spans or log events.

The Collector writes one export request per message: an ``ExportTraceServiceRequest`` for the
spans topic, an ``ExportLogsServiceRequest`` for the logs topic (``TracesData``/``LogsData``
have the same field numbers, so either reads). Two encodings:

- ``otlp_proto``: the request in protobuf binary.
- ``otlp_json``: the OTLP/JSON encoding, the protobuf JSON mapping with OTLP's own rules: trace
  and span ids are hex strings (not base64), 64-bit integers may be strings or numbers, enums
  are numbers, and keys are lowerCamelCase or the proto's snake_case (receivers accept both;
  unknown keys are ignored). Base64 ids, which exporters that use protobuf's plain mapping
  write, are read too.

Values become :mod:`combee_stream.formats.spans` objects: ids as lowercase hex, attributes as a
flat dict (AnyValue string/bool/int/double as Python values, arrays as lists, kvlists as dicts,
bytes as hex). A log record becomes a :class:`LogEvent` named by its ``event_name`` field or its
``event.name`` attribute; a record without a trace id cannot join a trace: an application log
line is not returned, a ``gen_ai.evaluation.result`` (feedback) is, in ``Telemetry.untraced``.

Anything that is not such a request raises :class:`DecodeError` with a one-line reason: bytes
protobuf cannot parse (a truncated message), a span or log record with a field of the wrong
wire type, a span without a 16-byte trace id or an 8-byte span id, or a request that carries no
span (no log record) at all. The other signal's request (logs read from the spans topic, say) is
named as such, whatever its ids: ``OTLP protobuf logs, not traces`` (or ``OTLP JSON ...``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeAlias

import msgspec
from google.protobuf import json_format
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from combee_stream.errors import DecodeError
from combee_stream.formats.spans import EVALUATION_EVENT, LogEvent, Span, SpanEvent, Telemetry
from combee_stream.schemas import check_unique_keys

Encoding: TypeAlias = Literal["otlp_proto", "otlp_json"]
Signal: TypeAlias = Literal["traces", "logs"]

_TRACE_ID_BYTES = 16
_SPAN_ID_BYTES = 8
# JSON keys of the request tree, camelCase first (what the Collector writes), then snake_case.
_RESOURCE = {
    "traces": ("resourceSpans", "resource_spans"),
    "logs": ("resourceLogs", "resource_logs"),
}
_SCOPE = {"traces": ("scopeSpans", "scope_spans"), "logs": ("scopeLogs", "scope_logs")}
_ITEMS = {"traces": ("spans",), "logs": ("logRecords", "log_records")}
_REQUEST = {"traces": "ExportTraceServiceRequest", "logs": "ExportLogsServiceRequest"}
_OTHER: dict[Signal, Signal] = {"traces": "logs", "logs": "traces"}


def decode_telemetry(value: bytes, encoding: Encoding, kind: Signal) -> Telemetry:
    """The spans (``kind="traces"``) or trace-bound log events (``"logs"``) of one message."""
    if not value:
        raise DecodeError(f"empty value: not an OTLP {_REQUEST[kind]}")
    if encoding == "otlp_proto":
        try:
            return _telemetry(_parse_proto(value, kind))
        except DecodeError:
            # Logs and traces share field numbers, so protobuf may or may not parse the one as
            # the other (it depends on the bytes of the ids); which error that gives is chance.
            # The other signal's request, read cleanly, is named as such instead.
            other = _OTHER[kind]
            if _reads_as(value, other):
                raise DecodeError(
                    f"OTLP protobuf {other}, not {kind}: read from the wrong topic?"
                ) from None
            raise
    if encoding == "otlp_json":
        return _telemetry(_parse_json(value, kind))
    raise DecodeError(f"unknown OTLP encoding {encoding!r} (otlp_proto or otlp_json)")


def _telemetry(request: ExportTraceServiceRequest | ExportLogsServiceRequest) -> Telemetry:
    if isinstance(request, ExportTraceServiceRequest):
        return Telemetry(spans=_spans(request))
    events, untraced = _logs(request)
    return Telemetry(logs=events, untraced=untraced)


def _reads_as(value: bytes, kind: Signal) -> bool:
    """Whether ``value`` is a valid protobuf request of ``kind``."""
    try:
        _telemetry(_parse_proto(value, kind))
    except DecodeError:
        return False
    return True


# --------------------------------------------------------------------------- parsing


def _new_request(kind: Signal) -> ExportTraceServiceRequest | ExportLogsServiceRequest:
    return ExportTraceServiceRequest() if kind == "traces" else ExportLogsServiceRequest()


def _parse_proto(
    value: bytes, kind: Signal
) -> ExportTraceServiceRequest | ExportLogsServiceRequest:
    request = _new_request(kind)
    try:
        request.ParseFromString(value)
    except (ProtobufDecodeError, ValueError) as exc:
        raise DecodeError(f"not an OTLP protobuf {_REQUEST[kind]}: {exc}") from None
    return request


def _parse_json(value: bytes, kind: Signal) -> ExportTraceServiceRequest | ExportLogsServiceRequest:
    try:
        document = msgspec.json.decode(value)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not OTLP JSON: {exc}") from None
    check_unique_keys(value)
    if not isinstance(document, dict):
        raise DecodeError(f"not an OTLP JSON {_REQUEST[kind]}: the value is not a JSON object")
    other: Signal = "logs" if kind == "traces" else "traces"
    if not _any_key(document, _RESOURCE[kind]) and _any_key(document, _RESOURCE[other]):
        raise DecodeError(f"OTLP JSON {other}, not {kind}: read from the wrong topic?")
    for resource in _list(document, _RESOURCE[kind]):
        for scope in _list(resource, _SCOPE[kind]):
            for item in _list(scope, _ITEMS[kind]):
                _hex_ids_to_base64(item)
                for link in _list(item, ("links",)):
                    _hex_ids_to_base64(link)
    request = _new_request(kind)
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise DecodeError(f"not an OTLP JSON {_REQUEST[kind]}: {_one_line(exc)}") from None
    return request


def _any_key(document: Mapping[str, Any], keys: Iterable[str]) -> bool:
    return any(key in document for key in keys)


def _list(document: Any, keys: tuple[str, ...]) -> list[Any]:
    """The list under the first of ``keys`` present (a wrong type is left for ParseDict)."""
    if isinstance(document, dict):
        for key in keys:
            found = document.get(key)
            if isinstance(found, list):
                return found
    return []


_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")


def _hex_ids_to_base64(item: Any) -> None:
    """Rewrite OTLP/JSON's hex ids in place as the base64 that protobuf's JSON mapping reads."""
    if not isinstance(item, dict):
        return
    for key in _ID_KEYS:
        text = item.get(key)
        if isinstance(text, str) and text:
            item[key] = base64.b64encode(_id_bytes(text, key)).decode()


def _id_bytes(text: str, key: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        pass
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise DecodeError(f"{key} {text[:40]!r} is neither hex nor base64") from None


def _one_line(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- conversion


def _hex_id(raw: bytes, size: int, where: str, field: str, *, required: bool) -> str:
    """``raw`` as lowercase hex, checked: ``size`` bytes and not all zero (or empty when not
    ``required``). A wrong size is the surest sign of bytes that parsed by accident."""
    if not raw and not required:
        return ""
    if len(raw) != size:
        raise DecodeError(f"{where} has a {len(raw)}-byte {field} ({size} bytes expected)")
    if not any(raw):
        if not required:
            return ""
        raise DecodeError(f"{where} has an all-zero {field} (an invalid id)")
    return raw.hex()


def _check_wire_types(message: Message, where: str) -> None:
    """A known field number among the unknown fields is a field of the wrong wire type: protobuf
    keeps it aside, silently. A span and a log record differ so at once (field 1 is a span's
    trace id, bytes, but a log record's time, fixed64); the levels above them do not."""
    known = message.DESCRIPTOR.fields_by_number
    for unknown in UnknownFieldSet(message):
        if unknown.field_number in known:
            field = known[unknown.field_number].name
            raise DecodeError(
                f"{where} has its field {unknown.field_number} ({field}) of the wrong wire type"
            )


def _spans(request: ExportTraceServiceRequest) -> list[Span]:
    spans: list[Span] = []
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                where = f"span {len(spans)}"
                _check_wire_types(span, where)
                spans.append(_span(span, where, resource, scope_spans.scope.name))
    if not spans:
        raise DecodeError("the ExportTraceServiceRequest carries no span (a truncated message?)")
    return spans


def _span(span: PbSpan, where: str, resource: dict[str, Any], scope: str) -> Span:
    return Span(
        trace_id=_hex_id(span.trace_id, _TRACE_ID_BYTES, where, "trace id", required=True),
        span_id=_hex_id(span.span_id, _SPAN_ID_BYTES, where, "span id", required=True),
        parent_span_id=_hex_id(
            span.parent_span_id, _SPAN_ID_BYTES, where, "parent span id", required=False
        ),
        name=span.name,
        kind=span.kind,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=attributes(span.attributes),
        events=[
            SpanEvent(
                name=event.name,
                time_ns=event.time_unix_nano,
                attributes=attributes(event.attributes),
            )
            for event in span.events
        ],
        resource=resource,
        scope=scope,
        status_code=span.status.code,
        status_message=span.status.message,
    )


def _logs(request: ExportLogsServiceRequest) -> tuple[list[LogEvent], list[SpanEvent]]:
    """The trace-bound log events, and the evaluation results that name no trace."""
    events: list[LogEvent] = []
    untraced: list[SpanEvent] = []
    records = 0
    for resource_logs in request.resource_logs:
        resource = attributes(resource_logs.resource.attributes)
        for scope_logs in resource_logs.scope_logs:
            for record in scope_logs.log_records:
                where = f"log record {records}"
                records += 1
                _check_wire_types(record, where)
                trace_id = _hex_id(
                    record.trace_id, _TRACE_ID_BYTES, where, "trace id", required=False
                )
                span_id = _hex_id(record.span_id, _SPAN_ID_BYTES, where, "span id", required=False)
                attrs = attributes(record.attributes)
                # event_name is a field since OTLP 1.5; earlier emitters set the attribute.
                name = getattr(record, "event_name", "") or attrs.get("event.name")
                event = SpanEvent(
                    name=name if isinstance(name, str) else "",
                    time_ns=record.time_unix_nano or record.observed_time_unix_nano,
                    attributes=attrs,
                    body=any_value(record.body) if record.HasField("body") else None,
                )
                if trace_id:
                    events.append(
                        LogEvent(trace_id=trace_id, span_id=span_id, event=event, resource=resource)
                    )
                elif event.name == EVALUATION_EVENT:
                    untraced.append(event)
                # else: an application log line, say, which belongs to no trace
    if not records:
        raise DecodeError(
            "the ExportLogsServiceRequest carries no log record (a truncated message?)"
        )
    return events, untraced


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as a Python value (None when it holds none)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP key-values as a dict (a repeated key: the last one wins)."""
    return {pair.key: any_value(pair.value) for pair in pairs}


__all__ = ["Encoding", "Signal", "any_value", "attributes", "decode_telemetry"]
