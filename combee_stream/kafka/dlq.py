"""Dead letters: a record that could not be learned, copied with headers saying why and whence.

A dead letter keeps the original key and value byte for byte (a trace parked after failed
reflections or curation is the trace's own JSON), so it can be inspected and replayed.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
from aiokafka import AIOKafkaProducer

from combee_stream.logs import get_logger
from combee_stream.schemas import SCHEMA_VERSION

log = get_logger(__name__)

H_ERROR: Final = "combee.error"
H_STAGE: Final = "combee.stage"
H_TOPIC: Final = "combee.source.topic"
H_PARTITION: Final = "combee.source.partition"
H_OFFSET: Final = "combee.source.offset"
H_SCHEMA: Final = "combee.schema.version"


class DeadLetter(msgspec.Struct, frozen=True):
    """Why and where a record failed; becomes a DLQ record with the original key and value."""

    reason: str
    stage: str  # "decode" | "reflect" | "curate"
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None

    @classmethod
    def of_record(cls, record: Any, reason: str, stage: str) -> DeadLetter:
        return cls(
            reason=reason,
            stage=stage,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            value=record.value,
        )

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            (H_ERROR, self.reason.encode()),
            (H_STAGE, self.stage.encode()),
            (H_TOPIC, self.topic.encode()),
            (H_PARTITION, str(self.partition).encode()),
            (H_OFFSET, str(self.offset).encode()),
            (H_SCHEMA, str(SCHEMA_VERSION).encode()),
        ]


async def send_dead_letter(producer: AIOKafkaProducer, dlq_topic: str, letter: DeadLetter) -> None:
    """Write one dead letter and wait until the broker has it (raises KafkaError if not)."""
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


__all__ = [
    "H_ERROR",
    "H_OFFSET",
    "H_PARTITION",
    "H_SCHEMA",
    "H_STAGE",
    "H_TOPIC",
    "DeadLetter",
    "send_dead_letter",
]
