"""Trace formats: how a Kafka record or a file line becomes a :class:`~combee_stream.schemas.Trace`.

A format is a small object with a ``name`` and two decoders, ``from_record(key, value)`` for a
traces-topic record and ``from_line(line)`` for a line of a JSONL file; both return a ``Trace``
or raise :class:`~combee_stream.errors.DecodeError` whose ``reason`` becomes the dead-letter
reason. Ingest (the engine's poll loop), ``combee-stream produce`` and offline ``learn`` all
decode through one. A new format goes in a module here and in :data:`FORMATS`; select it with
``kafka.traces_format``; :func:`trace_format` gives it with the task bound of the config
(``learning.max_task_chars``), as every driver reads traces.
"""

from __future__ import annotations

from typing import Final, Literal, Protocol

import msgspec

from combee_stream.config import Config
from combee_stream.errors import DecodeError, UserError
from combee_stream.formats.native import NativeJson
from combee_stream.schemas import Trace


class TraceFormat(Protocol):
    name: str

    def from_record(self, key: bytes | None, value: bytes | None) -> Trace:
        """A traces-topic record as a Trace; DecodeError(reason) when it is not one."""
        ...

    def from_line(self, line: bytes | str) -> Trace:
        """One line of a trace file as a Trace; DecodeError(reason) when it is not one."""
        ...


NATIVE: Final = NativeJson()
FORMATS: Final[dict[str, TraceFormat]] = {NATIVE.name: NATIVE}


def get_format(name: str) -> TraceFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UserError(f"unknown trace format {name!r} (one of {', '.join(FORMATS)})") from None


def bound_task(trace: Trace, max_chars: int, on_long: Literal["cut", "dead_letter"]) -> Trace:
    """``trace`` with a task of at most ``max_chars`` characters: a longer one is cut there and
    ends with a line saying so (``"cut"``), or raises DecodeError (``"dead_letter"``)."""
    size = len(trace.task)
    if size <= max_chars:
        return trace
    if on_long == "dead_letter":
        raise DecodeError(
            f"task of {size} characters > learning.max_task_chars = {max_chars} "
            "(learning.long_task = dead_letter)"
        )
    marker = f"\n[task cut: the first {max_chars} of {size} characters (learning.max_task_chars)]"
    return msgspec.structs.replace(trace, task=trace.task[:max_chars] + marker)


class BoundedTasks:
    """A format whose traces' tasks are bounded (:func:`bound_task`)."""

    def __init__(
        self, inner: TraceFormat, max_chars: int, on_long: Literal["cut", "dead_letter"]
    ) -> None:
        self.name = inner.name
        self._inner, self._max, self._on_long = inner, max_chars, on_long

    def from_record(self, key: bytes | None, value: bytes | None) -> Trace:
        return bound_task(self._inner.from_record(key, value), self._max, self._on_long)

    def from_line(self, line: bytes | str) -> Trace:
        return bound_task(self._inner.from_line(line), self._max, self._on_long)


def trace_format(config: Config) -> TraceFormat:
    """The configured format (``kafka.traces_format``) with the configured task bound."""
    learning = config.learning
    inner = get_format(config.kafka.traces_format)
    return BoundedTasks(inner, learning.max_task_chars, learning.long_task)


__all__ = [
    "FORMATS",
    "NATIVE",
    "BoundedTasks",
    "NativeJson",
    "TraceFormat",
    "bound_task",
    "get_format",
    "trace_format",
]
