"""Feedback from telemetry: the GenAI ``gen_ai.evaluation.result`` events of a trace, and the one
rule (:func:`result_feedback`) by which every evaluator's result becomes
:class:`~combee_stream.schemas.Feedback`, whatever carried it (an evaluation event here, an
OpenInference annotation in :mod:`~combee_stream.formats.phoenix`).

:func:`evaluations` reads the events (span events or log records) as Feedback;
:func:`evaluation_errors` names those that give no result (a failed evaluator's ``error.type``).
"""

from __future__ import annotations

from collections.abc import Sequence

from combee_stream.config import IngestConfig
from combee_stream.formats.messages import distinct_events, event_body, number, text_of
from combee_stream.formats.spans import EVALUATION_EVENT, LogEvent, Span, SpanEvent
from combee_stream.schemas import Feedback


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
    return sorted(distinct_events(events), key=lambda event: event.time_ns)


def _evaluation_error(event: SpanEvent) -> str | None:
    """Why the event gives no result (its ``error.type``, or ``"empty"``); None when it does."""
    attrs = event_body(event)
    if attrs.get("error.type"):
        return text_of(attrs["error.type"])  # the evaluator failed: no verdict on the trace
    fields = ("gen_ai.evaluation.score.value", "gen_ai.evaluation.score.label")
    has_result = any(attrs.get(f) is not None for f in fields)
    return None if has_result or text_of(attrs.get("gen_ai.evaluation.explanation")) else "empty"


def _evaluation(event: SpanEvent, settings: IngestConfig) -> Feedback | None:
    if _evaluation_error(event) is not None:
        return None
    attrs = event_body(event)
    return result_feedback(
        settings,
        name=text_of(attrs.get("gen_ai.evaluation.name")),
        score=number(attrs.get("gen_ai.evaluation.score.value")),
        label=text_of(attrs.get("gen_ai.evaluation.score.label")),
        explanation=text_of(attrs.get("gen_ai.evaluation.explanation")),
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
    "evaluation_errors",
    "evaluations",
    "result_feedback",
]
