"""Everything the engine writes to Kafka: prompt versions, parked traces, dead letters.

The :class:`Publisher` is the key pipelines' :class:`~combee_stream.core.pipeline.Sink`. It owns
the producers (one idempotent producer for dead letters; one transactional producer per input
partition for prompt versions, in both guarantee modes: its transactional id fences a zombie
owner) and the one retry loop, :meth:`Publisher.persist`, that every
write (and the restorer's read) goes through:

- it retries with capped backoff for as long as the engine owns the partition; a revoked
  partition ends it with ``False`` and nothing is marked done;
- while it fails, ``/readyz`` says not ready and ``combee_broker_failures_total{op}`` counts;
- after ``engine.broker_deadline_s`` of continuous failure it raises
  :class:`~combee_stream.errors.BrokerUnavailableError`, which stops the engine with a non-zero
  exit. It never ends by acting as if the write had happened: an offset is marked done only
  after its version is published (or its dead letter written).
- a record the broker refuses as too large (its topic's ``max.message.bytes`` is below it: an
  operator lowered it) is not retried, since no retry can succeed: a version raises
  :class:`~combee_stream.core.versions.UpdateTooLarge` (the key pipeline publishes the window
  rejected for size instead), a dead letter is written without its value.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import msgspec
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    MessageSizeTooLargeError,
    ProducerFenced,
    RecordListTooLargeError,
    RecordTooLargeError,
)

from combee_stream.config import Config
from combee_stream.core.pipeline import Window
from combee_stream.core.playbook import playbook_tokens
from combee_stream.core.results import FailedTrace
from combee_stream.core.versions import KeyChain, UpdateTooLarge
from combee_stream.engine.metrics import EngineMetrics
from combee_stream.engine.partition import KeyIndex, Partitions, PartitionState
from combee_stream.errors import BrokerUnavailableError
from combee_stream.kafka.client import make_producer, start_client, stop_quietly
from combee_stream.kafka.dlq import DeadLetter, send_dead_letter
from combee_stream.kafka.producer import send_horizon, send_update
from combee_stream.kafka.sizes import update_bytes
from combee_stream.llm import LLMClient
from combee_stream.logs import get_logger
from combee_stream.retry import RetryPolicy
from combee_stream.schemas import DedupHorizon, PromptUpdate, Trace, encode

log = get_logger(__name__)

# While the broker is unreachable: 0.2 s, 0.4 s, ... capped at 5 s (with full jitter).
BROKER_RETRY = RetryPolicy(base_s=0.2, max_s=5.0)

# The broker (or the client, past max_request_size) refuses the record for its size.
TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)


class _Refused(Exception):
    """persist's attempt failed with a TOO_LARGE error: retrying cannot help."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(str(error))
        self.error = error


