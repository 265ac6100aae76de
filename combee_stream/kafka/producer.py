"""Sending traces (for agents) and prompt versions (for operators and the engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaProducer

from combee_stream.config import KafkaConfig
from combee_stream.kafka.client import client_kwargs, start_client
from combee_stream.kafka.history import history_records
from combee_stream.schemas import DedupHorizon, FeedbackRecord, PromptUpdate, Trace, encode


def make_producer(
    cfg: KafkaConfig, env: Mapping[str, str] | None = None, **overrides: Any
) -> AIOKafkaProducer:
    """An idempotent producer (acks=all): retries never duplicate or reorder a partition. One
    send fails after ``kafka.request_timeout_ms`` when the broker cannot be reached."""
    kwargs = {
        **client_kwargs(cfg, env),
        "enable_idempotence": True,
        "acks": "all",
        "request_timeout_ms": cfg.request_timeout_ms,
        # A prompt version may be as large as the prompts topic takes (plus batch framing).
        "max_request_size": max(1_048_576, cfg.max_message_bytes + 65_536),
    }
    kwargs.update(overrides)
    return _Producer(**kwargs)


class _Producer(AIOKafkaProducer):  # type: ignore[misc]
    """aiokafka's producer, leaving no future's exception unretrieved when it fails for good.

    Fenced (or failed otherwise for good), aiokafka 0.14 sets the error on futures nobody
    awaits: the delivery future of each record sent and not awaited (a transaction waits for
    its commit, not for each send), the drain waiter of each batch not yet sent, and the
    transaction's waiter, which its context manager skips on a fatal error. asyncio logs each
    one it collects as "Future exception was never retrieved" with a traceback (8 for a fenced
    zombie engine). The delivery futures are retrieved as they complete (awaiting one still
    raises); the rest when the producer stops."""

    async def send(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = await super().send(*args, **kwargs)
        future.add_done_callback(_retrieve)
        return future

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            _retrieve_leftovers(self)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if future.done() and not future.cancelled():
        future.exception()


def _retrieve_leftovers(producer: AIOKafkaProducer) -> None:
    """The futures of a stopped producer that may hold an error nobody will ask for."""
    accumulator = getattr(producer, "_message_accumulator", None)
    batches = [b for queue in getattr(accumulator, "_batches", {}).values() for b in queue]
    for batch in [*batches, *getattr(accumulator, "_pending_batches", ())]:
        _retrieve(batch.future)
        _retrieve(batch._drain_waiter)
        for future, _ in batch._msg_futures:
            _retrieve(future)
    txn = getattr(producer, "_txn_manager", None)
    for name in ("_transaction_waiter", "_pid_waiter"):
        waiter = getattr(txn, name, None)
        if isinstance(waiter, asyncio.Future):
            _retrieve(waiter)


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
