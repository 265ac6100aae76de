"""Phoenix / OpenInference annotations as feedback: bodies of the shape Phoenix's REST API takes
(``POST /v1/span_annotations``, ``/v1/trace_annotations``: ``{"data": [...]}``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from combee_stream.config import IngestConfig
from combee_stream.errors import DecodeError
from combee_stream.formats.phoenix import Annotated, decode_annotations, is_annotations
from combee_stream.schemas import Feedback, FeedbackRecord, encode

SETTINGS = IngestConfig()
SPAN = "67f6740bbe1ddc3f"
TRACE = "0af7651916cd43dd8448eb211c80319c"


def body(*items: dict[str, Any]) -> bytes:
    return json.dumps({"data": list(items)}).encode()


def test_span_and_trace_annotations_decode_to_feedback_items() -> None:
    value = body(
        {  # the example of Phoenix's "capture feedback" guide
            "span_id": SPAN.upper(),
            "name": "correctness",
            "annotator_kind": "HUMAN",
            "result": {
                "label": "correct",
                "score": 0.85,
                "explanation": "The response answered the question I asked",
            },
            "metadata": {"model": "gpt-4", "threshold_ms": 500, "confidence": "high"},
            "identifier": "user-123",
        },
        {
            "trace_id": TRACE,
            "name": "helpfulness",
            "annotator_kind": "LLM",
            "result": {"label": "Not Relevant", "score": 85},  # a 0-100 scale
        },
        {"trace_id": TRACE, "name": "thumbs", "annotator_kind": "CODE", "result": {"score": 1}},
    )
    assert is_annotations(value)
    assert decode_annotations(value, SETTINGS) == [
        Annotated(
            on="span",
            id=SPAN,
            upsert=("correctness", "user-123"),
            feedback=Feedback(
                score=0.85,
                passed=True,
                text="correctness (correct, HUMAN): The response answered the question I asked",
            ),
        ),
        Annotated(
            on="trace",
            id=TRACE,
            upsert=("helpfulness", ""),
            # 85 is no score in [0, 1]: kept in the text only; the label is a fail label
            feedback=Feedback(passed=False, text="helpfulness 85 (Not Relevant, LLM)"),
        ),
        Annotated(on="trace", id=TRACE, upsert=("thumbs", ""), feedback=Feedback(score=1.0)),
    ]


def test_pass_and_fail_labels_are_configurable() -> None:
    value = body(
        {
            "span_id": SPAN,
            "name": "review",
            "annotator_kind": "HUMAN",
            "result": {"label": "ship it"},
        }
    )
    [default] = decode_annotations(value, SETTINGS)
    assert default.feedback == Feedback(text="review (ship it, HUMAN)")  # neither: unset
    [custom] = decode_annotations(value, IngestConfig(pass_labels=["ship_it"]))
    assert custom.feedback.passed is True


def test_a_feedback_record_is_not_an_annotations_body() -> None:
    record = FeedbackRecord(key="calc-bot", trace_id=TRACE, feedback=Feedback(passed=True))
    assert not is_annotations(encode(record))
    assert not is_annotations(b"not json")


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ({"name": "c", "annotator_kind": "HUMAN", "result": {"score": 1}}, "exactly one of"),
        (
            {"span_id": SPAN, "trace_id": TRACE, "name": "c", "annotator_kind": "HUMAN"},
            "exactly one of",
        ),
        (
            {"span_id": "xyz", "name": "c", "annotator_kind": "HUMAN", "result": {"score": 1}},
            "span_id 'xyz': not 16 hex characters",
        ),
        (
            {"trace_id": SPAN, "name": "c", "annotator_kind": "LLM", "result": {"score": 1}},
            "not 32 hex characters",
        ),
        ({"span_id": SPAN, "name": "c", "annotator_kind": "LLM"}, "has no result"),
        ({"span_id": SPAN, "name": "c", "annotator_kind": "ROBOT"}, "invalid Phoenix"),
    ],
)
def test_bad_annotations_are_rejected(item: dict[str, Any], reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        decode_annotations(body(item), SETTINGS)


def test_an_empty_body_is_rejected() -> None:
    with pytest.raises(DecodeError, match="has no annotation"):
        decode_annotations(b'{"data": []}', SETTINGS)
