"""Trace formats: how a Kafka record or a file line becomes a :class:`~combee_stream.schemas.Trace`.

A format is a small object with a ``name`` and two decoders, ``from_record(key, value)`` for a
traces-topic record and ``from_line(line)`` for a line of a JSONL file; both return a ``Trace``
or raise :class:`~combee_stream.errors.DecodeError` whose ``reason`` becomes the dead-letter
reason. Ingest (the engine's poll loop), ``combee-stream produce`` and offline ``learn`` all
decode through one. A new format goes in a module here and in :data:`FORMATS`; select it with
``kafka.traces_format``.
"""

from __future__ import annotations

from typing import Final, Protocol

from combee_stream.errors import UserError
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


__all__ = ["FORMATS", "NATIVE", "NativeJson", "TraceFormat", "get_format"]
