"""OpenInference / Arize Phoenix annotations on the feedback topic, as feedback items.

A feedback-topic record is either a native ``FeedbackRecord`` or the JSON body Phoenix's REST
API takes for ``POST /v1/span_annotations`` and ``/v1/trace_annotations`` (what its clients
send), recognised by its top-level ``data`` key, which a FeedbackRecord never has::

    {"data": [{"span_id": "67f6740bbe1ddc3f",        # or "trace_id": 32 hex characters
               "name": "correctness",
               "annotator_kind": "HUMAN",             # LLM, CODE, HUMAN (DECISION, AGENT)
               "result": {"label": "correct", "score": 0.85, "explanation": "..."},
               "metadata": {...}, "identifier": ""}]}

Each item names one span or one trace (span and trace items may be mixed). The result maps as
every evaluator's result does (:func:`~combee_stream.formats.feedback.result_feedback`): a score in
[0, 1] -> score, a label in ``ingest.pass_labels`` / ``fail_labels`` -> passed, and
``name (label, annotator_kind): explanation`` -> text; ``metadata`` is not kept. An annotation
with the same name and identifier on the same span or trace as an earlier one replaces it, as
Phoenix upserts it. A body that is not this shape, an id that is not hex of the right length,
or an item whose result says nothing is a :class:`DecodeError` (the record is dead-lettered).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from combee_stream.config import IngestConfig
from combee_stream.errors import DecodeError
from combee_stream.formats.feedback import result_feedback
from combee_stream.schemas import Feedback, check_unique_keys


class AnnotationResult(Struct, frozen=True):
    label: str | None = None
    score: float | None = None
    explanation: str | None = None


class Annotation(Struct, frozen=True):
    """``SpanAnnotationData`` / ``TraceAnnotationData`` of Phoenix's v1 REST API."""

    name: str
    annotator_kind: Literal["LLM", "CODE", "HUMAN", "DECISION", "AGENT"]
    span_id: str | None = None
    trace_id: str | None = None
    result: AnnotationResult | None = None
    metadata: dict[str, Any] | None = None
    identifier: str = ""


class AnnotationsBody(Struct, frozen=True):
    data: list[Annotation]


class Annotated(Struct, frozen=True, kw_only=True):
    """One annotation as a feedback item: on a span (its trace found by the assembler) or on a
    trace. ``upsert`` is what a later annotation must share to replace it."""

    on: Literal["span", "trace"]
    id: str  # lowercase hex
    upsert: tuple[str, str]  # (name, identifier)
    feedback: Feedback


class _Shape(Struct):
    data: Any = msgspec.UNSET


def is_annotations(value: bytes) -> bool:
    """Whether a feedback-topic value is a Phoenix annotations body (a top-level ``data``)."""
    try:
        shape = msgspec.json.decode(value, type=_Shape)
    except msgspec.DecodeError:
        return False  # not a JSON object at all: the FeedbackRecord decoder says why
    return shape.data is not msgspec.UNSET


def decode_annotations(value: bytes, settings: IngestConfig) -> list[Annotated]:
    try:
        body = msgspec.json.decode(value, type=AnnotationsBody)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"invalid Phoenix annotations body: {exc}") from None
    check_unique_keys(value)
    if not body.data:
        raise DecodeError("the Phoenix annotations body has no annotation (data is empty)")
    return [_annotated(item, i, settings) for i, item in enumerate(body.data)]


def _annotated(item: Annotation, index: int, settings: IngestConfig) -> Annotated:
    where = f"annotation {index} ({item.name!r})"
    if (item.span_id is None) == (item.trace_id is None):
        raise DecodeError(f"{where} needs exactly one of span_id and trace_id")
    on: Literal["span", "trace"] = "span" if item.span_id is not None else "trace"
    raw = item.span_id if item.span_id is not None else item.trace_id
    assert raw is not None
    ident = _hex_id(raw, 16 if on == "span" else 32, where, f"{on}_id")
    result = item.result or AnnotationResult()
    feedback = result_feedback(
        settings,
        name=item.name,
        score=result.score,
        label=result.label or "",
        explanation=result.explanation or "",
        by=item.annotator_kind,
    )
    if feedback is None:
        raise DecodeError(f"{where} has no result (a label, score or explanation)")
    return Annotated(on=on, id=ident, upsert=(item.name, item.identifier), feedback=feedback)


def _hex_id(text: str, length: int, where: str, field: str) -> str:
    ident = text.lower()
    valid = len(ident) == length and all(c in "0123456789abcdef" for c in ident)
    if not valid or not ident.strip("0"):
        raise DecodeError(f"{where} has {field} {text[:40]!r}: not {length} hex characters")
    return ident


__all__ = ["Annotated", "Annotation", "AnnotationsBody", "decode_annotations", "is_annotations"]
