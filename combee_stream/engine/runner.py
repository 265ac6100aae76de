"""The streaming engine: traces topic in, prompt versions out, offsets committed behind them.

Structure (one anyio task group, nothing outside it):

- **poll loop** — the only reader of the consumer: decodes records, parks bad ones in the DLQ,
  skips traces at or below their key's restored watermark and hands the rest to the key's
  worker. It never calls an LLM. When too many traces are buffered it pauses the partitions
  instead of blocking (the consumer keeps its group membership).
- **restorer** — partitions arrive paused from the rebalance callback (which does no slow work);
  the restorer reads the same partition of the compacted prompts topic, restores every key's
  playbook and watermark, then resumes the partition.
- **key workers** — one per key (see :mod:`combee_stream.engine.keyworker`), cancelled when their
  partition is revoked.
- **committer** — commits, per owned partition, the low watermark of unfinished offsets.

Guarantees (see the README's "Guarantees" section): every trace is learned exactly once across
crashes, restarts and rebalances, because (1) offsets are committed only below work whose
PromptUpdate is published, (2) each PromptUpdate carries the highest learned offset of its key,
and (3) a restarted or new owner restores that watermark before reading and skips what is below
it. In ``exactly_once`` mode the publish and the offset commit are one Kafka transaction
(one transactional id per input partition) and subscribers read committed data only.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from combee_stream.config import Config
from combee_stream.core.controller import ControllerSettings, OnlineController
from combee_stream.core.learner import FailedTrace, Learner, WindowResult
from combee_stream.core.llm import LLMClient
from combee_stream.core.playbook import playbook_tokens, render
from combee_stream.engine.keyworker import KeyWorker, Pending, Window
from combee_stream.engine.metrics import EngineMetrics
from combee_stream.engine.partition import KeyState, PartitionState
from combee_stream.kafka.client import client_kwargs
from combee_stream.kafka.ingest import DeadLetter, classify, send_dead_letter
from combee_stream.kafka.producer import make_producer
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.kafka.topics import ensure_topics
from combee_stream.logs import get_logger
from combee_stream.schemas import PromptUpdate, Trace, UpdateStats, encode, utcnow

log = get_logger(__name__)

_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # backoff while the broker is unreachable
_MAX_POLL_RECORDS = 500  # one poll can land this many past the backpressure threshold


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self._engine._revoke([tp.partition for tp in revoked])

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self._engine._assign([tp.partition for tp in assigned])


class Engine:
    """``async with Engine(config) as engine: await engine.run()`` (or ``engine.stop()``)."""

    def __init__(
        self,
        config: Config,
        *,
        llm: LLMClient | None = None,
        env: Mapping[str, str] | None = None,
        handle_signals: bool = False,
    ) -> None:
        self.config = config
        self._env = env
        self._llm = llm or LLMClient(config.llm, env=env)
        self._owns_llm = llm is None
        self._learner = Learner(self._llm, config.learning)
        self.metrics = EngineMetrics()
        self._handle_signals = handle_signals
        self._eos = config.engine.processing_guarantee == "exactly_once"
        kafka = config.kafka
        self._consumer = AIOKafkaConsumer(
            **client_kwargs(kafka, env),
            group_id=kafka.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_poll_records=_MAX_POLL_RECORDS,
            session_timeout_ms=kafka.session_timeout_ms,
            heartbeat_interval_ms=max(300, kafka.session_timeout_ms // 4),
        )
        self._producer = make_producer(kafka, env)
        self._txn_producers: dict[int, AIOKafkaProducer] = {}
        self._partitions: dict[int, PartitionState] = {}
        self._keys: dict[str, KeyState] = {}
        self._inboxes: dict[str, MemoryObjectSendStream[Pending]] = {}
        self._workers: dict[str, KeyWorker] = {}
        self._generation = 0
        self._paused_for_backpressure = False
        self._restore_send, self._restore_recv = anyio.create_memory_object_stream[int](1000)
        self._tg: TaskGroup | None = None
        self._stopping = anyio.Event()
        self._stopped = anyio.Event()
        self.started = anyio.Event()

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Begin a graceful shutdown: stop intake, finish in-flight windows, commit, close."""
        self._stopping.set()

    async def run(self) -> None:
        cfg = self.config
        await ensure_topics(cfg.kafka, self._env)
        await self._producer.start()
        self._consumer.subscribe([cfg.kafka.traces_topic], listener=_Rebalance(self))
        await self._consumer.start()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self._handle_signals:
                    tg.start_soon(self._watch_signals)
                if cfg.engine.metrics_port:
                    tg.start_soon(self._serve_metrics)
                tg.start_soon(self._restorer)
                tg.start_soon(self._committer)
                self.started.set()
                log.info(
                    "engine started",
                    traces=cfg.kafka.traces_topic,
                    prompts=cfg.kafka.prompts_topic,
                    guarantee=cfg.engine.processing_guarantee,
                    strategy=cfg.learning.strategy,
                )
                await self._poll_loop()
                await self._drain()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()
            self._stopped.set()

    async def _close(self) -> None:
        await self._commit(final=True)
        for producer in self._txn_producers.values():
            await _quietly(producer.stop())
        await _quietly(self._consumer.stop())
        await _quietly(self._producer.stop())
        if self._owns_llm:
            await self._llm.aclose()
        self.metrics.ready = False
        log.info("engine stopped")

    async def _drain(self) -> None:
        """Flush open windows and give in-flight ones ``shutdown_grace_s`` to publish."""
        log.info("draining", keys=len(self._workers))
        # Closing an inbox is the flush: its worker drains what is buffered, closes the open
        # window at once and finishes when its in-flight windows are published.
        for inbox in self._inboxes.values():
            inbox.close()
        with anyio.move_on_after(self.config.engine.shutdown_grace_s) as scope:
            for worker in list(self._workers.values()):
                await worker.finished.wait()
        if scope.cancel_called:
            log.warning("shutdown grace expired: abandoning unpublished windows")

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal received: shutting down", signal=signal.Signals(signum).name)
                self.stop()
                return

    async def _serve_metrics(self) -> None:
        from combee_stream.http import serve_asgi

        cfg = self.config.engine
        async with serve_asgi(self.metrics.asgi_app(), cfg.metrics_host, cfg.metrics_port) as url:
            log.info("metrics endpoint", url=f"{url}/metrics")
            await anyio.sleep_forever()

    # ------------------------------------------------------------------ rebalancing

    async def _assign(self, partitions: Sequence[int]) -> None:
        """Rebalance callback: only bookkeeping. Restoring happens in the restorer task."""
        topic = self.config.kafka.traces_topic
        tps = [TopicPartition(topic, p) for p in partitions]
        self._consumer.pause(*tps)
        for p in partitions:
            self._generation += 1
            self._partitions[p] = PartitionState(p, self._generation)
            self._restore_send.send_nowait(p)
        log.info("partitions assigned", partitions=sorted(partitions))

    async def _revoke(self, partitions: Sequence[int]) -> None:
        """Rebalance callback: stop publishing for these partitions, commit what is done."""
        for p in partitions:
            state = self._partitions.get(p)
            if state is None:
                continue
            async with state.lock:  # waits for at most one publish in progress
                state.owned = False
            for scope in state.workers:
                scope.cancel()
        await self._commit(final=True, only=partitions)
        for p in partitions:
            self._partitions.pop(p, None)
            for key in [k for k, s in self._keys.items() if s.partition == p]:
                self._keys.pop(key)
                self._workers.pop(key, None)
                inbox = self._inboxes.pop(key, None)
                if inbox is not None:
                    inbox.close()
            producer = self._txn_producers.pop(p, None)
            if producer is not None and self._tg is not None:
                self._tg.start_soon(_quietly, producer.stop())
        self.metrics.ready = bool(self._partitions)
        log.info("partitions revoked", partitions=sorted(partitions))

    async def _restorer(self) -> None:
        topic = self.config.kafka.traces_topic
        async for p in self._restore_recv:
            state = self._partitions.get(p)
            if state is None or not state.owned:
                continue
            for delay in (*_RETRY_S, *([5.0] * 1000)):
                try:
                    async with PromptSubscriber(
                        self.config.kafka, partitions={p}, env=self._env
                    ) as prompts:
                        state.restored_updates = prompts.snapshot()
                    if self._eos:
                        await self._txn_producer(p)
                    break
                except KafkaError as exc:
                    log.warning("restore failed, retrying", partition=p, error=str(exc))
                    await anyio.sleep(delay)
            if self._partitions.get(p) is not state:
                continue  # revoked while restoring
            state.restored.set()
            if not self._paused_for_backpressure:  # else _backpressure resumes it later
                self._consumer.resume(TopicPartition(topic, p))
            self.metrics.ready = True
            log.info("partition restored", partition=p, keys=len(state.restored_updates))

    async def _txn_producer(self, partition: int) -> AIOKafkaProducer:
        producer = self._txn_producers.get(partition)
        if producer is None:
            kafka = self.config.kafka
            # One transactional id per input partition: a zombie owner of the same partition
            # is fenced when the new owner initialises its producer.
            producer = make_producer(
                kafka,
                self._env,
                transactional_id=f"{kafka.group_id}.{kafka.traces_topic}.{partition}",
            )
            await producer.start()
            self._txn_producers[partition] = producer
        return producer

    # ------------------------------------------------------------------ intake

    async def _poll_loop(self) -> None:
        queue_size = self.config.engine.queue_size
        while not self._stopping.is_set():
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

    @property
    def _buffered(self) -> int:
        """Traces read and not yet done (learned and published, parked or skipped) in the
        partitions this instance owns: what intake must bound."""
        return sum(part.offsets.pending for part in self._partitions.values())

    def _backpressure(self, queue_size: int) -> None:
        topic = self.config.kafka.traces_topic
        owned = [TopicPartition(topic, p) for p, s in self._partitions.items() if s.owned]
        if self._paused_for_backpressure:
            self._consumer.pause(*owned)  # idempotent; covers partitions assigned meanwhile
        if not self._paused_for_backpressure and self._buffered >= queue_size:
            self._consumer.pause(*owned)
            self._paused_for_backpressure = True
            self.metrics.backpressure_pauses.inc()
            log.info("backpressure: partitions paused", buffered=self._buffered)
        elif self._paused_for_backpressure and self._buffered < queue_size // 2:
            restored = [tp for tp in owned if self._partitions[tp.partition].restored.is_set()]
            self._consumer.resume(*restored)
            self._paused_for_backpressure = False
            log.info("backpressure: partitions resumed", buffered=self._buffered)
        self.metrics.buffered.set(self._buffered)

    async def _route(self, part: PartitionState, record: Any) -> None:
        part.offsets.read(record.offset)
        self.metrics.traces_in.labels(str(record.partition)).inc()
        item = classify(record)
        if isinstance(item, DeadLetter):
            await self._dead_letter(item)
            part.offsets.done(record.offset)
            return
        key = item.trace.key
        state = self._keys.get(key)
        if state is None:
            state = self._new_key(key, part)
        if record.offset <= state.watermark:
            # Learned before a crash or a rebalance: its version is already published.
            self.metrics.traces_skipped.inc()
            part.offsets.done(record.offset)
            return
        self._inboxes[key].send_nowait(Pending(item.trace, item.source, anyio.current_time()))

    def _new_key(self, key: str, part: PartitionState) -> KeyState:
        learning = self.config.learning
        fixed = learning.batch_size if isinstance(learning.batch_size, int) else None
        settings = ControllerSettings(
            min_size=fixed or learning.min_batch_size,
            max_size=fixed or learning.max_batch_size,
        )
        state = KeyState(key, part.partition, OnlineController(settings, key=key))
        restored = part.restored_updates.get(key)
        if restored is not None:
            state.restore(restored)
        self._keys[key] = state
        # Room for everything buffered engine-wide: pausing bounds the total, not one key.
        send, recv = anyio.create_memory_object_stream[Pending](
            self.config.engine.queue_size + _MAX_POLL_RECORDS
        )
        self._inboxes[key] = send
        worker = KeyWorker(state, self._learner, self, recv, self.config.engine)
        self._workers[key] = worker
        assert self._tg is not None
        self._tg.start_soon(self._run_worker, worker, part)
        return state

    async def _run_worker(self, worker: KeyWorker, part: PartitionState) -> None:
        with anyio.CancelScope() as scope:
            part.workers.append(scope)
            await worker.run()

    async def _dead_letter(self, letter: DeadLetter) -> None:
        for delay in (*_RETRY_S, *([5.0] * 1000)):
            try:
                await send_dead_letter(self._producer, self.config.kafka.dlq_topic, letter)
                self.metrics.dlq.labels(letter.stage).inc()
                return
            except KafkaError as exc:
                log.warning("DLQ write failed, retrying", error=str(exc))
                await anyio.sleep(delay)

    # ------------------------------------------------------------------ Sink (key workers)

    async def park(
        self, state: KeyState, failed: Sequence[tuple[FailedTrace, Trace]], stage: str
    ) -> None:
        part = self._partitions.get(state.partition)
        if part is None or not part.owned:
            return  # revoked: the partition's next owner reads these traces again
        for failure, trace in failed:
            # The original trace, byte for byte as the engine reads it, so it can be replayed.
            letter = DeadLetter(
                reason=failure.reason,
                stage=stage,
                topic=self.config.kafka.traces_topic,
                partition=failure.source.partition,
                offset=failure.source.offset,
                key=state.key.encode(),
                value=encode(trace),
            )
            await self._dead_letter(letter)
            part.offsets.done(failure.source.offset)

    async def publish(self, state: KeyState, window: Window, result: WindowResult) -> bool:
        part = self._partitions.get(state.partition)
        learned = sorted(result.learned)
        if part is None or not learned:
            return False
        stats = result.stats
        now = anyio.current_time()
        playbook = result.playbook
        watermark = dict(state.update.watermark) if state.update else {}
        watermark[state.partition] = max(
            watermark.get(state.partition, -1), max(s.offset for s in learned)
        )
        rejected = result.applied.rejected
        update = PromptUpdate(
            key=state.key,
            version=playbook.version,
            parent_version=state.version,
            playbook=playbook,
            prompt=render(playbook),
            stats=UpdateStats(
                traces_learned=state.traces_learned + len(learned),
                window_traces=len(learned),
                trace_ids=[s.trace_id for s in learned],
                strategy=stats.strategy,
                batch_size=len(window.items),
                llm_calls=stats.llm_calls,
                tokens_in=stats.tokens_in,
                tokens_out=stats.tokens_out,
                delay_s=now - window.opened_at,
                rejected=encode(rejected).decode() if rejected else None,
            ),
            watermark=watermark,
            created_at=utcnow(),
        )
        for delay in (*_RETRY_S, *([5.0] * 1000)):
            async with part.lock:
                if not part.owned:
                    log.info("partition revoked: window abandoned", key=state.key)
                    return False
                try:
                    await self._send_update(part, update, learned)
                except KafkaError as exc:
                    log.warning("publish failed, retrying", key=state.key, error=str(exc))
                else:
                    break
            await anyio.sleep(delay)
        state.update = update
        state.playbook = update.playbook
        state.watermark = watermark.get(state.partition, -1)
        state.traces_learned = update.stats.traces_learned
        self._observe(state, window, update, now)
        return True

    async def _send_update(
        self, part: PartitionState, update: PromptUpdate, learned: Sequence[Any]
    ) -> None:
        topic = self.config.kafka.prompts_topic
        value, key = encode(update), update.key.encode()
        if not self._eos:
            await self._producer.send_and_wait(
                topic, value=value, key=key, partition=part.partition
            )
            for source in learned:
                part.offsets.done(source.offset)
            return
        producer = await self._txn_producer(part.partition)
        for source in learned:
            part.offsets.done(source.offset)
        commit_at = part.offsets.committable()
        assert commit_at is not None  # the learned offsets were read
        try:
            async with producer.transaction():
                await producer.send(topic, value=value, key=key, partition=part.partition)
                tp = TopicPartition(self.config.kafka.traces_topic, part.partition)
                await producer.send_offsets_to_transaction(
                    {tp: commit_at}, self.config.kafka.group_id
                )
        except BaseException:
            for source in learned:  # not published: still pending
                part.offsets.read(source.offset)
            raise
        part.committed = max(part.committed, commit_at)

    def _observe(self, state: KeyState, window: Window, update: PromptUpdate, now: float) -> None:
        m, key = self.metrics, state.key
        m.windows.labels(key).inc()
        m.prompt_version.labels(key).set(update.version)
        m.playbook_bullets.labels(key).set(sum(len(s.bullets) for s in update.playbook.sections))
        m.playbook_tokens.labels(key).set(playbook_tokens(update.playbook))
        m.publish_lag.observe(now - window.closed_at)
        for item in window.items:
            m.trace_to_publish.observe(now - item.read_at)
        decision = state.controller.observe(len(window.items), max(1e-6, now - window.closed_at))
        m.batch_size.labels(key).set(state.controller.current())
        for role, usage in self._llm.usage().items():
            m.llm_calls.labels(role).set(usage.calls)
            m.llm_tokens.labels(role, "in").set(usage.tokens_in)
            m.llm_tokens.labels(role, "out").set(usage.tokens_out)
            m.llm_cost.labels(role).set(usage.cost_usd)
            m.llm_latency.labels(role).set(usage.latency_s)
        log.info(
            "version published",
            key=key,
            version=update.version,
            window=window.number,
            traces=update.stats.window_traces,
            bullets=sum(len(s.bullets) for s in update.playbook.sections),
            batch_size=state.controller.current(),
            controller=decision.reason if decision else None,
        )

    # ------------------------------------------------------------------ commits

    async def _committer(self) -> None:
        while True:
            await anyio.sleep(1.0)
            await self._commit()

    async def _commit(self, *, final: bool = False, only: Sequence[int] | None = None) -> None:
        if self._eos:
            return  # offsets are committed inside the publishing transactions
        topic = self.config.kafka.traces_topic
        offsets: dict[TopicPartition, int] = {}
        for p, state in self._partitions.items():
            if only is not None and p not in only:
                continue
            at = state.offsets.committable()
            if at is not None and at > state.committed:
                offsets[TopicPartition(topic, p)] = at
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:
            log.warning("commit failed; will retry", error=str(exc), final=final)
            return
        for tp, at in offsets.items():
            owned = self._partitions.get(tp.partition)
            if owned is not None:
                owned.committed = at
                hw = self._consumer.highwater(tp)
                if hw is not None:
                    self.metrics.consumer_lag.labels(str(tp.partition)).set(max(0, hw - at))


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:  # closing on the way out: log, never mask the real error
        log.debug("close failed", error=str(exc))
