"""The ingest stage: agent telemetry in, native traces keyed by prompt key out, exactly once.

It reads the spans topic (and the logs and feedback topics: ``FeedbackRecord``s and Phoenix
annotations, :mod:`combee_stream.formats.phoenix`) as one consumer group, assembles
each trace (:mod:`combee_stream.ingest.assembler`) and writes it to the traces topic keyed by
its prompt key: the repartition step, since spans are keyed by trace id (or not at all) and so
are not co-partitioned with prompt keys. Each flush is one transaction holding the traces
written, their marks on the compacted state topic, the dead letters and the input offsets now
committable; so after a crash (or a broker error, or a rebalance: all three are handled as a
restart from the committed offsets) nothing is lost, and a trace read again is recognised by
its mark and not written twice. Rejections have marks too (with their dead letters), so none
is dead-lettered twice, and late input of a rejected trace is late after a restart as well.

Choices the design leaves open, recorded here:

- One transactional id per instance (``{ingest.group_id}.ingest.{instance}``): a restarted
  instance fences its predecessor and aborts its open transaction. Instances with different
  numbers do not fence each other, so a zombie (paused past its session timeout) could write a
  trace its successor writes too; the engine skips a trace id its key has already seen
  (``engine.dedup_horizon``), so such a trace is still learned once.
- Spans, log records and feedback of one trace must reach one instance: with several
  instances, set ``ingest.spans_keyed`` and run the Collector's Kafka exporter with
  ``partition_traces_by_id`` and ``partition_logs_by_trace_id`` (keyed by the hex trace id) and
  ``record_partitioner: {sticky_key: {hasher: murmur2}}``: its default hasher (``sarama_compat``,
  FNV-1a) puts a key in another partition than ``TraceProducer.send_feedback``, which keys by
  trace id with aiokafka's murmur2; the same partition count on the spans, logs and feedback
  topics. One instance reads them all.
- Past ``ingest.max_open_traces`` (open traces with spans) the stage pauses the spans topic
  until traces complete or time out, so memory stays bounded. Orphans (no ended root yet) are
  shed before that (the assembler's *Bounds*): what holds the pause is traces that complete
  within their gap, or that wait for feedback (``feedback_wait_s``). The logs and feedback
  topics go on: the traces waiting are those that need their feedback, and no trace is
  complete before its feedback wait ends.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from typing import Any, Final, Literal

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from combee_stream.config import Config
from combee_stream.errors import BrokerUnavailableError, DecodeError, EngineHalted
from combee_stream.formats.otlp import decode_telemetry
from combee_stream.formats.phoenix import decode_annotations, is_annotations
from combee_stream.ingest.assembler import Assembler, Rejected, TraceMark, Written
from combee_stream.ingest.metrics import IngestMetrics
from combee_stream.kafka.client import client_kwargs, make_producer, start_client, stop_quietly
from combee_stream.kafka.dlq import DeadLetter
from combee_stream.kafka.reader import read_to_end
from combee_stream.kafka.topics import ensure_ingest_topics
from combee_stream.logs import get_logger
from combee_stream.retry import RetryPolicy
from combee_stream.schemas import FeedbackRecord, decode

log = get_logger(__name__)

STAGE: Final = "ingest"
_FLUSH_S: Final = 0.2  # how often what is due is written (one transaction)
_POLL_MS: Final = 200
_MAX_RECORDS: Final = 500


class IngestStage:
    """``await IngestStage(config).run()`` until ``stop()``; ``started`` is set once reading."""

    def __init__(
        self,
        config: Config,
        *,
        instance: int = 0,
        env: Mapping[str, str] | None = None,
        metrics: IngestMetrics | None = None,
    ) -> None:
        self.config = config
        self.instance = instance
        self.metrics = metrics or IngestMetrics()
        self.started = anyio.Event()
        self._env = env
        self._stop = anyio.Event()
        self._retry = RetryPolicy(base_s=0.5, max_s=10.0)
        self._rng = random.Random()
        self._reading = False  # the current session got as far as reading

    def stop(self) -> None:
        self._stop.set()

    @property
    def _topics(self) -> list[str]:
        s = self.config.ingest
        return [s.spans_topic, s.logs_topic, self.config.kafka.feedback_topic]

    async def run(self) -> None:
        await ensure_ingest_topics(self.config.kafka, self.config.ingest, self._env)
        failed_since: float | None = None
        attempt = 0
        while not self._stop.is_set():
            try:
                await self._session()
                return
            except ProducerFenced:
                raise EngineHalted(
                    f"ingest instance {self.instance} was fenced: another process started with "
                    "the same instance number (each ingest process needs its own --instance)"
                ) from None
            except KafkaError as exc:
                # Everything not committed is read again by the next session: restarting is
                # the recovery, and it may repeat until the broker deadline (counted from the
                # first failure since a session last got going).
                now = time.monotonic()
                self.metrics.health.assigned = False
                if self._reading:
                    self._reading, failed_since, attempt = False, None, 0
                failed_since = failed_since or now
                deadline = self.config.engine.broker_deadline_s
                self.metrics.restarts.inc()
                if deadline and now - failed_since > deadline:
                    raise BrokerUnavailableError(
                        f"ingest: Kafka failed for {now - failed_since:.0f} s "
                        f"(engine.broker_deadline_s = {deadline:g}): {exc}"
                    ) from None
                attempt += 1
                log.warning("ingest restarts from the committed offsets", error=str(exc))
                await anyio.sleep(self._retry.delay(attempt, self._rng))

    # ------------------------------------------------------------------ one session

    async def _session(self) -> None:
        """From the committed offsets and the state topic to ``stop()`` (or a Kafka error)."""
        cfg, kafka = self.config.ingest, self.config.kafka
        producer = make_producer(
            kafka, self._env, transactional_id=f"{cfg.group_id}.ingest.{self.instance}"
        )
        rebalanced = _Rebalanced()
        await start_client(producer, kafka)  # fences an earlier run of this instance
        try:
            # Made only now: a consumer made before a start that fails or is cancelled would be
            # left unclosed (aiokafka's "Unclosed AIOKafkaConsumer" at exit).
            consumer = AIOKafkaConsumer(
                **client_kwargs(kafka, self._env),
                group_id=cfg.group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                isolation_level="read_committed",
                session_timeout_ms=kafka.session_timeout_ms,
                max_partition_fetch_bytes=max(1_048_576, kafka.max_message_bytes),
            )
            await start_client(consumer, kafka)
            try:
                consumer.subscribe(self._topics, listener=rebalanced)
                await self._loop(consumer, producer, rebalanced)
            finally:
                await stop_quietly(consumer)
        finally:
            await stop_quietly(producer)

    async def _assembler(self) -> Assembler:
        """A new assembler that knows every trace decided whose mark is kept."""
        cfg = self.config.ingest
        learning = self.config.learning
        assembler = Assembler(
            cfg,
            max_trace_bytes=self.config.kafka.max_message_bytes,
            max_task_chars=learning.max_task_chars,
            long_task=learning.long_task,
        )
        for record in await read_to_end(self.config.kafka, cfg.state_topic, env=self._env):
            trace_id = record.key.decode()
            if record.value is None:
                assembler.forget(trace_id)
            else:
                assembler.restore(trace_id, msgspec.json.decode(record.value, type=TraceMark))
        return assembler

    async def _loop(
        self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer, rebalanced: _Rebalanced
    ) -> None:
        cfg = self.config.ingest
        assembler = await self._assembler()
        paused = False
        last_flush = anyio.current_time()
        committed: dict[tuple[str, int], int] = {}
        clock = _StreamClock(keyed=cfg.spans_keyed)
        pending: list[Written | Rejected | DeadLetter] = []
        self._reading = True
        self.metrics.health.assigned = True
        self.started.set()
        while not self._stop.is_set():
            batches = await consumer.getmany(timeout_ms=_POLL_MS, max_records=_MAX_RECORDS)
            if rebalanced.moved:
                # Partitions moved (inside getmany; no transaction is open then). What is open
                # may miss spans another instance now reads, so start over from what is
                # committed: a new assembler, every partition back at its committed offset.
                # Nothing is written twice: what was written is in the state topic.
                rebalanced.moved = False
                assembler, committed, pending = await self._assembler(), {}, []
                clock = _StreamClock(keyed=cfg.spans_keyed)
                if consumer.assignment():
                    await consumer.seek_to_committed(*consumer.assignment())
                paused = False
                self.metrics.rebalances.inc()
                continue
            now = anyio.current_time()
            for tp, records in batches.items():
                for record in records:
                    if (tp.topic, tp.partition) not in committed:
                        start = record.offset  # first read of it in this session
                        assembler.start_at(tp.topic, tp.partition, start)
                        committed[(tp.topic, tp.partition)] = start
                    clock.read(tp, record)
                    pending.extend(self._take(assembler, record, now))
            if now - last_flush >= _FLUSH_S or len(pending) >= _MAX_RECORDS:
                # Paused at max_open_traces, the lagging partitions cannot move the watermark
                # on: complete by arrival time alone then, or the stage would wait forever.
                watermark = math.inf if paused else await clock.watermark(consumer)
                pending.extend(assembler.due(now, watermark))
                await self._flush(assembler, producer, pending, committed)
                pending = []
                last_flush = now
            full = assembler.assembling >= cfg.max_open_traces
            if full != paused:
                parts = [tp for tp in consumer.assignment() if tp.topic == cfg.spans_topic]
                (consumer.pause if full else consumer.resume)(*parts)
                paused = full
                if full:
                    self.metrics.pauses.inc()
                    log.warning("ingest paused: too many open traces", open=assembler.open_traces)
            self.metrics.open_traces.set(assembler.open_traces)
            self.metrics.orphan_traces.set(assembler.orphans)
        final = [*pending, *assembler.due(anyio.current_time(), await clock.watermark(consumer))]
        await self._flush(assembler, producer, final, committed)

    def _take(
        self, assembler: Assembler, record: Any, now: float
    ) -> list[Written | Rejected | DeadLetter]:
        """One input record into the assembler; what it rejects at once."""
        s, kafka = self.config.ingest, self.config.kafka
        ref = (record.topic, record.partition, record.offset)
        value: bytes | None = record.value
        self.metrics.records_in.labels(record.topic).inc()
        if value is None:
            assembler.skip(ref)  # done with its dead letter (one transaction)
            return [DeadLetter.of_record(record, "record has no value (tombstone)", STAGE)]
        if len(value) > kafka.max_message_bytes:
            assembler.skip(ref)
            letter = DeadLetter.of_record(
                record,
                f"oversized: {len(value)} bytes > kafka.max_message_bytes = "
                f"{kafka.max_message_bytes} (value cut to its first 64 KiB)",
                STAGE,
            )
            return [msgspec.structs.replace(letter, value=value[:65_536])]
        try:
            if record.topic == kafka.feedback_topic:
                if is_annotations(value):  # a Phoenix annotations body, else a FeedbackRecord
                    annotations = decode_annotations(value, s)
                    return list(assembler.add_annotations(annotations, ref, now))
                feedback = decode(value, FeedbackRecord, unique_keys=True)
                return list(assembler.add_feedback(feedback, ref, now))
            signal: Literal["traces", "logs"] = (
                "traces" if record.topic == s.spans_topic else "logs"
            )
            telemetry = decode_telemetry(value, s.encoding, signal)
        except DecodeError as exc:
            assembler.skip(ref)
            return [DeadLetter.of_record(record, exc.reason, STAGE)]
        self.metrics.spans_in.inc(len(telemetry.spans))
        return list(assembler.add_telemetry(telemetry, ref, now, record.timestamp / 1000))

    async def _flush(
        self,
        assembler: Assembler,
        producer: AIOKafkaProducer,
        items: list[Written | Rejected | DeadLetter],
        committed: dict[tuple[str, int], int],
    ) -> None:
        """One transaction: traces, marks, dead letters, tombstones and the offsets now done."""
        kafka, cfg = self.config.kafka, self.config.ingest
        offsets = {tp: at for tp, at in assembler.committable().items() if at > committed[tp]}
        if not items and not offsets:
            return
        settled = assembler.settled({**committed, **offsets})
        async with producer.transaction():
            for item in items:
                if isinstance(item, Written):
                    trace = item.trace
                    await producer.send(
                        kafka.traces_topic, value=item.value, key=trace.key.encode()
                    )
                    await producer.send(
                        cfg.state_topic,
                        value=msgspec.json.encode(item.mark),
                        key=trace.trace_id.encode(),
                    )
                    continue
                if isinstance(item, Rejected) and item.mark is not None:
                    await producer.send(
                        cfg.state_topic,
                        value=msgspec.json.encode(item.mark),
                        key=item.trace_id.encode(),
                    )
                letter = (item if isinstance(item, DeadLetter) else _letter(item)).bounded(kafka)
                await producer.send(
                    kafka.dlq_topic, value=letter.value, key=letter.key, headers=letter.headers()
                )
            for trace_id in settled:
                await producer.send(cfg.state_topic, value=None, key=trace_id.encode())
            if offsets:
                await producer.send_offsets_to_transaction(
                    {TopicPartition(t, p): at for (t, p), at in offsets.items()}, cfg.group_id
                )
        committed.update(offsets)
        for item in items:
            self.metrics.observe(item)
            if isinstance(item, Written) and item.evaluation_errors:
                # Not an outcome (the run is learned without them), yet worth knowing once.
                log.warning(
                    "evaluations gave no result",
                    trace_id=item.trace.trace_id,
                    errors=item.evaluation_errors,
                )


def _letter(item: Rejected) -> DeadLetter:
    """A rejection as a dead letter: what was held (spans, events, feedback) as JSON, keyed by
    its prompt key when known (else its trace id), with the rejection kind in the reason."""
    topic, partition, offset = item.source or ("", -1, -1)
    key = item.key or item.trace_id
    return DeadLetter(
        reason=f"{item.kind}: {item.reason}",
        stage=STAGE,
        topic=topic,
        partition=partition,
        offset=offset,
        key=key.encode() if key else None,
        value=item.payload,
    )


class _StreamClock:
    """Record time per partition: the timestamp of the newest record read. A partition read to
    its end holds nothing back; one that lags holds the watermark at its newest record's time
    (its next records may be spans of traces open now). Unless a trace's input is keyed to one
    partition number (``ingest.spans_keyed``), a partition of the topics read that this member
    does not hold holds the watermark back entirely: while a dead member's session has not
    timed out, it still holds partitions that carry spans of the traces open here, and a trace
    written before they are read would be written without them (its spans then ``late_span``).
    """

    def __init__(self, *, keyed: bool) -> None:
        self._time: dict[TopicPartition, float] = {}
        self._keyed = keyed

    def read(self, tp: TopicPartition, record: Any) -> None:
        self._time[tp] = max(self._time.get(tp, -math.inf), record.timestamp / 1000)

    async def watermark(self, consumer: AIOKafkaConsumer) -> float:
        mark = math.inf
        held = consumer.assignment()
        if not self._keyed:
            for topic in consumer.subscription():
                partitions = consumer.partitions_for_topic(topic) or set()
                if any(TopicPartition(topic, p) not in held for p in partitions):
                    return -math.inf
        for tp in held:
            # read_committed reads up to the last stable offset (not past open transactions)
            end = consumer.last_stable_offset(tp)
            end = consumer.highwater(tp) if end is None else end
            if end is None or await consumer.position(tp) < end:
                mark = min(mark, self._time.get(tp, -math.inf))
        return mark


class _Rebalanced(ConsumerRebalanceListener):  # type: ignore[misc]
    """Notes that the assignment changed after the first one."""

    def __init__(self) -> None:
        self.moved = False
        self._assigned_once = False

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked and self._assigned_once:
            self.moved = True

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if self._assigned_once:
            self.moved = True
        self._assigned_once = True


__all__ = ["IngestStage"]
