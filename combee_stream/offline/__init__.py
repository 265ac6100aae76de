"""Offline learning over a file: the engine's key pipelines with a file source and sink."""

from combee_stream.offline.run import FailedTraceReport, LearnReport, LeftOutReport, run_learn
from combee_stream.offline.source import BadLine, TraceFile, read_traces
from combee_stream.offline.store import History, OutputDir

__all__ = [
    "BadLine",
    "FailedTraceReport",
    "History",
    "LearnReport",
    "LeftOutReport",
    "OutputDir",
    "TraceFile",
    "read_traces",
    "run_learn",
]