class Publisher:
    def __init__(
        self,
        config: Config,
        partitions: Partitions,
        metrics: EngineMetrics,
        llm: LLMClient,
        env: Mapping[str, str] | None = None,
        *,
        on_published: Callable[[PromptUpdate], None] | None = None,
    ) -> None:
        self._config = config
        self._on_published = on_published  # told of each version once it is durable
        self._partitions = partitions
        self._metrics = metrics
        self._llm = llm
        self._env = env
        self._eos = config.engine.processing_guarantee == "exactly_once"
        self._producer = make_producer(config.kafka, env)
        # Each for the assignment (PartitionState) it was made for: see txn_producer.
        self._txn_producers: dict[int, tuple[PartitionState, AIOKafkaProducer]] = {}
        self._rng = random.Random()

    async def start(self) -> None:
        await start_client(self._producer, self._config.kafka)

    async def close(self) -> None:
        """Stop every producer at once: one that cannot flush (its topic is gone, the broker
        too) holds back none of the others; the caller bounds the whole."""
        producers = [*(p for _, p in self._txn_producers.values()), self._producer]
        self._txn_producers.clear()
        async with anyio.create_task_group() as tg:
            for producer in producers:
                tg.start_soon(stop_quietly, producer)

    # ------------------------------------------------------------------ the retry loop

    async def persist(
        self,
        op: str,
        part: PartitionState,
        attempt_once: Callable[[], Awaitable[None]],
        *,
        locked: bool = False,
    ) -> bool:
        """Run ``attempt_once`` until it succeeds (True) or ``part`` is revoked (False);
        past the broker deadline raise BrokerUnavailableError. ``locked``: hold the partition's
        publish lock for each attempt, so revocation waits for it and then stops the loop.

        An attempt is never cancelled to be retried: the idempotent producer retries a record
        it has accepted until the broker has it, so a second send could duplicate it. A stalled
        attempt is instead watched (one failure per ``kafka.request_timeout_ms`` without an
        answer) and only the deadline ends it, by stopping the engine."""
        outage = _Outage(op, part, self._config, self._metrics)
        attempt = 0
        try:
            while True:
                async with part.lock if locked else contextlib.nullcontext():
                    if not part.owned:
                        return False
                    try:
                        error = await self._watched(attempt_once, outage)
                    except ProducerFenced:
                        # A newer owner initialised this partition's transactional id: this
                        # instance is a zombie for it. Publish nothing more; the rebalance
                        # that follows revokes the partition. One line per fencing: the other
                        # operations in flight on the partition learn it here too.
                        if part.owned:
                            log.warning(
                                "producer fenced: partition lost", op=op, partition=part.partition
                            )
                        part.owned = False
                        return False
                    if error is None:
                        if outage.since is not None:
                            log.info("kafka reachable again", op=op, partition=part.partition)
                        return True
                    if isinstance(error, TOO_LARGE):
                        raise _Refused(error)
                attempt += 1
                outage.failed(str(error))
                delay = BROKER_RETRY.delay(attempt, self._rng)
                log.warning(
                    f"{op} failed, retrying",
                    partition=part.partition,
                    attempt=attempt,
                    error=str(error),
                    backoff_s=round(delay, 2),
                )
                await anyio.sleep(delay)
        finally:
            outage.close()

    async def _watched(
        self, attempt_once: Callable[[], Awaitable[None]], outage: _Outage
    ) -> KafkaError | None:
        """The attempt's KafkaError (None on success), with a watchdog on a stalled one."""
        outcome: list[KafkaError | None] = []
        finished = anyio.Event()

        async def attempt() -> None:
            try:
                await attempt_once()
                outcome.append(None)
            except ProducerFenced:
                raise
            except KafkaError as exc:
                outcome.append(exc)
            finally:
                finished.set()

        patience = self._config.kafka.request_timeout_ms / 1000
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt)
                while not finished.is_set():
                    with anyio.move_on_after(patience):
                        await finished.wait()
                    if not finished.is_set():
                        outage.failed(f"no answer from Kafka for {patience:g} s")
        except BaseExceptionGroup as group:
            fenced = group.subgroup(ProducerFenced)
            if fenced is not None and group.subgroup(BrokerUnavailableError) is None:
                raise ProducerFenced() from group
            raise
        if not outcome:
            # aiokafka cancelled its own future under the attempt (a connection closed by a
            # broker restart): a CancelledError the task group takes for a cancelled child,
            # so the attempt ended without an outcome. A failed attempt, retried like one.
            return KafkaConnectionError("the Kafka client cancelled the request")
        return outcome[0]

    # ------------------------------------------------------------------ Sink

    async def publish(self, chain: KeyChain, update: PromptUpdate, window: Window) -> bool:
        part = self._partitions.get(chain.partition)
        if part is None:
            # Revoked before the window was ready (a thawed zombie hears of the rebalance
            # first): the same abandonment as one revoked while its version is persisted.
            log.info("partition revoked: window abandoned", key=chain.key, window=window.number)
            return False
        learned = window.result.consumed if window.result is not None else []

        # The key's last dedup_horizon ids once this version is out: kept with it.
        horizon = DedupHorizon(
            key=chain.key, version=update.version, ids=chain.horizon_after(update)
        )

        async def send() -> None:
            await self._send_update(part, update, learned, horizon)

        try:
            persisted = await self.persist("publish", part, send, locked=True)
        except _Refused as refused:
            # The failed batch used up a sequence number: the producer's next send would be
            # out of order for good. A new one (a new epoch of the same id) starts clean.
            made = self._txn_producers.pop(part.partition, None)
            if made is not None:
                await stop_quietly(made[1])
            size = update_bytes(update)
            log.error(
                "version refused by the broker as too large: the window is rejected for size "
                "(raise max.message.bytes of the prompts and history topics to "
                "kafka.max_message_bytes: `combee-stream topics create` checks them)",
                key=chain.key,
                version=update.version,
                bytes=size,
                error=str(refused),
            )
            raise UpdateTooLarge(chain.key, update.version, size, str(refused)) from refused
        if not persisted:
            log.info("partition revoked: window abandoned", key=chain.key, window=window.number)
            return False
        self._observe(update, window)
        if self._on_published is not None:
            self._on_published(update)
        return True

    async def park(
        self, chain: KeyChain, failed: Sequence[tuple[FailedTrace, Trace]], stage: str
    ) -> None:
        part = self._partitions.get(chain.partition)
        if part is None or not part.owned:
            return  # revoked: the partition's next owner reads these traces again
        for failure, trace in failed:
            # The original trace, byte for byte as the engine reads it, so it can be replayed.
            letter = DeadLetter(
                reason=failure.reason,
                stage=stage,
                topic=self._config.kafka.traces_topic,
                partition=failure.source.partition,
                offset=failure.source.offset,
                key=chain.key.encode(),
                value=encode(trace),
            )
            if not await self.dead_letter(part, letter.bounded(self._config.kafka)):
                return
            chain.forget(trace.trace_id)  # parked, not learned: `dlq replay` re-sends it

    async def dead_letter(self, part: PartitionState, letter: DeadLetter) -> bool:
        """Write ``letter`` and mark its offset done; False (nothing marked) when revoked."""

        async def send() -> None:
            await send_dead_letter(self._producer, self._config.kafka.dlq_topic, letter)

        try:
            written = await self.persist("dlq", part, send)
        except _Refused as refused:
            # The DLQ topic takes less than kafka.max_message_bytes: the letter without its
            # value (the headers still say where the original record is).
            letter = msgspec.structs.replace(
                letter, value=None, reason=f"{letter.reason} (value refused: {refused})"
            )
            await stop_quietly(self._producer)  # its sequence is broken (as in publish)
            self._producer = make_producer(self._config.kafka, self._env)
            await self.start()
            written = await self.persist("dlq", part, send)
        if not written:
            return False
        self._metrics.dlq.labels(letter.stage).inc()
        part.offsets.done(letter.offset)
        return True

    # ------------------------------------------------------------------ producers

    async def txn_producer(self, part: PartitionState) -> AIOKafkaProducer:
        """The transactional producer of ``part``'s assignment. A producer made for an earlier
        assignment of the same partition is never reused: if the partition was revoked while it
        started, another owner may have fenced it since, and a restore that took it for ours
        would not fence that owner, and every publish after would fail as fenced."""
        if self._partitions.get(part.partition) is not part:
            raise ProducerFenced()  # an earlier assignment's work: the partition is not its own
        made = self._txn_producers.get(part.partition)
        if made is not None and made[0] is part:
            return made[1]
        if made is not None:
            del self._txn_producers[part.partition]
            await stop_quietly(made[1])
        kafka = self._config.kafka
        # One transactional id per input partition: a zombie owner of the same partition
        # is fenced when the new owner initialises its producer.
        producer = make_producer(
            kafka,
            self._env,
            transactional_id=f"{kafka.group_id}.{kafka.traces_topic}.{part.partition}",
        )
        try:
            await producer.start()
        except BaseException:
            await stop_quietly(producer)
            raise
        if self._partitions.get(part.partition) is not part:
            # Revoked while it started: it is no one's (and drop_partition has come and gone).
            await stop_quietly(producer)
            raise ProducerFenced()
        self._txn_producers[part.partition] = (part, producer)
        return producer

    def drop_partition(self, partition: int, tg: Any) -> None:
        """Forget a revoked partition's transactional producer (closed in the background)."""
        made = self._txn_producers.pop(partition, None)
        if made is not None:
            tg.start_soon(stop_quietly, made[1])

    async def _send_update(
        self,
        part: PartitionState,
        update: PromptUpdate,
        learned: Sequence[Any],
        horizon: DedupHorizon,
    ) -> None:
        kafka = self._config.kafka
        producer = await self.txn_producer(part)
        # The version, its history records (and the expiry of the one history_versions
        # older) and the key's dedup record go in one transaction: the history never misses
        # or invents a version, and the horizon read back always matches a version.
        if not self._eos:
            # A transaction of its own, for the fencing: a zombie owner of this partition (a
            # process paused past its session timeout) fails here once the new owner has
            # initialised the partition's transactional id, instead of forking the chain.
            async with producer.transaction():
                sent = await send_update(producer, kafka, update, part.partition)
                mark = await send_horizon(producer, kafka, horizon, part.partition)
            for source in learned:
                part.offsets.done(source.offset)
            self._index(part, update, sent.offset, mark.offset)
            return
        for source in learned:
            part.offsets.done(source.offset)
        commit_at = part.offsets.committable()
        assert commit_at is not None  # the learned offsets were read
        try:
            async with producer.transaction():
                sent = await send_update(producer, kafka, update, part.partition)
                mark = await send_horizon(producer, kafka, horizon, part.partition)
                tp = TopicPartition(self._config.kafka.traces_topic, part.partition)
                await producer.send_offsets_to_transaction(
                    {tp: commit_at}, self._config.kafka.group_id
                )
        except BaseException:
            for source in learned:  # not published: still pending
                part.offsets.read(source.offset)
            raise
        part.committed = max(part.committed, commit_at)
        self._index(part, update, sent.offset, mark.offset)

    @staticmethod
    def _index(part: PartitionState, update: PromptUpdate, offset: int, horizon: int) -> None:
        """Where the key's newest version and dedup record now are (read back if the key is
        evicted)."""
        part.index[update.key] = KeyIndex(
            offset=offset,
            version=update.version,
            watermark=update.watermark.get(part.partition, -1),
            horizon_offset=horizon,
            horizon_version=update.version,
        )

    # ------------------------------------------------------------------ metrics

    def _observe(self, update: PromptUpdate, window: Window) -> None:
        m, key, now = self._metrics, update.key, anyio.current_time()
        bullets = sum(len(s.bullets) for s in update.playbook.sections)
        label = m.keys.label(key)
        m.windows.labels(label).inc()
        m.prompt_version.labels(label).set(update.version)
        m.playbook_bullets.labels(label).set(bullets)
        m.playbook_tokens.labels(label).set(playbook_tokens(update.playbook))
        m.batch_size.labels(label).set(update.stats.batch_size)
        m.publish_lag.observe(now - window.closed_at)
        stats = update.stats
        if stats.gate is not None:
            m.gate_reviews.labels(
                stats.gate.gate, "accepted" if stats.gate.accepted else "rejected"
            ).inc()
        elif stats.rejection is not None and stats.rejection.kind == "gate":
            m.gate_reviews.labels(stats.rejection.gate, "rejected").inc()  # type: ignore[union-attr]
        m.held_out.inc(len(stats.held_out))
        learned = set(update.stats.trace_ids)
        for item in window.items:
            if item.source.trace_id in learned:
                m.trace_to_publish.observe(now - item.read_at)
        for role, usage in self._llm.usage().items():
            m.llm_calls.labels(role).set(usage.calls)
            m.llm_tokens.labels(role, "in").set(usage.tokens_in)
            m.llm_tokens.labels(role, "out").set(usage.tokens_out)
            m.llm_tokens.labels(role, "cached").set(usage.tokens_cached)
            m.llm_bad_replies.labels(role, "invalid").set(usage.invalid_replies)
            m.llm_bad_replies.labels(role, "truncated").set(usage.truncated_replies)
            m.llm_cost.labels(role).set(usage.cost_usd)
            m.llm_latency.labels(role).set(usage.latency_s)
        log.info(
            "version published",
            key=key,
            version=update.version,
            window=window.number,
            traces=update.stats.window_traces,
            bullets=bullets,
            batch_size=update.stats.batch_size,
            rejection=update.stats.rejection.kind if update.stats.rejection else None,
            reason=getattr(update.stats.rejection, "reason", None),
            held_out=len(update.stats.held_out) or None,
        )


