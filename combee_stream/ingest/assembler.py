"""Assembling traces from spans, log events and feedback that arrive in any order: no Kafka here.

The ingest stage feeds every decoded message in with the message's place (topic, partition,
offset) and asks, now and then, what is due. A trace is *complete* when its root span has ended
and none of its spans arrived for ``ingest.gap_s``. The feedback join:

- With ``ingest.feedback_wait_s`` 0 a complete trace is written at once, with the feedback that
  came before.
- Else a complete trace waits ``feedback_wait_s`` after completing, and every feedback item
  that arrives until it is written is combined (see below): several evaluators may each send a
  ``gen_ai.evaluation.result`` (or an OpenInference annotation) in that time.
- A ``FeedbackRecord`` is final: the application's own verdict on the run, sent once it knows
  the outcome (one per run, combining what it knows). A complete trace that has one is written
  at once, with the items that came before it; an item after that is ``late_feedback``.

Anything that cannot become a trace is a rejection (dead-lettered by the stage), never dropped:

- no root span ``trace_timeout_s`` after the first span, or ``orphan_timeout_s`` after the last
  (``no_root``); a root span that arrived unended (``unended_root``: an SDK exports a span when
  it ends); a trace still receiving spans ``trace_timeout_s`` after its first (``never_quiet``);
  more spans than ``max_spans_per_trace`` (``span_flood``); spans the mapping cannot read, a
  root that ends before it starts among them (``unmappable``);
- an orphan shed to keep within a bound (``orphan_shed``), or a trace of a service at its
  bound with no orphan left to shed (``service_flood``): see *Bounds* below;
- feedback (evaluation events, annotations, FeedbackRecords) for a trace no span of which
  arrived in time (``orphan_feedback``; a span annotation whose span did not arrive in time
  too), or for a trace already written (``late_feedback``: the trace was learned without it,
  and a trace is never learned twice);
- spans of a trace already written (``late_span``);
- a complete trace whose feedback never came while ``learn_without_feedback`` is off
  (``no_feedback``).

Offsets: a message is *pending* while any trace it contributed to is open; its offset is done
when the last of them is written or rejected (``kafka.offsets.PartitionOffsets`` gives the
committable low watermark per partition). Every decision (written, or rejected as
``no_root``, ``span_flood``, ...) is a :class:`TraceMark` on the state topic, in the
transaction of the trace or its dead letter, with the highest offset of each partition the
trace's input came from: input read again after a crash (everything above the committed
offsets is read again) is recognised and neither written nor dead-lettered twice, and input
that comes later is late (a rejected trace's late root is ``late_span``, never a trace). A
written trace's mark is deleted once no read-again can reach it (late input for it then
starts a trace that has no root: ``no_root``); a rejection's mark stays while the decision is
among the ``recent`` remembered (100,000), so the answer to late input survives restarts.

A span annotation (:mod:`combee_stream.formats.phoenix`) joins the trace of its span: the
assembler knows the span ids of open traces, and of the last ``recent_spans`` (100,000) spans
of decided traces (an annotation for one of those is ``late_feedback``). One whose span has not
been read waits for it, as feedback waits for its trace, up to ``trace_timeout_s``.

Bounds. An *orphan* is an open trace with spans but no ended root span (a span with no parent
and an end time) yet. Only a timeout frees one, so a flood of child spans of traces of their
own would hold the stage at ``max_open_traces`` (the spans topic paused for every service)
until each timed out. Three bounds shed the stalest orphan (the longest without a new span)
first, each checked after every message: a service (its first span's ``service.name``) past
``max_open_traces_per_service`` sheds its own stalest orphan, or when it has none its newest
trace is refused (``service_flood``); past ``max_orphan_traces`` orphans, or at
``max_open_traces``, the stalest orphan of all is shed. So a flood from one service is shed
from its own orphans, and the stage pauses only for traces that complete within their gap.

Several feedback items for one trace are combined so (:func:`combine_feedback`): the score is
their mean, ``passed`` is false if any says false (true only if every item that says anything
says true), the ground truth is the last one given, and the texts are kept in arrival order.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final, Literal

import msgspec
from msgspec import Struct

from combee_stream.config import IngestConfig
from combee_stream.errors import DecodeError
from combee_stream.formats import bound_task
from combee_stream.formats.feedback import evaluation_errors, evaluations
from combee_stream.formats.genai import prompt_key, root_span, trace_from_spans
from combee_stream.formats.phoenix import Annotated
from combee_stream.formats.spans import EVALUATION_EVENT, LogEvent, Span, Telemetry
from combee_stream.kafka.offsets import PartitionOffsets
from combee_stream.schemas import Feedback, FeedbackRecord, Trace, encode

# A message's place: (topic, partition, offset).
Ref = tuple[str, int, int]
TopicPartitionKey = tuple[str, int]

# What a trace learned without any feedback carries: ACE reflects on the trajectory alone then.
NO_FEEDBACK: Final = Feedback(
    text="No feedback was recorded for this run: judge it from its trajectory and output."
)


# A trace rejected as a whole; then input rejected on its own (late for a decided trace).
TraceRejection = Literal[
    "no_root",
    "unended_root",
    "never_quiet",
    "span_flood",
    "unmappable",
    "orphan_feedback",
    "no_feedback",
    "orphan_shed",
    "service_flood",
]
RejectionKind = Literal[TraceRejection, "late_feedback", "late_span", "untraced_feedback"]
# What became of a trace (late input changes nothing: it is rejected on its own).
Outcome = Literal["written", TraceRejection]


class TraceMark(Struct, frozen=True):
    """The state-topic record of a decided trace: the highest offset read of each partition its
    input came from (``"topic:partition"`` -> offset), and what it became."""

    offsets: dict[str, int]
    outcome: Outcome = "written"


class Written(Struct, frozen=True, kw_only=True):
    """A trace to write to the traces topic, and its state-topic mark."""

    trace: Trace
    value: bytes  # the trace encoded, as written (checked against the size limit)
    mark: TraceMark
    feedback_items: int  # how many feedback items were combined into it (0: none came)
    evaluation_errors: list[str] = []  # evaluations that gave no result (error.type, "empty")
    assembly_s: float  # from its first span to now


class Rejected(Struct, frozen=True, kw_only=True):
    """Something that cannot become a trace: dead-lettered with ``reason``."""

    kind: RejectionKind
    reason: str
    trace_id: str
    key: str | None  # the prompt key, when known
    payload: bytes  # what was held, as JSON (the spans, events and feedback)
    mark: TraceMark | None = None  # its state-topic record, written with the dead letter
    source: Ref | None = None  # the one message it comes from, when it is one message's


class _Open:
    """One trace being assembled."""

    __slots__ = (
        "annotations",
        "complete_at",
        "feedback",
        "first_seen",
        "last_span_at",
        "last_span_ts",
        "logs",
        "refs",
        "rooted",
        "service",
        "spans",
        "trace_id",
    )

    def __init__(self, trace_id: str, now: float) -> None:
        self.trace_id = trace_id
        self.service = ""  # its first span's resource service.name (set with its first span)
        self.rooted = False  # an ended span with no parent has arrived: not an orphan
        self.spans: dict[str, Span] = {}
        self.logs: list[LogEvent] = []
        self.feedback: list[Feedback] = []  # FeedbackRecords, in arrival order
        # Annotations by (span or trace id, name, identifier): a later one replaces (upserts).
        self.annotations: dict[tuple[str, str, str], Feedback] = {}
        self.refs: set[Ref] = set()
        self.first_seen = now
        self.last_span_at: float | None = None
        self.last_span_ts = -math.inf  # the newest record timestamp (s) of its spans
        self.complete_at: float | None = None  # when it first was complete

    def payload(self) -> bytes:
        return msgspec.json.encode(
            {
                "trace_id": self.trace_id,
                "spans": list(self.spans.values()),
                "logs": self.logs,
                "feedback": self.feedback,
                "annotations": list(self.annotations.values()),
            }
        )


class _Waiting:
    """A span annotation whose span has not been read (yet)."""

    __slots__ = ("item", "ref", "since")

    def __init__(self, item: Annotated, ref: Ref, since: float) -> None:
        self.item, self.ref, self.since = item, ref, since


def combine_feedback(items: Sequence[Feedback]) -> Feedback | None:
    """One Feedback from several (the rule is in the module docstring); None for none."""
    if not items:
        return None
    scores = [i.score for i in items if i.score is not None]
    verdicts = [i.passed for i in items if i.passed is not None]
    truths = [i.ground_truth for i in items if i.ground_truth]
    texts = list(dict.fromkeys(i.text for i in items if i.text))
    return Feedback(
        score=sum(scores) / len(scores) if scores else None,
        passed=all(verdicts) if verdicts else None,
        ground_truth=truths[-1] if truths else None,
        text="\n".join(texts) if texts else None,
    )


class Assembler:
    """``add_*`` what was read, ``due(now)`` what is ready, ``committable()`` how far.

    Everything returned by ``add_*`` and ``due`` must be made durable in the same transaction
    as the offsets ``committable()`` gives next: an item's messages count as done as soon as it
    is returned. When that transaction fails, throw the assembler away and start again from
    the committed offsets and the state topic.
    """

    def __init__(
        self,
        settings: IngestConfig,
        *,
        max_trace_bytes: int = 1_048_576,
        max_task_chars: int = 20_000,
        long_task: Literal["cut", "dead_letter"] = "cut",
        recent: int = 100_000,
        recent_spans: int = 100_000,
    ) -> None:
        self._s = settings
        self._max_bytes = max_trace_bytes  # a larger trace is rejected (the broker would refuse)
        self._task_bound = (max_task_chars, long_task)  # learning.max_task_chars, long_task
        self._open: dict[str, _Open] = {}
        self._holds: dict[Ref, int] = {}  # message -> open traces it still feeds
        self._offsets: dict[TopicPartitionKey, PartitionOffsets] = {}
        # Decided traces whose input may still be read again (above a committed offset), with
        # their highest offsets; and a bounded memory of every recent decision, for late input.
        self._decided: dict[str, dict[TopicPartitionKey, int]] = {}
        self._recent: OrderedDict[str, Outcome] = OrderedDict()
        self._recent_cap = recent
        self._forgotten: list[str] = []  # rejections no longer remembered: marks to delete
        self._spanned = 0  # open traces with at least one span
        # Span id -> trace id, for span annotations: every span of the open traces, and the
        # newest recent_spans of decided ones; and the annotations whose span is not known yet.
        self._open_spans: dict[str, str] = {}
        self._closed_spans: OrderedDict[str, str] = OrderedDict()
        self._closed_cap = recent_spans
        self._waiting: dict[str, list[_Waiting]] = {}
        # Open traces with spans per service, and the orphans (see Bounds), stalest first: all
        # of them and per service.
        self._services: dict[str, int] = {}
        self._orphans: OrderedDict[str, _Open] = OrderedDict()
        self._service_orphans: dict[str, OrderedDict[str, _Open]] = {}

    # ------------------------------------------------------------------ state

    @property
    def open_traces(self) -> int:
        return len(self._open)

    @property
    def orphans(self) -> int:
        return len(self._orphans)

    @property
    def assembling(self) -> int:
        """Open traces with spans: what ``max_open_traces`` bounds (pausing the spans topic
        bounds no more; feedback waiting for its spans must not stop them coming)."""
        return self._spanned

    def restore(self, trace_id: str, mark: TraceMark) -> None:
        """A trace decided before (read back from the state topic, in the order written)."""
        offsets: dict[TopicPartitionKey, int] = {}
        for where, offset in mark.offsets.items():
            topic, _, partition = where.rpartition(":")
            offsets[(topic, int(partition))] = offset
        self._decided[trace_id] = offsets
        self._remember(trace_id, mark.outcome)

    def forget(self, trace_id: str) -> None:
        """A deleted mark (a tombstone read back)."""
        self._decided.pop(trace_id, None)
        self._recent.pop(trace_id, None)

    def start_at(self, topic: str, partition: int, offset: int) -> None:
        """Where reading of a partition starts (its committed offset)."""
        self._offsets[(topic, partition)] = PartitionOffsets(offset)

    def committable(self) -> dict[TopicPartitionKey, int]:
        out: dict[TopicPartitionKey, int] = {}
        for tp, offsets in self._offsets.items():
            at = offsets.committable()
            if at is not None:
                out[tp] = at
        return out

    def settled(self, committed: dict[TopicPartitionKey, int]) -> list[str]:
        """The marks to delete once ``committed`` is: written traces no read-again can reach
        any more (every offset they came from is below ``committed``), and rejections settled
        so and no longer remembered."""
        done = [
            trace_id
            for trace_id, offsets in self._decided.items()
            if all(tp in committed and offset < committed[tp] for tp, offset in offsets.items())
        ]
        out, self._forgotten = self._forgotten, []
        for trace_id in done:
            del self._decided[trace_id]
            if self._recent.get(trace_id, "written") == "written":
                out.append(trace_id)
        return out

    # ------------------------------------------------------------------ input

    def skip(self, ref: Ref) -> None:
        """A message that feeds no trace (the stage dead-letters it as it is: undecodable,
        oversized, a tombstone): done at once, so its offset is committed in the transaction
        that holds its dead letter."""
        self._read(ref)
        self._settle_if_free(ref)

    def _read(self, ref: Ref) -> None:
        topic, partition, offset = ref
        offsets = self._offsets.get((topic, partition))
        if offsets is None:
            offsets = self._offsets[(topic, partition)] = PartitionOffsets()
        offsets.read(offset)
        self._holds.setdefault(ref, 0)

    def _hold(self, entry: _Open, ref: Ref) -> None:
        if ref not in entry.refs:
            entry.refs.add(ref)
            self._holds[ref] = self._holds.get(ref, 0) + 1

    def _settle_if_free(self, ref: Ref) -> None:
        if self._holds.get(ref) == 0:
            del self._holds[ref]
            topic, partition, offset = ref
            self._offsets[(topic, partition)].done(offset)

    def _entry(self, trace_id: str, now: float) -> _Open:
        entry = self._open.get(trace_id)
        if entry is None:
            entry = self._open[trace_id] = _Open(trace_id, now)
        return entry

    def add_telemetry(
        self, telemetry: Telemetry, ref: Ref, now: float, timestamp: float = -math.inf
    ) -> list[Rejected]:
        """The spans and log events of one message (``timestamp``: the record's, in seconds).
        Returns what is rejected at once (input for a trace already written or rejected, and
        evaluation results that name no trace)."""
        self._read(ref)
        rejected: list[Rejected] = []
        if telemetry.untraced:
            n = len(telemetry.untraced)
            rejected.append(
                Rejected(
                    kind="untraced_feedback",
                    reason=f"{n} {EVALUATION_EVENT} log record(s) carry no trace id: they "
                    "cannot join a trace (emit them in the evaluated span's context)",
                    trace_id="",
                    key=None,
                    payload=msgspec.json.encode({"logs": telemetry.untraced}),
                    source=ref,
                )
            )
        by_trace: dict[str, tuple[list[Span], list[LogEvent]]] = {}
        for span in telemetry.spans:
            by_trace.setdefault(span.trace_id, ([], []))[0].append(span)
        for log in telemetry.logs:
            by_trace.setdefault(log.trace_id, ([], []))[1].append(log)
        flooded: list[_Open] = []
        opened: list[_Open] = []  # traces whose first spans this message brought
        for trace_id, (spans, logs) in by_trace.items():
            late = self._late(trace_id, ref, spans, logs, [])
            if late is not None:
                for span in spans:  # a decided trace: its span annotations are late
                    self._closed_span(span.span_id, trace_id)
                if late != "again":
                    rejected.append(late)
                continue
            entry = self._entry(trace_id, now)
            self._hold(entry, ref)
            if spans and not entry.spans:
                self._spanned += 1
                opened.append(entry)
                self._opened(entry, spans[0])
            for span in spans:
                entry.spans[span.span_id] = span  # a span sent twice counts once
                self._open_spans[span.span_id] = trace_id
                for waiting in self._waiting.pop(span.span_id, ()):
                    self._annotate(trace_id, waiting.item, waiting.ref, now)  # (open: not late)
                    self._holds[waiting.ref] -= 1  # now held by the trace instead
            entry.logs.extend(logs)
            if spans:
                entry.last_span_at = now
                entry.last_span_ts = max(entry.last_span_ts, timestamp)
                entry.complete_at = None  # a new span: the gap starts again
                self._track(entry, spans)
            if len(entry.spans) > self._s.max_spans_per_trace:
                flooded.append(entry)
        # Rejected once the message holds every trace it feeds: a rejection may free it.
        for entry in flooded:
            reason = (
                f"trace {entry.trace_id} has more than {self._s.max_spans_per_trace} spans "
                "(ingest.max_spans_per_trace)"
            )
            rejected.append(self._reject(entry, "span_flood", reason))
        rejected.extend(self._shed(opened))
        self._settle_if_free(ref)
        return rejected

    def _opened(self, entry: _Open, first: Span) -> None:
        service = first.resource.get("service.name")
        entry.service = service if isinstance(service, str) else ""
        self._services[entry.service] = self._services.get(entry.service, 0) + 1

    def _track(self, entry: _Open, spans: list[Span]) -> None:
        """After new spans of ``entry``: rooted now, or an orphan that just had a span."""
        if entry.rooted:
            return
        if any(not span.parent_span_id and span.end_ns > 0 for span in spans):
            entry.rooted = True
            self._unorphan(entry)
            return
        mine = self._service_orphans.setdefault(entry.service, OrderedDict())
        for orphans in (self._orphans, mine):
            orphans[entry.trace_id] = entry
            orphans.move_to_end(entry.trace_id)

    def _unorphan(self, entry: _Open) -> None:
        if self._orphans.pop(entry.trace_id, None) is None:
            return
        mine = self._service_orphans[entry.service]
        del mine[entry.trace_id]
        if not mine:
            del self._service_orphans[entry.service]

    def _shed(self, opened: list[_Open]) -> list[Rejected]:
        """Back within the bounds after a message (see Bounds in the module docstring)."""
        s, out = self._s, []
        for service in dict.fromkeys(entry.service for entry in opened):
            cap = s.max_open_traces_per_service
            while self._services.get(service, 0) > cap:
                why = (
                    f"service {service or '(no service.name)'!r} holds more than {cap} open "
                    "traces (ingest.max_open_traces_per_service)"
                )
                mine = self._service_orphans.get(service)
                if mine:
                    out.append(self._shed_orphan(next(iter(mine.values())), why))
                    continue
                mine_new = (e for e in reversed(opened) if e.service == service)
                newest = next((e for e in mine_new if e.trace_id in self._open), None)
                if newest is None:
                    break
                out.append(
                    self._reject(
                        newest,
                        "service_flood",
                        f"trace {newest.trace_id} refused: {why} and none of them is an "
                        "orphan to shed",
                    )
                )
        while len(self._orphans) > s.max_orphan_traces:
            why = f"more than {s.max_orphan_traces} orphans are open (ingest.max_orphan_traces)"
            out.append(self._shed_orphan(next(iter(self._orphans.values())), why))
        while self._spanned >= s.max_open_traces and self._orphans:
            why = f"{self._spanned} traces are open (ingest.max_open_traces)"
            out.append(self._shed_orphan(next(iter(self._orphans.values())), why))
        return out

    def _shed_orphan(self, entry: _Open, why: str) -> Rejected:
        reason = (
            f"trace {entry.trace_id} has {len(entry.spans)} span(s) and no root span yet, and "
            f"is the stalest orphan: shed because {why}"
        )
        return self._reject(entry, "orphan_shed", reason)

    def add_feedback(self, record: FeedbackRecord, ref: Ref, now: float) -> list[Rejected]:
        self._read(ref)
        late = self._late(record.trace_id, ref, [], [], [record.feedback])
        if late is not None:
            self._settle_if_free(ref)
            return [] if late == "again" else [late]
        entry = self._entry(record.trace_id, now)
        self._hold(entry, ref)
        entry.feedback.append(record.feedback)
        return []

    def add_annotations(self, items: Sequence[Annotated], ref: Ref, now: float) -> list[Rejected]:
        """The annotations of one feedback-topic message (a Phoenix annotations body)."""
        self._read(ref)
        rejected: list[Rejected] = []
        for item in items:
            trace_id = item.id
            if item.on == "span":
                known = self._open_spans.get(item.id) or self._closed_spans.get(item.id)
                if known is None:
                    self._waiting.setdefault(item.id, []).append(_Waiting(item, ref, now))
                    self._holds[ref] += 1
                    continue
                trace_id = known
            rejected.extend(self._annotate(trace_id, item, ref, now))
        self._settle_if_free(ref)
        return rejected

    def _annotate(self, trace_id: str, item: Annotated, ref: Ref, now: float) -> list[Rejected]:
        late = self._late(trace_id, ref, [], [], [item.feedback])
        if late is not None:
            return [] if late == "again" else [late]
        entry = self._entry(trace_id, now)
        self._hold(entry, ref)
        upsert = (item.id, *item.upsert)
        entry.annotations.pop(upsert, None)  # the newest in arrival order
        entry.annotations[upsert] = item.feedback
        return []

    def _closed_span(self, span_id: str, trace_id: str) -> None:
        self._closed_spans[span_id] = trace_id
        self._closed_spans.move_to_end(span_id)
        while len(self._closed_spans) > self._closed_cap:
            self._closed_spans.popitem(last=False)

    def _late(
        self,
        trace_id: str,
        ref: Ref,
        spans: list[Span],
        logs: list[LogEvent],
        feedback: list[Feedback],
    ) -> Rejected | Literal["again"] | None:
        """Input for a trace already decided: ``"again"`` when it is a read-again of what was
        written (its offset is not above the trace's highest there), else rejected as late;
        None for a trace not decided."""
        if trace_id in self._open:
            return None
        seen = self._decided.get(trace_id)
        topic, partition, offset = ref
        if seen is not None and offset <= seen.get((topic, partition), -1):
            return "again"
        decided = self._recent.get(trace_id)
        if decided is None:
            return None
        # Its mark now covers this message too: read again, it is not rejected twice.
        seen = self._decided.setdefault(trace_id, {})
        seen[(topic, partition)] = max(seen.get((topic, partition), -1), offset)
        mark = _mark(seen, decided)
        has_feedback = bool(feedback) or any(log.event.name == EVALUATION_EVENT for log in logs)
        kind: RejectionKind = "late_feedback" if has_feedback and not spans else "late_span"
        what = "feedback" if kind == "late_feedback" else "spans"
        reason = (
            f"{what} for trace {trace_id}, which was already written without it (a trace is "
            "learned once)"
            if decided == "written"
            else f"{what} for trace {trace_id}, which was already dead-lettered ({decided})"
        )
        payload = msgspec.json.encode(
            {"trace_id": trace_id, "spans": spans, "logs": logs, "feedback": feedback}
        )
        return Rejected(
            kind=kind, reason=reason, trace_id=trace_id, key=None, payload=payload, mark=mark
        )

    # ------------------------------------------------------------------ output

    def due(self, now: float, watermark: float = math.inf) -> list[Written | Rejected]:
        """Everything ready to be written or rejected at ``now`` (removed from the open set).

        ``watermark`` (seconds, record time): every record stamped before it has been read.
        The gap must have passed in both clocks: in arrival time (live, spans still to come
        arrive after ``now``) and in record time (catching up a backlog, the spans of a trace
        on a partition read later arrive seconds apart although they were sent together)."""
        s = self._s
        out: list[Written | Rejected] = self._unknown_spans(now)
        for entry in list(self._open.values()):
            quiet = (
                entry.last_span_at is not None
                and now - entry.last_span_at >= s.gap_s
                and entry.last_span_ts + s.gap_s <= watermark
            )
            root = root_span(list(entry.spans.values())) if quiet else None
            # A span whose parent has not arrived (yet) is not the root: only a span with no
            # parent at all completes a trace. (An agent whose root span has a remote parent
            # is rejected as no_root after trace_timeout_s.)
            ended = root is not None and not root.parent_span_id and root.end_ns > 0
            if ended and entry.complete_at is None:
                assert entry.last_span_at is not None
                entry.complete_at = entry.last_span_at + s.gap_s
            if not ended:
                orphaned = (
                    entry.last_span_at is not None
                    and not entry.rooted
                    and now - entry.last_span_at >= s.orphan_timeout_s
                )
                if orphaned or now - entry.first_seen >= s.trace_timeout_s:
                    out.append(self._timed_out(entry, orphaned=orphaned))
                continue
            assert entry.complete_at is not None
            spans = list(entry.spans.values())
            items = [
                *evaluations(spans, entry.logs, s),
                *entry.annotations.values(),
                *entry.feedback,
            ]
            final = bool(entry.feedback)  # a FeedbackRecord: nothing more is expected
            if not final and now - entry.complete_at < s.feedback_wait_s:
                continue
            out.append(self._finish(entry, items, now))
        return out

    def _unknown_spans(self, now: float) -> list[Written | Rejected]:
        """Span annotations whose span did not arrive within ``trace_timeout_s``."""
        out: list[Written | Rejected] = []
        timeout = self._s.trace_timeout_s
        for span_id, waiting in list(self._waiting.items()):
            for w in [w for w in waiting if now - w.since >= timeout]:
                waiting.remove(w)
                out.append(
                    Rejected(
                        kind="orphan_feedback",
                        reason=f"annotation {w.item.upsert[0]!r} for span {span_id}, but no "
                        f"span with that id arrived within {timeout:g} s "
                        "(ingest.trace_timeout_s) nor was one read recently",
                        trace_id="",
                        key=None,
                        payload=msgspec.json.encode(w.item),
                        source=w.ref,
                    )
                )
                self._holds[w.ref] -= 1
                self._settle_if_free(w.ref)
            if not waiting:
                del self._waiting[span_id]
        return out

    def _timed_out(self, entry: _Open, *, orphaned: bool = False) -> Rejected:
        s, trace_id = self._s, entry.trace_id
        within = (
            f"within {s.orphan_timeout_s:g} s of its last span (ingest.orphan_timeout_s)"
            if orphaned
            else f"within {s.trace_timeout_s:g} s (ingest.trace_timeout_s)"
        )
        if not entry.spans:
            return self._reject(
                entry,
                "orphan_feedback",
                f"feedback for trace {trace_id}, but no span of it arrived {within}",
            )
        spans = list(entry.spans.values())
        root = root_span(spans)
        if root is not None and not root.parent_span_id and root.end_ns > 0:
            # Ended, yet never gap_s without a new span (in both clocks) until the timeout.
            return self._reject(
                entry,
                "never_quiet",
                f"trace {trace_id} was still receiving spans {s.trace_timeout_s:g} s after its "
                f"first (ingest.trace_timeout_s): never {s.gap_s:g} s without a new span "
                "(ingest.gap_s)",
            )
        unended = next((x for x in spans if not x.parent_span_id and x.end_ns <= 0), None)
        if unended is not None:
            return self._reject(
                entry,
                "unended_root",
                f"trace {trace_id}: its root span {unended.span_id} ({unended.name[:80]!r}) "
                f"arrived but never ended (no end time) {within}; an SDK exports a span once "
                "it ends, so this one was sent unfinished",
            )
        detail = (
            f": span {root.span_id} names parent {root.parent_span_id}, which did not arrive"
            if root is not None
            else ""
        )
        return self._reject(
            entry,
            "no_root",
            f"trace {trace_id} has {len(spans)} span(s) but its root span (one with no parent) "
            f"did not arrive {within}{detail}",
        )

    def _finish(self, entry: _Open, items: list[Feedback], now: float) -> Written | Rejected:
        feedback = combine_feedback(items)
        if feedback is None and not self._s.learn_without_feedback:
            return self._reject(
                entry,
                "no_feedback",
                f"no feedback for trace {entry.trace_id} within {self._s.feedback_wait_s:g} s "
                "(ingest.feedback_wait_s) and ingest.learn_without_feedback is off",
            )
        spans = list(entry.spans.values())
        try:
            trace = trace_from_spans(spans, entry.logs, self._s, feedback=feedback or NO_FEEDBACK)
            trace = bound_task(trace, *self._task_bound)
        except (DecodeError, ValueError, msgspec.ValidationError) as exc:
            reason = exc.reason if isinstance(exc, DecodeError) else str(exc)
            return self._reject(entry, "unmappable", f"trace {entry.trace_id}: {reason}")
        value = encode(trace)
        if len(value) > self._max_bytes:
            # A record the broker would refuse would stop the stage for good.
            return self._reject(
                entry,
                "unmappable",
                f"trace {entry.trace_id} encodes to {len(value)} bytes > kafka.max_message_bytes"
                f" = {self._max_bytes} (fewer spans per trace, or a lower ingest.max_step_chars)",
                payload=value,
            )
        mark = self._close(entry, "written")
        return Written(
            trace=trace,
            value=value,
            mark=mark,
            feedback_items=len(items),
            evaluation_errors=evaluation_errors(spans, entry.logs),
            assembly_s=now - entry.first_seen,
        )

    def _reject(
        self, entry: _Open, kind: TraceRejection, reason: str, *, payload: bytes | None = None
    ) -> Rejected:
        mark = self._close(entry, kind)
        spans = list(entry.spans.values())
        key = prompt_key(spans, self._s) if spans else None
        return Rejected(
            kind=kind,
            reason=reason,
            trace_id=entry.trace_id,
            key=key,
            payload=entry.payload() if payload is None else payload,
            mark=mark,
        )

    def _close(self, entry: _Open, decision: Outcome) -> TraceMark:
        """The trace is decided: it is no longer open, its messages hold one trace less, and
        its mark says so."""
        if self._open.pop(entry.trace_id, None) is not None and entry.spans:
            self._spanned -= 1
            self._services[entry.service] -= 1
            if not self._services[entry.service]:
                del self._services[entry.service]
            self._unorphan(entry)
        for span_id in entry.spans:
            self._open_spans.pop(span_id, None)
            self._closed_span(span_id, entry.trace_id)
        self._remember(entry.trace_id, decision)
        for ref in entry.refs:
            self._holds[ref] -= 1
            self._settle_if_free(ref)
        highest = self._decided[entry.trace_id] = _highest(entry.refs)
        return _mark(highest, decision)

    def _remember(self, trace_id: str, decision: Outcome) -> None:
        self._recent[trace_id] = decision
        self._recent.move_to_end(trace_id)
        while len(self._recent) > self._recent_cap:
            old, outcome = self._recent.popitem(last=False)
            if outcome != "written" and old not in self._decided:
                self._forgotten.append(old)  # (a mark still in _decided goes when settled)


def _mark(offsets: dict[TopicPartitionKey, int], outcome: Outcome) -> TraceMark:
    return TraceMark(offsets={f"{t}:{p}": at for (t, p), at in offsets.items()}, outcome=outcome)


def _highest(refs: Iterable[Ref]) -> dict[TopicPartitionKey, int]:
    highest: dict[TopicPartitionKey, int] = {}
    for topic, partition, offset in refs:
        highest[(topic, partition)] = max(highest.get((topic, partition), -1), offset)
    return highest


__all__ = [
    "NO_FEEDBACK",
    "Assembler",
    "Outcome",
    "Ref",
    "Rejected",
    "RejectionKind",
    "TraceMark",
    "Written",
    "combine_feedback",
]
