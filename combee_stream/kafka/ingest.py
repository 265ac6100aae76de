"""Ingest: decode traces-topic records through a trace format; anything bad becomes a dead letter.

A bad record never blocks its partition and is never dropped silently: it is copied byte for
byte to the DLQ with headers that say why and where it came from (:mod:`combee_stream.kafka.dlq`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from combee_stream.errors import DecodeError
from combee_stream.formats import NATIVE, TraceFormat
from combee_stream.kafka.dlq import DeadLetter, send_dead_letter
from combee_stream.schemas import Source, Trace


class IngestedTrace(msgspec.Struct, frozen=True):
    trace: Trace
    source: Source


def classify(record: Any, fmt: TraceFormat = NATIVE) -> IngestedTrace | DeadLetter:
    """Turn one aiokafka ConsumerRecord into a trace or a dead letter."""
    try:
        trace = fmt.from_record(record.key, record.value)
    except DecodeError as exc:
        return DeadLetter.of_record(record, exc.reason, "decode")
    return IngestedTrace(trace, Source(trace.trace_id, record.partition, record.offset))


async def ingest(
    consumer: AIOKafkaConsumer,
    producer: AIOKafkaProducer,
    dlq_topic: str,
    *,
    fmt: TraceFormat = NATIVE,
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
                item = classify(record, fmt)
                if isinstance(item, DeadLetter):
                    await send_dead_letter(producer, dlq_topic, item)
                else:
                    yield item


__all__ = ["IngestedTrace", "classify", "ingest"]
