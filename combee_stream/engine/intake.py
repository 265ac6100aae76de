"""Intake: the poll loop, routing to the key pipelines, and backpressure.

The poll loop is the only reader of the engine's consumer. It decodes each record through the
configured trace format, parks a bad one in the DLQ, skips a trace at or below its key's
restored watermark (learned before a crash or a rebalance) and hands the rest to the key's
pipeline, started on the key's first trace with its chain restored. It never calls an LLM.
When a partition has ``engine.queue_size`` traces buffered (read, not yet done) it pauses that
partition, not the others, instead of blocking (the consumer keeps its group membership), and
resumes it below half of that: a key whose windows are stuck (a slow endpoint, a huge trace)
holds back the keys of its own partition only, never the other partitions' keys. While the LLM
endpoint is down (its circuit breaker is open, see ``llm.breaker``) every partition is paused
and ``/readyz`` says not ready: the traces wait in Kafka, not in memory and not in the DLQ.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from combee_stream.config import Config
from combee_stream.core.controller import batch_policy
from combee_stream.core.learner import Learner
from combee_stream.core.pipeline import KeyPipeline, Pending, PipelineSettings
from combee_stream.core.versions import KeyChain, Restored
from combee_stream.engine.metrics import EngineMetrics
from combee_stream.engine.partition import KeyIndex, Partitions, PartitionState
from combee_stream.engine.publisher import Publisher
from combee_stream.formats import trace_format
from combee_stream.kafka.dlq import DeadLetter
from combee_stream.kafka.ingest import classify
from combee_stream.logs import get_logger
from combee_stream.schemas import Trace

log = get_logger(__name__)

MAX_POLL_RECORDS = 500  # one poll can land this many past the backpressure threshold


class KeyEntry:
    """A key this instance learns: its chain, its pipeline and the inbox feeding it."""

    def __init__(
        self,
        chain: KeyChain,
        pipeline: KeyPipeline,
        inbox: MemoryObjectSendStream[Pending],
        indexed: KeyIndex | None,
    ) -> None:
        self.chain = chain
        self.pipeline = pipeline
        self.inbox = inbox
        self._indexed = indexed

    @property
    def watermark(self) -> int:
        """What the key has learned in its partition (known before its version is read)."""
        indexed = self._indexed.watermark if self._indexed is not None else -1
        return max(indexed, self.chain.watermark)


def pipeline_settings(config: Config) -> PipelineSettings:
    engine = config.engine
    return PipelineSettings(
        pipelined=engine.pipelined,
        max_windows_in_flight=engine.max_windows_in_flight,
        max_wait_s=engine.max_wait_s,
        attempts=config.learning.max_attempts,
        grow_with_backlog=True,
    )


class Intake:
    def __init__(
        self,
        config: Config,
        consumer: AIOKafkaConsumer,
        partitions: Partitions,
        learner: Learner,
        publisher: Publisher,
        metrics: EngineMetrics,
        outage: Callable[[], bool] = lambda: False,
        fetch: Callable[[int, KeyIndex, str], Awaitable[Restored | None]] | None = None,
        observe: Callable[[Trace], None] | None = None,
        evicted: Callable[[str], None] = lambda key: None,
    ) -> None:
        self._evicted = evicted  # told of each idle key evicted (the releaser forgets it)
        self._fetch = fetch
        self._observe = observe  # every new trace of a key, before it is learned (live scores)
        self._swept_at = 0.0
        self._config = config
        self._outage = outage
        self._paused_for_outage = False
        self._consumer = consumer
        self._partitions = partitions
        self._learner = learner
        self._publisher = publisher
        self._metrics = metrics
        self._format = trace_format(config)
        self._settings = pipeline_settings(config)
        self.keys: dict[str, KeyEntry] = {}
        self._tg: TaskGroup | None = None

    async def run(self, tg: TaskGroup, stopping: anyio.Event) -> None:
        """Poll until ``stopping``; key pipelines are started in ``tg``."""
        self._tg = tg
        queue_size = self._config.engine.queue_size
        while not stopping.is_set():
            try:
                batches = await self._consumer.getmany(timeout_ms=200)
            except KafkaError as exc:
                log.warning("poll failed, retrying", error=str(exc))
                await anyio.sleep(0.5)
                continue
            for tp, records in batches.items():
                state = self._partitions.get(tp.partition)
                if state is None or not state.owned:
                    continue
                for record in records:
                    await self._route(state, record)
            self._backpressure(queue_size)
            self._evict_idle()

    def close_inboxes(self) -> None:
        """The flush: each pipeline drains what is buffered, closes its open window at once and
        finishes when its in-flight windows are published."""
        for entry in self.keys.values():
            entry.inbox.close()

    def drop_partitions(self, partitions: Sequence[int]) -> None:
        """Forget the keys of revoked partitions (their pipelines are already cancelled)."""
        for key in [k for k, e in self.keys.items() if e.chain.partition in partitions]:
            self.keys.pop(key).inbox.close()
            self._metrics.keys.release(key)

    def _evict_idle(self) -> None:
        """Stop the pipelines of keys idle for ``engine.key_idle_s``: what a key costs then is
        its index entry (where its newest version is), not its playbook, its pipeline and its
        metric series. Its next trace starts it again, from the version on the topic."""
        now = anyio.current_time()
        idle_s = self._config.engine.key_idle_s
        if now - self._swept_at < min(5.0, idle_s / 2):
            return
        self._swept_at = now
        for key, entry in list(self.keys.items()):
            if entry.pipeline.idle_for() >= idle_s:
                entry.inbox.close()  # the pipeline finishes: nothing is open or in flight
                del self.keys[key]
                self._metrics.keys.release(key)
                self._evicted(key)
                log.info("idle key evicted", key=key, version=entry.chain.version)

    def resume(self, partition: int) -> None:
        """A restored partition starts reading, unless backpressure holds it (then later)."""
        part = self._partitions.get(partition)
        if part is not None and not part.backpressured and not self._paused_for_outage:
            self._consumer.resume(TopicPartition(self._config.kafka.traces_topic, partition))

    @property
    def buffered(self) -> int:
        """Traces read and not yet done (learned and published, parked or skipped) in the
        partitions this instance owns: what intake must bound."""
        return sum(part.offsets.pending for part in self._partitions.values())

    def _backpressure(self, queue_size: int) -> None:
        topic = self._config.kafka.traces_topic
        outage = self._outage()
        back = self._paused_for_outage and not outage
        if outage != self._paused_for_outage:
            self._paused_for_outage = outage
            self._metrics.health.failing["llm"] = int(outage)
            log.warning("llm outage: intake paused" if outage else "llm back: intake resumed")
        for p, part in self._partitions.items():
            if not part.owned:
                continue
            tp, pending = TopicPartition(topic, p), part.offsets.pending
            if outage:
                self._consumer.pause(tp)
                continue
            if part.backpressured:
                self._consumer.pause(tp)  # idempotent; a rebalance may have resumed it
                if pending < queue_size // 2:
                    part.backpressured = False
                    if part.restored.is_set():
                        self._consumer.resume(tp)
                    log.info("backpressure: partition resumed", partition=p, buffered=pending)
            elif pending >= queue_size:
                self._consumer.pause(tp)
                part.backpressured = True
                self._metrics.backpressure_pauses.inc()
                log.info("backpressure: partition paused", partition=p, buffered=pending)
            elif back and part.restored.is_set():
                self._consumer.resume(tp)
        self._metrics.buffered.set(self.buffered)

    async def _route(self, part: PartitionState, record: Any) -> None:
        part.offsets.read(record.offset)
        self._metrics.traces_in.labels(str(record.partition)).inc()
        item = classify(record, self._format)
        if isinstance(item, DeadLetter):
            await self._publisher.dead_letter(part, item)
            return
        key = item.trace.key
        entry = self.keys.get(key)
        if entry is None:
            entry = self._start_key(key, part)
        if record.offset <= entry.watermark:
            # Learned before a crash or a rebalance: its version is already published.
            self._metrics.traces_skipped.inc()
            part.offsets.done(record.offset)
            return
        if entry.chain.seen(item.trace.trace_id):
            # The same trace sent again (a producer's retry, an agent's re-send): learning it
            # twice would count its lesson twice.
            self._skip_duplicate(part, key, item.trace.trace_id, record.offset)
            return
        if self._observe is not None:
            self._observe(item.trace)
        entry.inbox.send_nowait(Pending(item.trace, item.source, anyio.current_time()))

    def _skip_duplicate(self, part: PartitionState, key: str, trace_id: str, offset: int) -> None:
        self._metrics.traces_duplicate.inc()
        log.info("duplicate trace skipped", key=key, trace_id=trace_id)
        part.offsets.done(offset)

    def _start_key(self, key: str, part: PartitionState) -> KeyEntry:
        chain = KeyChain(key, partition=part.partition, horizon=self._config.engine.dedup_horizon)
        indexed = part.index.get(key)
        loader = None
        if indexed is not None and self._fetch is not None:
            fetch, partition = self._fetch, part.partition

            async def loader() -> Restored | None:
                return await fetch(partition, indexed, key)

        # Room for everything buffered engine-wide: pausing bounds the total, not one key.
        send, recv = anyio.create_memory_object_stream[Pending](
            self._config.engine.queue_size + MAX_POLL_RECORDS
        )
        policy = batch_policy(self._config.learning, key=key)

        def duplicate(item: Pending) -> None:  # seen in what the loader read
            self._skip_duplicate(part, key, item.trace.trace_id, item.source.offset)

        pipeline = KeyPipeline(
            chain,
            self._learner,
            policy,
            self._publisher,
            recv,
            self._settings,
            loader=loader,
            duplicate=duplicate,
        )
        entry = self.keys[key] = KeyEntry(chain, pipeline, send, indexed)
        assert self._tg is not None
        self._tg.start_soon(self._run_pipeline, pipeline, part)
        return entry

    async def _run_pipeline(self, pipeline: KeyPipeline, part: PartitionState) -> None:
        with anyio.CancelScope() as scope:
            part.workers.append(scope)
            try:
                await pipeline.run()
            finally:
                # Done (evicted, drained or cancelled): a kept scope would pin the finished
                # task, one per key that ever passed through the partition.
                part.workers.remove(scope)


__all__ = ["MAX_POLL_RECORDS", "Intake", "KeyEntry", "pipeline_settings"]