class _Outage:
    """One operation's run of failures: when it began, the metric, readiness, the deadline."""

    def __init__(self, op: str, part: PartitionState, config: Config, metrics: EngineMetrics):
        self.op = op
        self.part = part
        self.deadline = config.engine.broker_deadline_s
        self.metrics = metrics
        self.since: float | None = None

    def failed(self, error: str) -> None:
        """Count one failure; past the deadline, stop the engine."""
        now = anyio.current_time()
        if self.since is None:
            self.since = now
            self.metrics.health.failing[self.op] += 1
        self.metrics.broker_failures.labels(self.op).inc()
        failed_for = now - self.since
        if self.deadline and failed_for >= self.deadline:
            log.error(
                "engine halted: kafka unavailable past the deadline",
                op=self.op,
                partition=self.part.partition,
                failed_for_s=round(failed_for, 1),
                deadline_s=self.deadline,
                error=error,
            )
            raise BrokerUnavailableError(
                f"could not {self.op} on partition {self.part.partition} for {failed_for:.0f} s "
                f"(engine.broker_deadline_s = {self.deadline:g}): {error}"
            )

    def close(self) -> None:
        if self.since is not None:
            self.metrics.health.failing[self.op] -= 1


__all__ = ["BROKER_RETRY", "Publisher"]
