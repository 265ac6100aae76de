"""Read a topic from the beginning to its current end: for audits, inspection and tests."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from combee_stream.config import KafkaConfig
from combee_stream.errors import UserError
from combee_stream.kafka.client import client_kwargs, partitions_of


async def read_to_end(
    cfg: KafkaConfig,
    topic: str,
    *,
    partitions: Collection[int] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Every record now readable in ``topic`` (committed data only), partition by partition.

    Stops at the end offsets seen on entry, so it terminates while producers keep writing.
    """
    consumer = AIOKafkaConsumer(
        **client_kwargs(cfg, env),
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    records: list[Any] = []
    try:
        available = await partitions_of(consumer, topic)
        if not available:
            raise UserError(f"topic {topic!r} does not exist")
        wanted = sorted(available if partitions is None else set(partitions) & available)
        tps = [TopicPartition(topic, p) for p in wanted]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        for tp in tps:
            while await consumer.position(tp) < end[tp]:
                for batch in (await consumer.getmany(tp, timeout_ms=500)).values():
                    records.extend(batch)
    finally:
        await consumer.stop()
    return records
