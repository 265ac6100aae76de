"""The input of offline learning: a JSONL file of traces, decoded through a trace format."""

from __future__ import annotations

from pathlib import Path

from msgspec import Struct

from combee_stream.errors import DecodeError, UserError
from combee_stream.formats import NATIVE, TraceFormat
from combee_stream.schemas import Source, Trace


class BadLine(Struct, frozen=True):
    line: int
    reason: str


class TraceFile(Struct):
    traces: list[tuple[Trace, Source]]
    bad: list[BadLine]
    duplicates: int


def read_traces(path: Path, fmt: TraceFormat = NATIVE) -> TraceFile:
    """Every valid trace with its Source; bad lines and repeated trace ids reported, not fatal."""
    traces: list[tuple[Trace, Source]] = []
    bad: list[BadLine] = []
    first_line: dict[str, int] = {}
    duplicates = 0
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise UserError(f"cannot read traces {path}: {exc.strerror or exc}") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                trace = fmt.from_line(raw)
            except (DecodeError, ValueError) as exc:
                bad.append(BadLine(line=number, reason=str(exc)))
                continue
            if trace.trace_id in first_line:
                duplicates += 1
                reason = f"duplicate trace_id {trace.trace_id!r} (first at line "
                bad.append(BadLine(line=number, reason=reason + f"{first_line[trace.trace_id]})"))
                continue
            first_line[trace.trace_id] = number
            traces.append((trace, Source(trace_id=trace.trace_id)))
    return TraceFile(traces=traces, bad=bad, duplicates=duplicates)


__all__ = ["BadLine", "TraceFile", "read_traces"]
