"""The ingest assembler on its own (no Kafka): completion, feedback joins, rejections, offsets.

Spans here are the decoded model (what the OTLP decoders produce, tested in test_otlp_format.py
against the real OpenTelemetry libraries); the Kafka side is in test_ingest.py.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from combee_stream.config import IngestConfig
from combee_stream.formats.phoenix import Annotated, decode_annotations
from combee_stream.formats.spans import LogEvent, Span, SpanEvent, Telemetry
from combee_stream.ingest.assembler import NO_FEEDBACK, Assembler, Rejected, TraceMark, Written
from combee_stream.schemas import Feedback, FeedbackRecord

T = "spans"
SETTINGS = IngestConfig(gap_s=1.0, trace_timeout_s=10.0, max_spans_per_trace=5)


def trace_id(n: int) -> str:
    return f"{n:032x}"


def agent_spans(n: int, *, key: str = "support", root_end: int = 9) -> list[Span]:
    """An invoke_agent root with one chat child (task and answer in GenAI semconv attributes)."""
    tid = trace_id(n)
    messages = [{"role": "user", "parts": [{"type": "text", "content": f"question {n}"}]}]
    answer = [{"role": "assistant", "parts": [{"type": "text", "content": f"answer {n}"}]}]
    chat = Span(
        trace_id=tid,
        span_id=f"{n:08x}00000002",
        parent_span_id=f"{n:08x}00000001",
        name="chat sim-llm",
        start_ns=2,
        end_ns=5,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.input.messages": json.dumps(messages),
            "gen_ai.output.messages": json.dumps(answer),
        },
    )
    root = Span(
        trace_id=tid,
        span_id=f"{n:08x}00000001",
        name="invoke_agent",
        start_ns=1,
        end_ns=root_end,
        attributes={"gen_ai.operation.name": "invoke_agent", "combee.prompt.key": key},
    )
    return [chat, root]


def evaluation(n: int, score: float, label: str) -> LogEvent:
    attributes = {"gen_ai.evaluation.score.value": score, "gen_ai.evaluation.score.label": label}
    return LogEvent(
        trace_id=trace_id(n),
        event=SpanEvent(name="gen_ai.evaluation.result", time_ns=10, attributes=attributes),
    )


def written(items: list[Written | Rejected]) -> list[Written]:
    return [i for i in items if isinstance(i, Written)]


def test_a_trace_is_written_once_its_root_ended_and_the_gap_passed() -> None:
    a = Assembler(SETTINGS)
    chat, root = agent_spans(1)
    assert a.add_telemetry(Telemetry(spans=[chat]), (T, 0, 0), now=0.0) == []
    assert a.due(5.0) == [], "no root yet: not complete however long the gap"
    assert a.committable() == {(T, 0): 0}, "the message feeds an open trace: not done"
    a.add_telemetry(Telemetry(spans=[root]), (T, 1, 0), now=5.0)
    assert a.due(5.5) == [], "the gap has not passed since the last span"
    [out] = a.due(6.0)
    assert isinstance(out, Written)
    trace = out.trace
    assert (trace.key, trace.trace_id, trace.task) == ("support", trace_id(1), "question 1")
    assert trace.output == "answer 1" and trace.feedback == NO_FEEDBACK
    assert out.mark == TraceMark(offsets={f"{T}:0": 0, f"{T}:1": 0})
    assert a.committable() == {(T, 0): 1, (T, 1): 1} and a.open_traces == 0


def test_one_message_with_several_traces_is_done_only_when_all_are() -> None:
    a = Assembler(SETTINGS)
    one, two = agent_spans(1), agent_spans(2, root_end=0)  # trace 2's root has not ended
    a.add_telemetry(Telemetry(spans=[*one, *two]), (T, 0, 7), now=0.0)
    assert [o.trace.trace_id for o in written(a.due(2.0))] == [trace_id(1)]
    assert a.committable() == {(T, 0): 7}, "trace 2 still holds offset 7"
    [timed_out] = a.due(11.0)
    assert isinstance(timed_out, Rejected) and timed_out.kind == "unended_root"
    assert timed_out.key == "support" and trace_id(2) in timed_out.reason
    assert a.committable() == {(T, 0): 8}


def test_feedback_before_with_and_after_the_spans() -> None:
    settings = msgspec.structs.replace(SETTINGS, feedback_wait_s=3.0)
    a = Assembler(settings)
    # Before: a FeedbackRecord for trace 1 arrives before any of its spans.
    record = FeedbackRecord(
        key="support", trace_id=trace_id(1), feedback=Feedback(score=1.0, ground_truth="42")
    )
    a.add_feedback(record, ("combee.feedback", 0, 0), now=0.0)
    a.add_telemetry(Telemetry(spans=agent_spans(1)), (T, 0, 0), now=0.5)
    # With: trace 2's evaluation comes as a log event in the same message as its spans.
    a.add_telemetry(
        Telemetry(spans=agent_spans(2), logs=[evaluation(2, 0.0, "fail")]), (T, 0, 1), now=0.5
    )
    # After: trace 3 is complete first, its evaluation comes within the wait.
    a.add_telemetry(Telemetry(spans=agent_spans(3)), (T, 0, 2), now=0.5)
    done = {o.trace.trace_id: o for o in written(a.due(1.5))}
    assert set(done) == {trace_id(1)}, "a FeedbackRecord is final; evaluations wait for more"
    assert done[trace_id(1)].trace.feedback == Feedback(score=1.0, ground_truth="42")
    a.add_telemetry(Telemetry(logs=[evaluation(3, 1.0, "pass")]), ("otlp_logs", 0, 0), now=2.0)
    # A second evaluation of trace 2 after it is complete, within the wait: combined.
    a.add_telemetry(Telemetry(logs=[evaluation(2, 1.0, "pass")]), ("otlp_logs", 0, 1), now=3.0)
    assert written(a.due(4.4)) == [], "complete at 1.5, both wait until 4.5"
    done = {o.trace.trace_id: o for o in written(a.due(4.5))}
    assert set(done) == {trace_id(2), trace_id(3)}
    assert done[trace_id(2)].trace.feedback.passed is False, "one of the two says fail"
    assert done[trace_id(2)].trace.feedback.score == 0.5 and done[trace_id(2)].feedback_items == 2
    assert done[trace_id(3)].trace.feedback.passed is True and done[trace_id(3)].feedback_items == 1
    # Feedback for a trace already written is dead-lettered, never joined (learned once).
    again = FeedbackRecord(key="support", trace_id=trace_id(3), feedback=Feedback(passed=False))
    [rejected] = a.add_feedback(again, ("combee.feedback", 0, 1), now=5.0)
    assert rejected.kind == "late_feedback" and "already written" in rejected.reason


def test_a_trace_without_feedback_is_learned_or_dead_lettered_as_configured() -> None:
    for learn, expected in ((True, Written), (False, Rejected)):
        settings = msgspec.structs.replace(
            SETTINGS, feedback_wait_s=2.0, learn_without_feedback=learn
        )
        a = Assembler(settings)
        a.add_telemetry(Telemetry(spans=agent_spans(1)), (T, 0, 0), now=0.0)
        assert a.due(2.0) == [], "complete at 1.0, waits for feedback until 3.0"
        [out] = a.due(3.0)
        assert isinstance(out, expected)
        if isinstance(out, Rejected):
            assert out.kind == "no_feedback"


def test_orphan_feedback_and_span_floods_are_rejected_with_what_was_held() -> None:
    a = Assembler(SETTINGS)
    a.add_telemetry(Telemetry(logs=[evaluation(9, 1.0, "pass")]), ("otlp_logs", 0, 0), now=0.0)
    [orphan] = a.due(10.0)
    assert isinstance(orphan, Rejected) and orphan.kind == "orphan_feedback"
    assert json.loads(orphan.payload)["logs"], "the evaluation is in the dead letter"
    chat, root = agent_spans(4)
    flood = [msgspec.structs.replace(chat, span_id=f"{i:016x}", name=f"chat {i}") for i in range(6)]
    [rejected] = a.add_telemetry(Telemetry(spans=flood), (T, 0, 0), now=11.0)
    assert rejected.kind == "span_flood" and len(json.loads(rejected.payload)["spans"]) == 6
    [late] = a.add_telemetry(Telemetry(spans=[root]), (T, 0, 1), now=11.5)
    assert late.kind == "late_span" and "dead-lettered (span_flood)" in late.reason
    assert a.open_traces == 0 and a.committable() == {("otlp_logs", 0): 1, (T, 0): 2}


def test_spans_read_again_after_a_restart_are_not_written_twice() -> None:
    a = Assembler(SETTINGS)
    spans = agent_spans(1)
    a.add_telemetry(Telemetry(spans=[spans[0]]), (T, 0, 3), now=0.0)
    a.add_telemetry(Telemetry(spans=[spans[1]]), (T, 0, 4), now=0.0)
    [first] = written(a.due(2.0))
    # A crash before offsets 3 and 4 were committed: the next run restores the mark and reads
    # both messages again, plus a new trace in message 5.
    b = Assembler(SETTINGS)
    b.restore(trace_id(1), first.mark)
    b.start_at(T, 0, 3)
    for offset, telemetry in (
        (3, Telemetry(spans=[spans[0]])),
        (4, Telemetry(spans=[spans[1]])),
        (5, Telemetry(spans=agent_spans(2))),
    ):
        assert b.add_telemetry(telemetry, (T, 0, offset), now=0.0) == []
    assert [o.trace.trace_id for o in written(b.due(2.0))] == [trace_id(2)]
    assert b.committable() == {(T, 0): 6}
    assert b.settled({(T, 0): 6}) == [trace_id(1), trace_id(2)], "marks no read-again reaches"


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([Feedback(score=1.0), Feedback(score=0.0)], Feedback(score=0.5)),
        ([Feedback(passed=True), Feedback(passed=False)], Feedback(passed=False)),
        (
            [Feedback(ground_truth="a", text="x"), Feedback(ground_truth="b", text="y")],
            Feedback(ground_truth="b", text="x\ny"),
        ),
    ],
)
def test_feedback_items_combine_as_documented(items: list[Feedback], expected: Feedback) -> None:
    from combee_stream.ingest import combine_feedback

    assert combine_feedback(items) == expected


def test_catching_up_a_backlog_a_trace_waits_for_the_partitions_behind_it() -> None:
    """Spans sent together are read seconds apart when one partition lags: the gap counts in
    record time too, so the trace is not cut short while a partition is behind its spans."""
    a = Assembler(SETTINGS)
    chat, root = agent_spans(1)
    a.add_telemetry(Telemetry(spans=[root, chat]), (T, 0, 0), now=0.0, timestamp=100.0)
    assert a.due(5.0, watermark=100.5) == [], "a lagging partition is at record time 100.5"
    [out] = a.due(5.0, watermark=101.0)
    assert isinstance(out, Written)


def test_a_rejection_read_again_after_a_restart_is_not_rejected_twice_nor_written() -> None:
    a = Assembler(SETTINGS)
    chat, root = agent_spans(1)
    a.add_telemetry(Telemetry(spans=[chat]), (T, 0, 3), now=0.0)
    [no_root] = a.due(10.0)
    assert isinstance(no_root, Rejected) and no_root.kind == "no_root"
    assert no_root.mark == TraceMark(offsets={f"{T}:0": 3}, outcome="no_root")
    # A crash before offset 3 was committed: the mark is read back, offset 3 again.
    b = Assembler(SETTINGS)
    b.restore(trace_id(1), no_root.mark)
    b.start_at(T, 0, 3)
    assert b.add_telemetry(Telemetry(spans=[chat]), (T, 0, 3), now=0.0) == [], "read again"
    [late] = b.add_telemetry(Telemetry(spans=[root]), (T, 0, 4), now=0.5)
    assert late.kind == "late_span" and "dead-lettered (no_root)" in late.reason
    assert late.mark == TraceMark(offsets={f"{T}:0": 4}, outcome="no_root"), "covers offset 4"
    assert b.due(20.0) == [] and b.open_traces == 0 and b.committable() == {(T, 0): 5}
    assert b.settled({(T, 0): 5}) == [], "a rejection's mark stays while it is remembered"


def test_a_rejection_forgotten_from_the_recent_memory_has_its_mark_deleted() -> None:
    a = Assembler(SETTINGS, recent=1)
    for n in (1, 2):
        a.add_telemetry(Telemetry(spans=[agent_spans(n)[0]]), (T, 0, n), now=0.0)
    assert {r.kind for r in a.due(10.0) if isinstance(r, Rejected)} == {"no_root"}
    assert a.settled({(T, 0): 3}) == [trace_id(1)], "trace 1 fell out of the memory of 1"


def annotation(on: str, ident: str, name: str, label: str, identifier: str = "") -> Annotated:
    value = json.dumps(
        {
            "data": [
                {
                    f"{on}_id": ident,
                    "name": name,
                    "annotator_kind": "HUMAN",
                    "result": {"label": label},
                    "identifier": identifier,
                }
            ]
        }
    ).encode()
    [item] = decode_annotations(value, SETTINGS)
    return item


def test_span_and_trace_annotations_join_their_trace() -> None:
    settings = msgspec.structs.replace(SETTINGS, feedback_wait_s=3.0)
    a = Assembler(settings)
    chat, root = agent_spans(1)
    fb = "combee.feedback"
    # Before its span: the span annotation waits for it (and holds its offset).
    assert (
        a.add_annotations([annotation("span", chat.span_id, "tone", "bad")], (fb, 0, 0), 0.0) == []
    )
    a.add_telemetry(Telemetry(spans=[chat, root]), (T, 0, 0), now=0.5)
    # After: a trace annotation, and one on the root span upserted by a second one.
    a.add_annotations([annotation("trace", trace_id(1), "correctness", "correct")], (fb, 0, 1), 2.0)
    a.add_annotations([annotation("span", root.span_id, "review", "fail", "u1")], (fb, 0, 2), 2.0)
    a.add_annotations([annotation("span", root.span_id, "review", "pass", "u1")], (fb, 0, 3), 2.1)
    assert a.committable() == {(T, 0): 0, (fb, 0): 0}, "all held by the open trace"
    [out] = a.due(4.5)
    assert isinstance(out, Written) and out.feedback_items == 3, "the upserted one replaced"
    assert out.trace.feedback == Feedback(
        passed=False,  # "tone" says bad
        text="tone (bad, HUMAN)\ncorrectness (correct, HUMAN)\nreview (pass, HUMAN)",
    )
    assert a.committable() == {(T, 0): 1, (fb, 0): 4}
    # On a span of the written trace: late, never joined.
    [late] = a.add_annotations([annotation("span", chat.span_id, "x", "pass")], (fb, 0, 4), 5.0)
    assert late.kind == "late_feedback" and trace_id(1) in late.reason


def test_an_annotation_whose_span_never_comes_is_dead_lettered() -> None:
    a = Assembler(SETTINGS)
    fb = "combee.feedback"
    item = annotation("span", "00000000000000ff", "tone", "bad")
    assert a.add_annotations([item], (fb, 0, 0), now=0.0) == []
    assert a.due(9.9) == [] and a.committable() == {(fb, 0): 0}
    [out] = a.due(10.0)  # trace_timeout_s
    assert isinstance(out, Rejected) and out.kind == "orphan_feedback"
    assert "annotation 'tone' for span 00000000000000ff" in out.reason
    assert out.source == (fb, 0, 0) and b'"tone (bad, HUMAN)"' in out.payload
    assert a.committable() == {(fb, 0): 1}, "done with its dead letter"


# --------------------------------------------------------------------------- bounds (issue 18)


def orphan(n: int, service: str = "flood", *, at: int = 1) -> Span:
    """A child span of trace ``n`` whose parent (the root) never comes, as a flood sends."""
    return Span(
        trace_id=trace_id(n),
        span_id=f"{n:08x}{at:08x}",
        parent_span_id=f"{n:08x}ffffffff",
        name="chat",
        start_ns=2,
        end_ns=5,
        resource={"service.name": service},
    )


def bounded(**bounds: float) -> IngestConfig:
    return msgspec.structs.replace(SETTINGS, **bounds)


def rejected(items: list[Rejected] | list[Written | Rejected]) -> list[Rejected]:
    return [i for i in items if isinstance(i, Rejected)]


def test_a_flooding_service_is_shed_from_its_own_orphans_and_the_others_keep_theirs() -> None:
    """Three orphans of a good service (children read before their root, as exporters send
    them), then 50 orphans of a flooding one: the flood is shed from its own orphans, stalest
    first, at max_open_traces_per_service; the good traces keep theirs and complete."""
    a = Assembler(bounded(max_open_traces_per_service=3, max_orphan_traces=10))
    good = [agent_spans(n) for n in (1, 2, 3)]
    for n, (chat, _) in enumerate(good):
        chat = msgspec.structs.replace(chat, resource={"service.name": "calc"})
        assert a.add_telemetry(Telemetry(spans=[chat]), (T, 0, n), now=0.0) == []
    shed: list[Rejected] = []
    for n in range(100, 150):
        shed += a.add_telemetry(Telemetry(spans=[orphan(n)]), (T, 1, n), now=0.1)
    assert [r.kind for r in shed] == ["orphan_shed"] * 47
    assert [r.trace_id for r in shed] == [trace_id(n) for n in range(100, 147)], "stalest first"
    assert "'flood' holds more than 3 open traces (ingest.max_open_traces_per_service)" in (
        shed[0].reason
    )
    assert shed[0].key == "flood" and b'"chat"' in shed[0].payload, "what was held, dead-lettered"
    assert a.open_traces == 6 and a.orphans == 6
    for n, (_, root) in enumerate(good):
        root = msgspec.structs.replace(root, resource={"service.name": "calc"})
        a.add_telemetry(Telemetry(spans=[root]), (T, 0, 10 + n), now=0.2)
    assert sorted(w.trace.trace_id for w in written(a.due(1.2))) == [trace_id(n) for n in (1, 2, 3)]


def test_orphans_of_many_services_are_shed_stalest_first_at_max_orphan_traces() -> None:
    """A flood under a new service name per span is caught by the bound all services share:
    the orphan that went longest without a new span goes first (one that just had a span
    is younger than its first one says)."""
    a = Assembler(bounded(max_orphan_traces=3))
    for n in range(1, 4):
        a.add_telemetry(Telemetry(spans=[orphan(n, f"s{n}")]), (T, 0, n), now=float(n))
    a.add_telemetry(Telemetry(spans=[orphan(1, "s1", at=2)]), (T, 0, 4), now=4.0)  # 1 is fresh
    [shed] = a.add_telemetry(Telemetry(spans=[orphan(5, "s5")]), (T, 0, 5), now=5.0)
    assert (shed.kind, shed.trace_id) == ("orphan_shed", trace_id(2))
    assert "more than 3 orphans are open (ingest.max_orphan_traces)" in shed.reason
    assert a.orphans == 3


def test_a_service_at_its_bound_with_no_orphan_left_refuses_its_newest_trace() -> None:
    a = Assembler(bounded(max_open_traces_per_service=2, feedback_wait_s=60.0))
    assert a.add_telemetry(Telemetry(spans=agent_spans(1)), (T, 0, 0), now=0.0) == []
    assert a.add_telemetry(Telemetry(spans=agent_spans(2)), (T, 0, 1), now=0.0) == []
    [refused] = a.add_telemetry(Telemetry(spans=agent_spans(3)), (T, 0, 2), now=0.0)
    assert (refused.kind, refused.trace_id) == ("service_flood", trace_id(3))
    assert "none of them is an orphan to shed" in refused.reason
    assert a.open_traces == 2 and a.committable() == {(T, 0): 0}


def test_at_max_open_traces_orphans_are_shed_before_the_stage_would_pause() -> None:
    a = Assembler(bounded(max_open_traces=3, feedback_wait_s=60.0))
    a.add_telemetry(Telemetry(spans=agent_spans(1)), (T, 0, 0), now=0.0)  # complete, waiting
    a.add_telemetry(Telemetry(spans=[orphan(2)]), (T, 0, 1), now=0.0)
    [shed] = a.add_telemetry(Telemetry(spans=[orphan(3)]), (T, 0, 2), now=0.0)
    assert (shed.kind, shed.trace_id) == ("orphan_shed", trace_id(2))
    assert "(ingest.max_open_traces)" in shed.reason
    assert a.assembling == 2, "below max_open_traces: the stage does not pause"


def test_an_orphan_expires_orphan_timeout_s_after_its_last_span_with_the_missing_parent() -> None:
    a = Assembler(bounded(orphan_timeout_s=5.0, trace_timeout_s=100.0))
    a.add_telemetry(Telemetry(spans=[orphan(1)]), (T, 0, 0), now=0.0)
    a.add_telemetry(Telemetry(spans=[orphan(1, at=2)]), (T, 0, 1), now=4.0)
    assert a.due(8.9) == [], "a span 4 s in: 5 s since the last one, not the first"
    [out] = rejected(a.due(9.0))
    assert out.kind == "no_root"
    assert "within 5 s of its last span (ingest.orphan_timeout_s)" in out.reason
    assert f"names parent {1:08x}ffffffff, which did not arrive" in out.reason


def test_a_root_sent_unended_or_ending_before_it_starts_is_dead_lettered_as_such() -> None:
    a = Assembler(SETTINGS)
    a.add_telemetry(Telemetry(spans=agent_spans(1, root_end=0)), (T, 0, 0), now=0.0)
    chat, root = agent_spans(2)
    backwards = msgspec.structs.replace(root, start_ns=9_000_000_000, end_ns=8_000_000_000)
    a.add_telemetry(Telemetry(spans=[chat, backwards]), (T, 0, 1), now=0.0)
    [early] = rejected(a.due(1.0))
    assert (early.kind, early.trace_id) == ("unmappable", trace_id(2))
    assert "ends before it starts" in early.reason
    [late] = rejected(a.due(10.0))
    assert (late.kind, late.trace_id) == ("unended_root", trace_id(1))
    assert "arrived but never ended" in late.reason and "did not arrive" not in late.reason


@pytest.mark.parametrize("long_task", ["cut", "dead_letter"])
def test_a_task_over_max_task_chars_is_cut_with_a_marker_or_dead_lettered(long_task: str) -> None:
    a = Assembler(SETTINGS, max_task_chars=8, long_task=long_task)  # type: ignore[arg-type]
    a.add_telemetry(Telemetry(spans=agent_spans(1)), (T, 0, 0), now=0.0)  # task "question 1"
    [out] = a.due(1.0)
    if long_task == "cut":
        assert isinstance(out, Written)
        assert out.trace.task == (
            "question\n[task cut: the first 8 of 10 characters (learning.max_task_chars)]"
        )
    else:
        assert isinstance(out, Rejected) and out.kind == "unmappable"
        assert "task of 10 characters > learning.max_task_chars = 8" in out.reason
