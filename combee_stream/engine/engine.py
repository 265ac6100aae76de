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
- **releaser** (:mod:`combee_stream.engine.release`, with ``gate.canary`` / ``gate.rollback``)
  — live scores per version from the traces read, the canary and automatic rollback.

Guarantees (see the README's "Guarantees" section): every trace is learned exactly once across
crashes, restarts and rebalances, because (1) offsets are committed only below work whose
PromptUpdate is published (or dead-lettered), (2) each PromptUpdate carries the highest learned
offset of its key, and (3) a restarted or new owner restores that watermark before reading and
skips what is below it. In ``exactly_once`` mode the publish and the offset commit are one Kafka
transaction (one transactional id per input partition) and subscribers read committed data only.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from anyio.abc import TaskGroup

from combee_stream.config import Config, required_secret
from combee_stream.core.learner import LearnerFactory, required_roles
from combee_stream.engine.intake import MAX_POLL_RECORDS, Intake
from combee_stream.engine.metrics import EngineMetrics
from combee_stream.engine.partition import KeyIndex, Partitions, PartitionState
from combee_stream.engine.publisher import Publisher
from combee_stream.engine.release import Releaser
from combee_stream.errors import EngineHalted, UserError
from combee_stream.kafka.client import client_kwargs, start_client, stop_quietly
from combee_stream.kafka.history import partition_of
from combee_stream.kafka.reader import UpdateFetcher, index_partition
from combee_stream.kafka.topics import ensure_topics
from combee_stream.llm import LLMClient
from combee_stream.logs import get_logger
from combee_stream.schemas import Playbook, PromptUpdate

log = get_logger(__name__)


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
    when it stopped itself (the broker unreachable past ``engine.broker_deadline_s``), and
    whatever ``make_learner`` raises at construction (``MissingEndpointError``: an LLM role it
    needs has no endpoint)."""

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
        self.started = anyio.Event()

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Begin a graceful shutdown: stop intake, finish in-flight windows, commit, close."""
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
                await self._intake.run(tg, self._stopping)
                await self._drain()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            halted = group.subgroup(EngineHalted)
            if halted is None:
                raise
            # One clear error instead of a task-group traceback: the first reason it stopped.
            first: BaseException = halted
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _close(self) -> None:
        # Bounded: with the broker gone, each close waits for its request timeout at most once.
        with anyio.move_on_after(self.config.engine.shutdown_grace_s):
            await self._commit(final=True)
            await self._publisher.close()
            await self._fetcher.aclose()
            await stop_quietly(self._consumer)
        if self._owns_llm:
            await self._llm.aclose()
        self.metrics.health.assigned = False
        log.info("engine stopped")

    async def _drain(self) -> None:
        """Flush open windows and give in-flight ones ``shutdown_grace_s`` to publish."""
        keys = self._intake.keys
        log.info("draining", keys=len(keys))
        self._intake.close_inboxes()
        with anyio.move_on_after(self.config.engine.shutdown_grace_s) as scope:
            for entry in list(keys.values()):
                await entry.pipeline.finished.wait()
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
                newest, forks = await index_partition(self.config.kafka, state.partition, self._env)
                state.index = {
                    key: KeyIndex(
                        offset=head.offset,
                        version=head.version,
                        watermark=head.watermark.get(state.partition, -1),
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

    async def _fetch(self, partition: int, indexed: KeyIndex, key: str) -> PromptUpdate | None:
        """A key's newest version, read back from the prompts topic where the index says it is
        (retried while the partition is owned, like every read of the engine)."""
        part = self._partitions.get(partition)
        if part is None:
            return None
        found: list[PromptUpdate | None] = []

        async def attempt() -> None:
            found[:] = [await self._fetcher.update_at(partition, indexed.offset, key)]

        if not await self._publisher.persist("restore", part, attempt):
            return None  # revoked meanwhile: the pipeline is being cancelled
        update = found[0] if found else None
        if update is None or update.version < indexed.version:
            raise EngineHalted(
                f"version {indexed.version} of key {key!r} is no longer at offset "
                f"{indexed.offset} of {self.config.kafka.prompts_topic!r} partition {partition}: "
                "refusing to learn it again from an older state"
            )
        return update

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


__all__ = ["Engine"]
