"""Sending traces (for agents) and prompt versions (for operators and the engine)."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaProducer

from combee_stream.config import KafkaConfig
from combee_stream.kafka.client import make_producer, start_client
from combee_stream.kafka.history import history_records
from combee_stream.schemas import DedupHorizon, FeedbackRecord, PromptUpdate, Trace, encode


class TraceProducer:
    """Send traces to the traces topic, keyed by prompt key.

    ``async with TraceProducer(config.kafka) as producer: await producer.send(trace)``
    """

    def __init__(self, cfg: KafkaConfig, env: Mapping[str, str] | None = None) -> None:
        self._cfg = cfg
        self._producer = make_producer(cfg, env, linger_ms=5)

    async def __aenter__(self) -> Self:
        await start_client(self._producer, self._cfg)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._producer.stop()

    async def send(self, trace: Trace) -> tuple[int, int]:
        """Send one validated trace; returns (partition, offset) once the broker has it."""
        return await self.send_raw(trace.key, encode(trace))

    async def send_raw(self, key: str | None, value: bytes) -> tuple[int, int]:
        """Send bytes without validation (for testing how the engine handles bad input)."""
        meta = await self._producer.send_and_wait(
            self._cfg.traces_topic, value=value, key=key.encode() if key is not None else None
        )
        return meta.partition, meta.offset

    async def send_feedback(self, record: FeedbackRecord) -> tuple[int, int]:
        """Send how a run went, after the fact, keyed by its trace id (the ingest stage joins
        it to the trace it assembles from the run's spans). The key is hashed with murmur2
        (aiokafka's default): with several ingest instances the Collector's exporter must hash
        its trace-id keys so too (``record_partitioner.sticky_key.hasher: murmur2``)."""
        meta = await self._producer.send_and_wait(
            self._cfg.feedback_topic, value=encode(record), key=record.trace_id.encode()
        )
        return meta.partition, meta.offset

    async def flush(self) -> None:
        await self._producer.flush()


async def send_update(
    producer: AIOKafkaProducer, cfg: KafkaConfig, update: PromptUpdate, partition: int | None = None
) -> Any:
    """Send one prompt version: its prompts-topic record, keyed by its prompt key, and its
    history records in the same partition (``partition``, or the one the partitioner chose).
    Returns the prompts record's metadata once the broker has every record. In a transaction
    the records are atomic: waiting for each inside it means a refused one (too large for its
    topic) aborts the transaction instead of committing the others."""
    sent = await producer.send(
        cfg.prompts_topic, value=encode(update), key=update.key.encode(), partition=partition
    )
    if partition is None:
        partition = (await sent).partition
    history = [
        await producer.send(cfg.history_topic, value=value, key=record_key, partition=partition)
        for record_key, value in history_records(update, cfg.history_versions)
    ]
    for future in history:
        await future
    return await sent


async def send_horizon(
    producer: AIOKafkaProducer, cfg: KafkaConfig, horizon: DedupHorizon, partition: int
) -> Any:
    """Send a key's dedup record (in the transaction of the version it was written with);
    returns its metadata once the broker has it."""
    sent = await producer.send(
        cfg.dedup_topic_name, value=encode(horizon), key=horizon.key.encode(), partition=partition
    )
    return await sent


async def publish_update(
    producer: AIOKafkaProducer, cfg: KafkaConfig, update: PromptUpdate
) -> tuple[int, int]:
    """Publish one prompt version (:func:`send_update`) and wait until the broker has it all."""
    meta = await send_update(producer, cfg, update)
    return meta.partition, meta.offset


__all__ = ["TraceProducer", "make_producer", "publish_update", "send_horizon", "send_update"]
