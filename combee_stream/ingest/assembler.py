"""Assembling traces from spans, log events and feedback that arrive in any order: no Kafka here.

The ingest stage feeds every decoded message in with the message's place (topic, partition,
offset) and asks, now and then, what is due. A trace is *complete* when its root span has ended
and none of its spans arrived for ``ingest.gap_s``; it is then written with the feedback it has,
or waits up to ``ingest.feedback_wait_s`` for feedback that comes later. Anything that cannot
become a trace is a rejection (dead-lettered by the stage), never dropped:

- no root span ``trace_timeout_s`` after the first span (``no_root``), or more spans than
  ``max_spans_per_trace`` (``span_flood``), or spans the mapping cannot read (``unmappable``);
- feedback (evaluation events, FeedbackRecords) for a trace no span of which arrived in time
  (``orphan_feedback``), or for a trace already written (``late_feedback``: the trace was
  learned without it, and a trace is never learned twice);
- spans of a trace already written (``late_span``);
- a complete trace whose feedback never came while ``learn_without_feedback`` is off
  (``no_feedback``).

Offsets: a message is *pending* while any trace it contributed to is open; its offset is done
when the last of them is written or rejected (``engine.offsets.PartitionOffsets`` gives the
committable low watermark per partition). Traces written are remembered with the
highest offset of each partition they came from, so spans read again after a crash (everything
above the committed offsets is read again) are recognised and not written twice.

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
from combee_stream.engine.offsets import PartitionOffsets
from combee_stream.errors import DecodeError
from combee_stream.formats.genai import evaluations, prompt_key, root_span, trace_from_spans
from combee_stream.formats.spans import LogEvent, Span, Telemetry
from combee_stream.schemas import Feedback, FeedbackRecord, Trace

# A message's place: (topic, partition, offset).
Ref = tuple[str, int, int]
TopicPartitionKey = tuple[str, int]

# What a trace learned without any feedback carries: ACE reflects on the trajectory alone then.
NO_FEEDBACK: Final = Feedback(
    text="No feedback was recorded for this run: judge it from its trajectory and output."
)


class WrittenMark(Struct, frozen=True):
    """The state-topic record of a written trace: the highest offset read of each partition it
    came from (``"topic:partition"`` -> offset)."""

    offsets: dict[str, int]


RejectionKind = Literal[
    "no_root",
    "span_flood",
    "unmappable",
    "orphan_feedback",
    "late_feedback",
    "late_span",
    "no_feedback",
]


class Written(Struct, frozen=True, kw_only=True):
    """A trace to write to the traces topic, and its state-topic mark."""

    trace: Trace
    mark: WrittenMark
    feedback_items: int  # how many feedback items were combined into it (0: none came)
    assembly_s: float  # from its first span to now


class Rejected(Struct, frozen=True, kw_only=True):
    """Something that cannot become a trace: dead-lettered with ``reason``."""

    kind: RejectionKind
    reason: str
    trace_id: str
    key: str | None  # the prompt key, when known
    payload: bytes  # what was held, as JSON (the spans, events and feedback)


class _Open:
    """One trace being assembled."""

    __slots__ = (
        "complete_at",
        "feedback",
        "first_seen",
        "last_span_at",
        "last_span_ts",
        "logs",
        "refs",
        "spans",
        "trace_id",
    )

    def __init__(self, trace_id: str, now: float) -> None:
        self.trace_id = trace_id
        self.spans: dict[str, Span] = {}
        self.logs: list[LogEvent] = []
        self.feedback: list[Feedback] = []  # FeedbackRecords, in arrival order
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
            }
        )


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

    def __init__(self, settings: IngestConfig, *, recent: int = 100_000) -> None:
        self._s = settings
        self._open: dict[str, _Open] = {}
        self._holds: dict[Ref, int] = {}  # message -> open traces it still feeds
        self._offsets: dict[TopicPartitionKey, PartitionOffsets] = {}
        # Written traces whose spans may still be read again (above a committed offset), with
        # their highest offsets; and a bounded memory of every recent decision, for late input.
        self._written: dict[str, dict[TopicPartitionKey, int]] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()  # trace id -> "written" | kind
        self._recent_cap = recent

    # ------------------------------------------------------------------ state

    @property
    def open_traces(self) -> int:
        return len(self._open)

    def restore(self, trace_id: str, mark: WrittenMark) -> None:
        """A trace written before (read back from the state topic)."""
        offsets: dict[TopicPartitionKey, int] = {}
        for where, offset in mark.offsets.items():
            topic, _, partition = where.rpartition(":")
            offsets[(topic, int(partition))] = offset
        self._written[trace_id] = offsets
        self._remember(trace_id, "written")

    def forget_written(self, trace_id: str) -> None:
        self._written.pop(trace_id, None)

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
        """Written traces that no read-again can reach any more (every offset they came from
        is below ``committed``): their state-topic records can be deleted."""
        done = [
            trace_id
            for trace_id, offsets in self._written.items()
            if all(tp in committed and offset < committed[tp] for tp, offset in offsets.items())
        ]
        for trace_id in done:
            del self._written[trace_id]
        return done

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
        Returns what is rejected at once (input for a trace already written or rejected)."""
        self._read(ref)
        by_trace: dict[str, tuple[list[Span], list[LogEvent]]] = {}
        for span in telemetry.spans:
            by_trace.setdefault(span.trace_id, ([], []))[0].append(span)
        for log in telemetry.logs:
            by_trace.setdefault(log.trace_id, ([], []))[1].append(log)
        rejected: list[Rejected] = []
        flooded: list[_Open] = []
        for trace_id, (spans, logs) in by_trace.items():
            late = self._late(trace_id, ref, spans, logs, [])
            if late == "again":
                continue
            if late is not None:
                rejected.append(late)
                continue
            entry = self._entry(trace_id, now)
            self._hold(entry, ref)
            for span in spans:
                entry.spans[span.span_id] = span  # a span sent twice counts once
            entry.logs.extend(logs)
            if spans:
                entry.last_span_at = now
                entry.last_span_ts = max(entry.last_span_ts, timestamp)
                entry.complete_at = None  # a new span: the gap starts again
            if len(entry.spans) > self._s.max_spans_per_trace:
                flooded.append(entry)
        # Rejected once the message holds every trace it feeds: a rejection may free it.
        for entry in flooded:
            reason = (
                f"trace {entry.trace_id} has more than {self._s.max_spans_per_trace} spans "
                "(ingest.max_spans_per_trace)"
            )
            rejected.append(self._reject(entry, "span_flood", reason))
        self._settle_if_free(ref)
        return rejected

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
        written = self._written.get(trace_id)
        topic, partition, offset = ref
        if written is not None and offset <= written.get((topic, partition), -1):
            return "again"
        decided = self._recent.get(trace_id)
        if decided is None:
            return None
        has_feedback = bool(feedback) or bool(evaluations(spans, logs))
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
        return Rejected(kind=kind, reason=reason, trace_id=trace_id, key=None, payload=payload)

    # ------------------------------------------------------------------ output

    def due(self, now: float, watermark: float = math.inf) -> list[Written | Rejected]:
        """Everything ready to be written or rejected at ``now`` (removed from the open set).

        ``watermark`` (seconds, record time): every record stamped before it has been read.
        The gap must have passed in both clocks: in arrival time (live, spans still to come
        arrive after ``now``) and in record time (catching up a backlog, the spans of a trace
        on a partition read later arrive seconds apart although they were sent together)."""
        s = self._s
        out: list[Written | Rejected] = []
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
                if now - entry.first_seen >= s.trace_timeout_s:
                    out.append(self._timed_out(entry))
                continue
            assert entry.complete_at is not None
            spans = list(entry.spans.values())
            items = [*evaluations(spans, entry.logs), *entry.feedback]
            if not items and now - entry.complete_at < s.feedback_wait_s:
                continue
            out.append(self._finish(entry, items, now))
        return out

    def _timed_out(self, entry: _Open) -> Rejected:
        if not entry.spans:
            return self._reject(
                entry,
                "orphan_feedback",
                f"feedback for trace {entry.trace_id}, but no span of it arrived within "
                f"{self._s.trace_timeout_s:g} s (ingest.trace_timeout_s)",
            )
        return self._reject(
            entry,
            "no_root",
            f"trace {entry.trace_id} has {len(entry.spans)} span(s) but its root span did not "
            f"arrive within {self._s.trace_timeout_s:g} s (ingest.trace_timeout_s)",
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
        except (DecodeError, ValueError, msgspec.ValidationError) as exc:
            reason = exc.reason if isinstance(exc, DecodeError) else str(exc)
            return self._reject(entry, "unmappable", f"trace {entry.trace_id}: {reason}")
        self._close(entry, "written")
        highest = _highest(entry.refs)
        self._written[entry.trace_id] = highest
        mark = WrittenMark(offsets={f"{t}:{p}": offset for (t, p), offset in highest.items()})
        return Written(
            trace=trace, mark=mark, feedback_items=len(items), assembly_s=now - entry.first_seen
        )

    def _reject(self, entry: _Open, kind: RejectionKind, reason: str) -> Rejected:
        self._close(entry, kind)
        spans = list(entry.spans.values())
        key = prompt_key(spans, self._s) if spans else None
        return Rejected(
            kind=kind, reason=reason, trace_id=entry.trace_id, key=key, payload=entry.payload()
        )

    def _close(self, entry: _Open, decision: str) -> None:
        """The trace is decided: it is no longer open, and its messages hold one trace less."""
        self._open.pop(entry.trace_id, None)
        self._remember(entry.trace_id, decision)
        for ref in entry.refs:
            self._holds[ref] -= 1
            self._settle_if_free(ref)

    def _remember(self, trace_id: str, decision: str) -> None:
        self._recent[trace_id] = decision
        self._recent.move_to_end(trace_id)
        while len(self._recent) > self._recent_cap:
            self._recent.popitem(last=False)


def _highest(refs: Iterable[Ref]) -> dict[TopicPartitionKey, int]:
    highest: dict[TopicPartitionKey, int] = {}
    for topic, partition, offset in refs:
        highest[(topic, partition)] = max(highest.get((topic, partition), -1), offset)
    return highest


__all__ = [
    "NO_FEEDBACK",
    "Assembler",
    "Ref",
    "Rejected",
    "RejectionKind",
    "Written",
    "WrittenMark",
    "combine_feedback",
]
