"""Ingest: decode trace records; park anything bad in the dead-letter topic and move on.

A bad record never blocks its partition and is never dropped silently: it is copied byte for
byte to the DLQ with headers that say why and where it came from.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from combee_stream.logs import get_logger
from combee_stream.schemas import SCHEMA_VERSION, DecodeError, Source, Trace, decode

log = get_logger(__name__)

H_ERROR: Final = "combee.error"
H_STAGE: Final = "combee.stage"
H_TOPIC: Final = "combee.source.topic"
H_PARTITION: Final = "combee.source.partition"
H_OFFSET: Final = "combee.source.offset"
H_SCHEMA: Final = "combee.schema.version"


class IngestedTrace(msgspec.Struct, frozen=True):
    trace: Trace
    source: Source


class DeadLetter(msgspec.Struct, frozen=True):
    """Why and where a record failed; becomes a DLQ record with the original key and value."""

    reason: str
    stage: str  # "decode" | "reflect" | ...
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            (H_ERROR, self.reason.encode()),
            (H_STAGE, self.stage.encode()),
            (H_TOPIC, self.topic.encode()),
            (H_PARTITION, str(self.partition).encode()),
            (H_OFFSET, str(self.offset).encode()),
            (H_SCHEMA, str(SCHEMA_VERSION).encode()),
        ]


def decode_trace_record(key: bytes | None, value: bytes | None) -> Trace:
    """Decode a traces-topic record; raise DecodeError with a field-naming reason."""
    if value is None:
        raise DecodeError("record has no value (tombstone)")
    trace = decode(value, Trace)
    record_key = key.decode(errors="replace") if key is not None else None
    if record_key != trace.key:
        # A wrong Kafka key would put the trace in another key's partition and break
        # co-partitioning with the prompts topic.
        raise DecodeError(
            f"record key {record_key!r} does not match trace key {trace.key!r}: "
            "traces must be keyed by their prompt key"
        )
    return trace


async def send_dead_letter(producer: AIOKafkaProducer, dlq_topic: str, letter: DeadLetter) -> None:
    await producer.send_and_wait(
        dlq_topic, value=letter.value, key=letter.key, headers=letter.headers()
    )
    log.warning(
        "record parked in DLQ",
        reason=letter.reason,
        stage=letter.stage,
        topic=letter.topic,
        partition=letter.partition,
        offset=letter.offset,
    )


def classify(record: Any) -> IngestedTrace | DeadLetter:
    """Turn one aiokafka ConsumerRecord into a trace or a dead letter."""
    try:
        trace = decode_trace_record(record.key, record.value)
    except DecodeError as exc:
        return DeadLetter(
            reason=exc.reason,
            stage="decode",
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            value=record.value,
        )
    return IngestedTrace(trace, Source(trace.trace_id, record.partition, record.offset))


async def ingest(
    consumer: AIOKafkaConsumer,
    producer: AIOKafkaProducer,
    dlq_topic: str,
    *,
    poll_timeout_ms: int = 500,
) -> AsyncIterator[IngestedTrace]:
    """Yield decoded traces from a started consumer forever; bad records go to the DLQ.

    The caller owns offset commits. A dead letter is acknowledged by the broker before the
    iterator moves past it, so committing past a bad record never loses it.
    """
    while True:
        batches = await consumer.getmany(timeout_ms=poll_timeout_ms)
        for records in batches.values():
            for record in records:
                item = classify(record)
                if isinstance(item, DeadLetter):
                    await send_dead_letter(producer, dlq_topic, item)
                else:
                    yield item
