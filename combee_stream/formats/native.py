"""The native format: one ``Trace`` as JSON per record (or line), keyed by its prompt key."""

from __future__ import annotations

from combee_stream.errors import DecodeError
from combee_stream.schemas import Trace, decode


class NativeJson:
    """``Trace`` JSON, decoded strictly (unknown fields, wrong types, newer schemas and keys
    named twice in one object rejected)."""

    name = "native"

    def from_line(self, line: bytes | str) -> Trace:
        return decode(line, Trace, unique_keys=True)

    def from_record(self, key: bytes | None, value: bytes | None) -> Trace:
        if value is None:
            raise DecodeError("record has no value (tombstone)")
        trace = self.from_line(value)
        record_key = key.decode(errors="replace") if key is not None else None
        if record_key != trace.key:
            # A wrong Kafka key would put the trace in another key's partition and break
            # co-partitioning with the prompts topic.
            raise DecodeError(
                f"record key {record_key!r} does not match trace key {trace.key!r}: "
                "traces must be keyed by their prompt key"
            )
        return trace


__all__ = ["NativeJson"]
