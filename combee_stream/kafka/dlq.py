"""Dead letters: a record that could not be learned, copied with headers saying why and whence.

A dead letter keeps the original key and value byte for byte (a trace parked after failed
reflections or curation is the trace's own JSON), so it can be inspected and replayed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Final

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import ProducerFenced

from combee_stream.config import KafkaConfig
from combee_stream.errors import UserError
from combee_stream.kafka.client import (
    client_kwargs,
    make_producer,
    partitions_of,
    start_client,
    stop_quietly,
)
from combee_stream.kafka.reader import until_end
from combee_stream.logs import get_logger
from combee_stream.schemas import SCHEMA_VERSION

log = get_logger(__name__)

H_ERROR: Final = "combee.error"
H_STAGE: Final = "combee.stage"
H_TOPIC: Final = "combee.source.topic"
H_PARTITION: Final = "combee.source.partition"
H_OFFSET: Final = "combee.source.offset"
H_SCHEMA: Final = "combee.schema.version"
# The stage of a replay's marker: the letter at the partition and offset it names was re-sent.
REPLAYED: Final = "replayed"


class DeadLetter(msgspec.Struct, frozen=True):
    """Why and where a record failed; becomes a DLQ record with the original key and value."""

    reason: str
    # "decode" | "reflect" | "curate" | "size" (its version could not be published) | "ingest";
    # "replayed" for a replay's marker
    stage: str
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

    def bounded(self, cfg: KafkaConfig) -> DeadLetter:
        """This letter with its value cut to half of ``kafka.max_message_bytes`` (the key, the
        headers and the framing fit in the other half), the cut said in its reason: the one
        bound of every dead letter, so writing one never fails for its size."""
        limit = cfg.max_message_bytes // 2
        if self.value is None or len(self.value) <= limit:
            return self
        cut = self.value[:limit]
        reason = f"{self.reason} (value cut to {len(cut)} bytes)"
        return msgspec.structs.replace(self, value=cut, reason=reason)

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
    "REPLAYED",
    "DeadLetter",
    "replay_dead_letters",
    "send_dead_letter",
]


async def replay_dead_letters(
    cfg: KafkaConfig,
    *,
    stages: Collection[str] = ("reflect", "curate"),
    key: str | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Send parked traces back to the traces topic, once: returns how many were re-sent.

    The dead letters of ``stages`` (of ``key`` only, when given) are re-sent byte for byte, keyed
    as they were. Once whatever the selections: each re-sent letter gets a marker on the DLQ
    (stage ``replayed``, in the letter's partition, so after it, naming its partition and
    offset), and a replay first reads the markers and skips the letters they name, so
    overlapping selections (``--stage reflect``, then all stages, then ``--key K``) never re-send
    one twice. The re-sends, their markers and the selection's position (a consumer group per
    selection, ``GROUP.dlq-replay.STAGES.KEY``, so a re-run reads only what came since) are one
    Kafka transaction, under one transactional id for every replay: two replays at once fence
    each other instead of both re-sending. (A trace parked again by the engine is a new dead
    letter, which a later replay picks up.)
    """
    if REPLAYED in stages:
        raise UserError(f"{REPLAYED!r} letters are replay markers, not traces to replay")
    selection = f"{'+'.join(sorted(stages))}.{key or 'any'}"
    group = f"{cfg.group_id}.dlq-replay.{selection}"
    consumer = AIOKafkaConsumer(
        **client_kwargs(cfg, env),
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    producer = make_producer(cfg, env, transactional_id=f"{cfg.group_id}.dlq-replay")
    await start_client(consumer, cfg)
    try:
        await start_client(producer, cfg)
        tps = [
            TopicPartition(cfg.dlq_topic, p)
            for p in sorted(await partitions_of(consumer, cfg.dlq_topic))
        ]
        if not tps:
            raise UserError(f"the DLQ topic {cfg.dlq_topic!r} does not exist")
        consumer.assign(tps)
        starts: dict[TopicPartition, int] = {}
        for tp in tps:  # from where this selection got to (the start, the first time)
            committed = await consumer.committed(tp)
            starts[tp] = committed if committed is not None else 0
            consumer.seek(tp, starts[tp])
        # A letter's marker is after it in its partition: reading to the end finds the marker
        # of every letter from this selection's position on, whichever replay wrote it.
        replayed_before: set[tuple[int, int]] = set()
        async for batch in until_end(consumer, tps):
            replayed_before.update(m for m in map(_marked, batch) if m is not None)
        for tp, at in starts.items():
            consumer.seek(tp, at)
        replayed = 0
        try:
            async with producer.transaction():
                positions: dict[TopicPartition, int] = {}
                async for batch in until_end(consumer, tps):
                    for record in batch:
                        tp = TopicPartition(record.topic, record.partition)
                        positions[tp] = record.offset + 1
                        if _selected(record, stages, key, replayed_before):
                            await producer.send(
                                cfg.traces_topic, value=record.value, key=record.key
                            )
                            marker = _marker(record, cfg.traces_topic)
                            await producer.send(
                                cfg.dlq_topic,
                                value=marker.value,
                                key=marker.key,
                                headers=marker.headers(),
                                partition=record.partition,
                            )
                            replayed += 1
                if positions:
                    await producer.send_offsets_to_transaction(positions, group)
        except ProducerFenced:
            raise UserError(
                "another `dlq replay` started meanwhile and fenced this one (nothing of this run "
                "was sent): run it again once that one is done"
            ) from None
        log.info(
            "dead letters replayed",
            replayed=replayed,
            selection=selection,
            replayed_before=len(replayed_before),
        )
        return replayed
    finally:
        await stop_quietly(producer)
        await stop_quietly(consumer)


def _selected(
    record: Any, stages: Collection[str], key: str | None, replayed: set[tuple[int, int]]
) -> bool:
    headers = {k: v.decode(errors="replace") for k, v in record.headers}
    record_key = record.key.decode(errors="replace") if record.key else None
    return (
        headers.get(H_STAGE) in stages
        and key in (None, record_key)
        and (record.partition, record.offset) not in replayed
    )


def _marker(letter: Any, traces_topic: str) -> DeadLetter:
    """The DLQ record saying that ``letter`` was re-sent (stage ``replayed``; its source is the
    letter itself)."""
    return DeadLetter(
        reason=f"replayed: dead letter {letter.partition}:{letter.offset} re-sent to "
        f"{traces_topic}",
        stage=REPLAYED,
        topic=letter.topic,
        partition=letter.partition,
        offset=letter.offset,
        key=letter.key,
        value=None,
    )


def _marked(record: Any) -> tuple[int, int] | None:
    """The (partition, offset) of the letter a replay marker names; None for any other record."""
    headers = dict(record.headers)
    if headers.get(H_STAGE) != REPLAYED.encode():
        return None
    try:
        return int(headers[H_PARTITION]), int(headers[H_OFFSET])
    except (KeyError, ValueError):
        return None
