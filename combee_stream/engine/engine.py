"""The streaming engine: traces topic in, prompt versions out, offsets committed behind them.

This module is the lifecycle and the rebalancing; the work is done by its parts, all in one
anyio task group (nothing outside it):

- **intake** (:mod:`combee_stream.engine.intake`) — the poll loop, routing, backpressure;
- **key pipelines** (:mod:`combee_stream.core.pipeline`) — one per key, the same loop offline
  learning runs, cancelled when their partition is revoked;
- **publisher** (:mod:`combee_stream.engine.publisher`) — the pipelines' sink: publishing,
  parked traces, dead letters, transactional producers, the never-pretend retry loop;
- **restorer** — partitions arrive paused from the rebalance callback (which does no slow
  work); the restorer reads the same partition of the compacted prompts topic, restores every
  key's newest version and watermark, then resumes the partition. A partition whose restore
  cannot read the topic is never resumed with empty state;
- **committer** — commits, per owned partition, the low watermark of unfinished offsets;
- **topic watch** — every ``engine.topic_check_s``, one metadata request: a topic of the
  engine's deleted under it (the prompts topic: its state) halts it with
  :class:`~combee_stream.kafka.topics.TopicLostError` within two checks, ``/readyz`` failing,
  instead of retrying writes to a topic that is gone until the broker deadline;
- **releaser** (:mod:`combee_stream.engine.release`, with ``gate.canary`` / ``gate.rollback``)
  — live scores per version from the traces read, the canary and automatic rollback.

Guarantees (see the README's "Guarantees" section): every trace is learned exactly once across
crashes, restarts and rebalances, because (1) offsets are committed only below work whose
PromptUpdate is published (or dead-lettered), (2) each PromptUpdate carries the highest learned
offset of its key, and (3) a restarted or new owner restores that watermark before reading and
skips what is below it. In ``exactly_once`` mode the publish and the offset commit are one Kafka
transaction (one transactional id per input partition) and subscribers read committed data only.

Shutdown is bounded: ``stop()`` (SIGTERM) gives the flush and the in-flight windows
``engine.shutdown_grace_s`` less what closing the Kafka clients keeps (:func:`close_reserve_s`),
and the clients are then closed all at once within what is left but a moment for the process to
exit (:func:`exit_reserve_s`), so one that cannot flush (its topic deleted, the broker gone)
holds back neither the others nor the exit.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from anyio.abc import TaskGroup

from combee_stream.config import Config, required_secret
from combee_stream.core.learner import LearnerFactory, required_roles
from combee_stream.core.versions import Restored
from combee_stream.engine.intake import MAX_POLL_RECORDS, Intake
from combee_stream.engine.metrics import EngineMetrics
from combee_stream.engine.partition import KeyIndex, Partitions, PartitionState
from combee_stream.engine.publisher import Publisher
from combee_stream.engine.release import Releaser
from combee_stream.errors import EngineHalted, UserError
from combee_stream.kafka.client import client_kwargs, start_client, stop_quietly
from combee_stream.kafka.history import partition_of
from combee_stream.kafka.reader import HorizonAt, UpdateFetcher, index_horizons, index_partition
from combee_stream.kafka.topics import (
    TopicLostError,
    absent_topics,
    engine_topics,
    ensure_topics,
    lost_topic_error,
)
from combee_stream.llm import LLMClient
from combee_stream.logs import get_logger
from combee_stream.schemas import DedupHorizon, Playbook, PromptUpdate

log = get_logger(__name__)


def close_reserve_s(grace_s: float) -> float:
    """What of the shutdown grace closing the Kafka clients keeps: a final commit, aborting
    open transactions and leaving the group take a round trip or two each, all at once."""
    return min(5.0, grace_s / 4)


def exit_reserve_s(grace_s: float) -> float:
    """What of it the process keeps to exit once ``run()`` has returned (the event loop cancels
    what a client left behind; the interpreter shuts down): a few hundred ms, measured."""
    return min(1.0, grace_s / 10)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self._engine._revoke([tp.partition for tp in revoked])

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self._engine._assign([tp.partition for tp in assigned])


class Engine:
    """``await Engine(config, make_learner).run()`` until ``stop()`` (or SIGTERM with
    ``handle_signals``). ``make_learner`` makes the key pipelines' learner of ``config`` and
    the engine's LLM client (``llm``, else one of its own); :class:`combee_stream.Engine` is
    this engine with the configured one. Raises :class:`~combee_stream.errors.EngineHalted`
    when it stopped itself (the broker unreachable past ``engine.broker_deadline_s``, or a
    topic of its deleted: ``TopicLostError``), and whatever ``make_learner`` raises at
    construction (``MissingEndpointError``: an LLM role it needs has no endpoint)."""

    def __init__(
        self,
        config: Config,
        make_learner: LearnerFactory,
        *,
        llm: LLMClient | None = None,
        env: Mapping[str, str] | None = None,
        handle_signals: bool = False,
    ) -> None:
        self.config = config
        self._env = env
        self._llm = llm or LLMClient(config.llm, env=env)
        self._owns_llm = llm is None
        # First: a role without an endpoint raises here, before any Kafka client exists to leak.
        learner = make_learner(config, self._llm)
        canary_secret = None
        if config.gate.canary:  # (fails fast too: a canary no producer can steer needs it)
            canary_secret = required_secret(
                config.gate.canary_secret_env, "gate.canary", env,
                where="on every instance and for every agent (PromptClient reads it)",
            )  # fmt: skip
        self.metrics = EngineMetrics(config.engine.key_metric_series)
        self._handle_signals = handle_signals
        self._eos = config.engine.processing_guarantee == "exactly_once"
        kafka = config.kafka
        self._consumer = AIOKafkaConsumer(
            **client_kwargs(kafka, env),
            group_id=kafka.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_poll_records=MAX_POLL_RECORDS,
            session_timeout_ms=kafka.session_timeout_ms,
            heartbeat_interval_ms=max(300, kafka.session_timeout_ms // 4),
        )
        self._partitions: Partitions = {}
        self._release = Releaser(
            config, self.metrics, revert=self._revert, owned=self._owns, env=env,
            canary_secret=canary_secret,
        )  # fmt: skip
        self._publisher = Publisher(
            config,
            self._partitions,
            self.metrics,
            self._llm,
            env,
            on_published=self._release.published if self._release.enabled else None,
        )
        self._intake = Intake(
            config,
            self._consumer,
            self._partitions,
            learner,
            self._publisher,
            self.metrics,
            outage=lambda: self._llm.outage,
            fetch=self._fetch,
            observe=self._release.observe if self._release.enabled else None,
            evicted=self._release.forget,
        )
        self._fetcher = UpdateFetcher(kafka, env)
        self._generation = 0
        self._restore_send, self._restore_recv = anyio.create_memory_object_stream[int](1000)
        self._tg: TaskGroup | None = None
        self._stopping = anyio.Event()
        # Bounds intake and the flush once stop() is called (made in run(): a scope needs the
        # event loop, and an Engine may be made before it runs).
        self._grace: anyio.CancelScope | None = None
        self._drain_by = math.inf  # when the flush is given up, once stop() was called
        self._stop_by: float | None = None  # when run() has returned, once stop() was called
        self.started = anyio.Event()

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Begin a graceful shutdown: stop intake, finish in-flight windows, commit, close;
        ``run()`` returns within ``engine.shutdown_grace_s`` of this call, less a moment for
        the process to exit. Call it from the event loop's thread."""
        if self._stopping.is_set():
            return
        grace, now = self.config.engine.shutdown_grace_s, anyio.current_time()
        self._stop_by = now + grace - exit_reserve_s(grace)
        self._drain_by = now + grace - close_reserve_s(grace)
        if self._grace is not None:
            self._grace.deadline = self._drain_by
        self._stopping.set()

    async def run(self) -> None:
        cfg = self.config
        try:
            await self._llm.check(*required_roles(cfg))  # type: ignore[arg-type]
            await ensure_topics(cfg.kafka, self._env)
            await self._publisher.start()
            self._consumer.subscribe([cfg.kafka.traces_topic], listener=_Rebalance(self))
            await start_client(self._consumer, cfg.kafka)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._close()
            raise
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self._handle_signals:
                    tg.start_soon(self._watch_signals)
                if cfg.engine.metrics_port:
                    tg.start_soon(self._serve_metrics)
                tg.start_soon(self._restorer)
                tg.start_soon(self._committer)
                tg.start_soon(self._outage_prober)
                tg.start_soon(self._watch_topics)
                if self._release.enabled:
                    tg.start_soon(self._release.run)
                self.started.set()
                log.info(
                    "engine started",
                    traces=cfg.kafka.traces_topic,
                    prompts=cfg.kafka.prompts_topic,
                    guarantee=cfg.engine.processing_guarantee,
                    strategy=cfg.learning.strategy,
                )
                with anyio.CancelScope(deadline=self._drain_by) as self._grace:
                    await self._intake.run(tg, self._stopping)
                    await self._drain()
                if self._grace.cancelled_caught:
                    log.warning("shutdown grace expired: abandoning unpublished windows")
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            halted = group.subgroup(EngineHalted)
            if halted is None:
                raise
            # One clear error instead of a task-group traceback: the first reason it stopped.
            first: BaseException = halted
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            if isinstance(first, TopicLostError):  # found by the topic watch or by a read
                self._lost_topic(True)
                log.error("engine halted: a topic was deleted", topic=first.topic, error=str(first))
            raise first from None
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _close(self) -> None:
        """Commit what is done and close every Kafka client, all at once and bounded: within
        what is left of the grace after stop(), else (a halt, a failed start) the reserve."""
        grace = self.config.engine.shutdown_grace_s
        now = anyio.current_time()
        by = self._stop_by if self._stop_by is not None else now + close_reserve_s(grace)
        open_clients = {"consumer", "producers", "fetcher"}

        async def close(name: str, closing: Callable[[], Awaitable[None]]) -> None:
            await closing()
            open_clients.discard(name)

        with anyio.move_on_after(max(0.0, by - now)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(close, "consumer", lambda: self._close_consumer((by - now) / 2))
                tg.start_soon(close, "producers", self._publisher.close)
                tg.start_soon(close, "fetcher", self._fetcher.aclose)
        if open_clients:
            # One that cannot flush (a batch to a deleted topic never completes) or reach the
            # broker; the process exits all the same.
            log.warning(
                "kafka clients not closed within the shutdown grace: left behind",
                clients=sorted(open_clients),
            )
        if self._owns_llm:
            await self._llm.aclose()
        self.metrics.health.assigned = False
        log.info("engine stopped")

    async def _close_consumer(self, commit_s: float) -> None:
        """The final commit (within ``commit_s``: with the broker gone it would take the whole
        bound), then the consumer's stop, which must start to leave the group."""
        with anyio.move_on_after(commit_s):
            await self._commit(final=True)
        await stop_quietly(self._consumer)

    async def _drain(self) -> None:
        """Flush open windows and wait for in-flight ones to publish (bounded by the grace)."""
        keys = self._intake.keys
        log.info("draining", keys=len(keys))
        self._intake.close_inboxes()
        for entry in list(keys.values()):
            await entry.pipeline.finished.wait()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal received: shutting down", signal=signal.Signals(signum).name)
                self.stop()
                return

    async def _serve_metrics(self) -> None:
        from combee_stream.http import serve_asgi

        cfg = self.config.engine
        try:
            server = serve_asgi(self.metrics.asgi_app(), cfg.metrics_host, cfg.metrics_port)
            async with server as http:
                log.info("metrics endpoint", url=f"{http.root_url}/metrics")
                await anyio.sleep_forever()
        except OSError as exc:
            raise UserError(
                f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port} ({exc}); set"
                " engine.metrics_port to a free port, or 0 for any"
            ) from exc

    # ------------------------------------------------------------------ releases

    def _owns(self, key: str) -> bool:
        state = self._partitions.get(partition_of(key, self.config.kafka.partitions))
        return state is not None and state.owned

    def _revert(self, key: str, version: int, playbook: Playbook) -> bool:
        """The key's next window starts from ``playbook`` (version ``version``); False when the
        key has no pipeline here (its next owner or next start reads the newest version, and a
        canary refuses that line again)."""
        entry = self._intake.keys.get(key)
        if entry is not None:
            entry.pipeline.revert_to(version, playbook)
        return entry is not None

    # ------------------------------------------------------------------ rebalancing

    async def _assign(self, partitions: Sequence[int]) -> None:
        """Rebalance callback: only bookkeeping. Restoring happens in the restorer task."""
        topic = self.config.kafka.traces_topic
        self._consumer.pause(*[TopicPartition(topic, p) for p in partitions])
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
            async with state.lock:  # waits for at most one publish attempt in progress
                state.owned = False
            for scope in list(state.workers):  # each removes itself once it has finished
                scope.cancel()
        await self._commit(final=True, only=partitions)
        for p in partitions:
            self._partitions.pop(p, None)
            if self._tg is not None:
                self._publisher.drop_partition(p, self._tg)
        self._release.drop_partitions(partitions)
        self._intake.drop_partitions(partitions)
        self.metrics.health.assigned = any(s.restored.is_set() for s in self._partitions.values())
        log.info("partitions revoked", partitions=sorted(partitions))

    async def _restorer(self) -> None:
        async for p in self._restore_recv:
            state = self._partitions.get(p)
            if state is None or not state.owned:
                continue

            async def restore(state: PartitionState = state) -> None:
                # Fence first, then read: initialising the partition's transactional id
                # aborts or waits out the transaction of any earlier owner (a zombie), so the
                # read below sees every version that will ever be committed before ours.
                await self._publisher.txn_producer(state)
                # Streamed: a few numbers per key are kept, never every key's update (a key's
                # update is read back when it becomes active). An undecodable record halts.
                kafka, partition = self.config.kafka, state.partition
                horizons: dict[str, HorizonAt] = {}

                async def read_horizons() -> None:
                    horizons.update(await index_horizons(kafka, partition, self._env))

                async with anyio.create_task_group() as reads:  # two topics, read at once
                    reads.start_soon(read_horizons)
                    newest, forks = await index_partition(kafka, partition, self._env)
                none = HorizonAt(offset=-1, version=-1)
                state.index = {
                    key: KeyIndex(
                        offset=head.offset,
                        version=head.version,
                        watermark=head.watermark.get(partition, -1),
                        horizon_offset=horizons.get(key, none).offset,
                        horizon_version=horizons.get(key, none).version,
                    )
                    for key, head in newest.items()
                }
                if forks:
                    log.error(
                        "forked version chains on the prompts topic: the first published "
                        "version of each is kept",
                        forks=[f"{k} v{v}" for k, v in forks],
                    )

            # Retried while owned; past the deadline the engine halts. Never resumed unrestored.
            if not await self._publisher.persist("restore", state, restore):
                continue  # revoked while restoring
            if self._partitions.get(p) is not state:
                continue
            state.restored.set()
            self._intake.resume(p)
            self.metrics.health.assigned = True
            log.info("partition restored", partition=p, keys=len(state.index))

    async def _fetch(self, partition: int, indexed: KeyIndex, key: str) -> Restored | None:
        """A key's newest version and its dedup horizon, read back from the prompts and dedup
        topics where the index says they are (retried while the partition is owned, like every
        read of the engine)."""
        part = self._partitions.get(partition)
        if part is None:
            return None
        found: list[PromptUpdate | None] = []
        horizon: list[DedupHorizon | None] = []

        async def attempt() -> None:
            found[:] = [await self._fetcher.update_at(partition, indexed.offset, key)]
            if indexed.horizon_offset >= 0:
                fetched = await self._fetcher.horizon_at(partition, indexed.horizon_offset, key)
                horizon[:] = [fetched]

        if not await self._publisher.persist("restore", part, attempt):
            return None  # revoked meanwhile: the pipeline is being cancelled
        update = found[0] if found else None
        if update is None or update.version < indexed.version:
            raise EngineHalted(
                f"version {indexed.version} of key {key!r} is no longer at offset "
                f"{indexed.offset} of {self.config.kafka.prompts_topic!r} partition {partition}: "
                "refusing to learn it again from an older state"
            )
        mark = horizon[0] if horizon else None
        if mark is None or mark.key != key:
            return Restored(update)
        return Restored(update, mark.ids, mark.version)

    async def _watch_topics(self) -> None:
        """Halt when a topic of the engine's is gone: two metadata answers in a row (a check
        apart) that do not list it. A check no broker answers says nothing (an outage is the
        broker deadline's business)."""
        kafka = self.config.kafka
        names = engine_topics(kafka)
        every = self.config.engine.topic_check_s
        missed: set[str] = set()
        while True:
            await anyio.sleep(every)
            absent: list[str] | None = None
            with anyio.move_on_after(kafka.request_timeout_ms / 1000):
                try:
                    absent = await absent_topics(self._consumer._client, names)
                except KafkaError:
                    pass
            if absent is None:
                missed.clear()
                continue
            gone = [name for name in absent if name in missed]
            missed = set(absent)
            # Not ready from the first answer without it; halted at the second. Nothing more is
            # published: the halt cancels every window (a transaction to a topic that is gone
            # aborts, its history records with it).
            self._lost_topic(bool(absent))
            if gone:
                raise lost_topic_error(kafka, gone[0])

    def _lost_topic(self, missing: bool) -> None:
        """``/readyz`` fails while a topic of the engine's is missing."""
        failing = self.metrics.health.failing
        if missing != bool(failing["lost_topic"]):
            failing["lost_topic"] = int(missing)

    async def _outage_prober(self) -> None:
        """While an LLM endpoint is down intake is paused; probe it, so that learning resumes
        even when no call is left to find out that it is back."""
        while True:
            await anyio.sleep(1.0)
            if self._llm.outage:
                await self._llm.probe()

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
            # Safe to retry at the next tick: committing less than is done loses nothing.
            self.metrics.broker_failures.labels("commit").inc()
            log.warning("commit failed; will retry", error=str(exc), final=final)
            return
        for tp, at in offsets.items():
            owned = self._partitions.get(tp.partition)
            if owned is not None:
                owned.committed = at
                hw = self._consumer.highwater(tp)
                if hw is not None:
                    self.metrics.consumer_lag.labels(str(tp.partition)).set(max(0, hw - at))


__all__ = ["Engine", "close_reserve_s", "exit_reserve_s"]
