"""What a prompt version costs the broker: the record batches publishing it writes, the unit
``max.message.bytes`` bounds (``kafka.max_message_bytes`` for every driver: the learner's size
bound is this measure, handed to it by the wiring)."""

from __future__ import annotations

from aiokafka.record.default_records import DefaultRecordBatchBuilder

from combee_stream.kafka.history import version_key
from combee_stream.schemas import PromptUpdate, encode


def record_bytes(key: bytes, value: bytes | None) -> int:
    """The size of a record batch holding one record (the unit ``max.message.bytes`` bounds):
    aiokafka's upper bound of the v2 framing plus the key and value."""
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, []))


def update_bytes(update: PromptUpdate) -> int:
    """The largest record batch publishing ``update`` writes (prompts or history topic)."""
    value = encode(update)
    return max(
        record_bytes(update.key.encode(), value),
        record_bytes(version_key(update.key, update.version), value),
    )


__all__ = ["record_bytes", "update_bytes"]
