"""The one topic reader: read a topic (or some partitions) from the beginning to its current end,
and decode prompt updates. Used by the subscriber's catch-up, the engine's restore, ``inspect``,
the benchmarks and the tests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from combee_stream.config import KafkaConfig
from combee_stream.errors import DecodeError, EngineHalted, UserError
from combee_stream.kafka.client import client_kwargs, partitions_of, start_client, stop_quietly
from combee_stream.kafka.topics import lost_topic_error
from combee_stream.logs import get_logger
from combee_stream.schemas import DedupHorizon, PromptUpdate, decode, encode

log = get_logger(__name__)


def reading_consumer(cfg: KafkaConfig, env: Mapping[str, str] | None = None) -> AIOKafkaConsumer:
    """A group-less consumer that sees committed data only (in exactly-once mode a version is
    visible once its input offsets are committed with it)."""
    return AIOKafkaConsumer(
        **client_kwargs(cfg, env),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )


class TopicMissingError(UserError):
    """A topic a reader needs does not exist: never created, or deleted (then, for the
    prompts topic, the engine's state is lost)."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


# How often a reader confirms, with a metadata request, that a topic its client no longer
# knows is gone: aiokafka drops a deleted topic from its cached metadata within a fraction of
# a second of a failed fetch, and then asks for metadata again thousands of times a second,
# for ever, without telling its caller.
TOPIC_CHECK_S = 2.0


class TopicWatch:
    """Notices a topic deleted under a reading consumer within seconds, at no cost while it
    exists: a miss in the client's cached metadata is confirmed by fresh metadata, at most
    every ``every_s`` (a topic not yet in the cache is no miss)."""

    def __init__(self, consumer: AIOKafkaConsumer, every_s: float = TOPIC_CHECK_S) -> None:
        self._consumer = consumer
        self._every_s = every_s
        self._checked_at = -math.inf

    async def check(self, topics: Collection[str], hint: str = "") -> None:
        """Raise :class:`TopicMissingError` for the first of ``topics`` that is gone."""
        cached = self._consumer._client.cluster
        if all(cached.partitions_for_topic(t) is not None for t in topics):
            return
        now = anyio.current_time()
        if now - self._checked_at < self._every_s:
            return
        self._checked_at = now
        for topic in topics:
            if not await partitions_of(self._consumer, topic):
                raise TopicMissingError(
                    topic, f"topic {topic!r} no longer exists: it was deleted{hint}"
                )


async def assign_from_start(
    consumer: AIOKafkaConsumer,
    topic: str,
    partitions: Collection[int] | None = None,
    *,
    hint: str = "",
    partitions_hint: str = "",
) -> list[TopicPartition]:
    """Assign ``partitions`` of ``topic`` (all when None) to a started consumer, at the start.
    The hints end the error when the topic, or one of the partitions, does not exist."""
    available = await partitions_of(consumer, topic)
    if not available:
        raise TopicMissingError(topic, f"topic {topic!r} does not exist{hint}")
    if partitions is not None:
        absent = set(partitions) - available
        if absent:
            raise UserError(f"topic {topic!r} has no partitions {sorted(absent)}{partitions_hint}")
        available = set(partitions)
    tps = [TopicPartition(topic, p) for p in sorted(available)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    return tps


async def until_end(
    consumer: AIOKafkaConsumer,
    tps: Sequence[TopicPartition],
    poll_timeout_ms: int = 500,
    *,
    hint: str = "",
) -> AsyncIterator[list[Any]]:
    """Batches of records of ``tps`` up to the end offsets seen on entry (so it terminates while
    producers keep writing); the consumer is then positioned to follow live. A topic deleted
    meanwhile raises :class:`TopicMissingError` (``hint`` ends it) instead of waiting forever."""
    end = await consumer.end_offsets(list(tps))
    watch = TopicWatch(consumer)
    for tp in tps:
        while await consumer.position(tp) < end[tp]:
            batches = await consumer.getmany(tp, timeout_ms=poll_timeout_ms)
            if not batches:
                await watch.check([tp.topic], hint)
            for batch in batches.values():
                yield batch


async def read_to_end(
    cfg: KafkaConfig,
    topic: str,
    *,
    partitions: Collection[int] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Every record now readable in ``topic`` (committed data only), partition by partition."""
    consumer = reading_consumer(cfg, env)
    await start_client(consumer, cfg)
    records: list[Any] = []
    try:
        tps = await assign_from_start(consumer, topic, partitions)
        async for batch in until_end(consumer, tps):
            records.extend(batch)
    finally:
        await consumer.stop()
    return records


def decode_update(record: Any) -> PromptUpdate | None:
    """A prompts-topic record as an update; None for a tombstone. Raises DecodeError."""
    if record.value is None:
        return None
    return decode(record.value, PromptUpdate)


async def read_updates(
    cfg: KafkaConfig,
    *,
    keys: Collection[str] | None = None,
    partitions: Collection[int] | None = None,
    strict: bool = False,
    env: Mapping[str, str] | None = None,
) -> list[PromptUpdate]:
    """Every prompt update now on the prompts topic, in topic order per partition (compaction
    keeps at least the newest per key). Tombstones are skipped; an undecodable record is
    skipped with a warning, or raises DecodeError when ``strict`` (audits)."""
    wanted = frozenset(keys) if keys is not None else None
    updates: list[PromptUpdate] = []
    for record in await read_to_end(cfg, cfg.prompts_topic, partitions=partitions, env=env):
        try:
            update = decode_update(record)
        except DecodeError as exc:
            if strict:
                raise
            log.warning("undecodable prompt update skipped", offset=record.offset, reason=str(exc))
            continue
        if update is not None and (wanted is None or update.key in wanted):
            updates.append(update)
    return updates


class UndecodableStateError(EngineHalted):
    """A prompts-topic record the engine cannot decode: restoring past it could resume a key
    from an older version (or none), so the engine stops instead."""


class Newest(msgspec.Struct, frozen=True):
    """What a restore keeps of a key's newest version: where it is and what routing needs,
    plus a digest of its content (to tell a fork from a retried send)."""

    offset: int
    version: int
    watermark: dict[int, int]
    digest: bytes


def content_digest(update: PromptUpdate) -> bytes:
    """The part of a version two records of it must share to be the same version (a retried
    send); two that differ here are a fork. The one comparison of the subscriber, the
    restore and ``inspect``."""
    parts = [update.playbook, update.stats.trace_ids, update.parent_version]
    return hashlib.blake2b(encode(parts), digest_size=16).digest()


async def index_partition(
    cfg: KafkaConfig, partition: int, env: Mapping[str, str] | None = None
) -> tuple[dict[str, Newest], list[tuple[str, int]]]:
    """The newest version of every key in one partition of the prompts topic, and the forks
    seen ((key, version): a second, different record of a version; the first stands). Records
    are decoded one at a time and only :class:`Newest` is kept per key, so the restore's
    memory is a few numbers per key whatever the playbooks weigh (a key's update is read back
    when it becomes active). Raises :class:`UndecodableStateError` on a record that does not
    decode: nothing of the partition may be resumed on a guess."""
    consumer = reading_consumer(cfg, env)
    await start_client(consumer, cfg)
    newest: dict[str, Newest] = {}
    forks: list[tuple[str, int]] = []
    try:
        try:
            tps = await assign_from_start(consumer, cfg.prompts_topic, [partition])
        except TopicMissingError as exc:  # the topic was deleted under a running engine
            raise lost_topic_error(cfg, cfg.prompts_topic) from exc
        async for batch in _restoring(cfg, until_end(consumer, tps)):
            for record in batch:
                key = record.key.decode(errors="replace") if record.key else ""
                try:
                    update = decode_update(record)
                except DecodeError as exc:
                    raise UndecodableStateError(
                        f"undecodable record on {cfg.prompts_topic!r} partition {partition} "
                        f"offset {record.offset} (key {key!r}): {exc}. Restoring past it could "
                        "resume the key from an older version: nothing was committed. Fix it by "
                        f"publishing a valid version of {key!r} (`combee-stream prompts set "
                        f"{key} FILE`, which writes after it), then run again"
                    ) from exc
                if update is None:  # tombstone: the key was deleted
                    newest.pop(key, None)
                    continue
                digest = content_digest(update)
                current = newest.get(update.key)
                if current is not None and update.version <= current.version:
                    if update.version == current.version and digest != current.digest:
                        forks.append((update.key, update.version))
                    continue
                newest[update.key] = Newest(
                    offset=record.offset,
                    version=update.version,
                    watermark=update.watermark,
                    digest=digest,
                )
    finally:
        await consumer.stop()
    return newest, forks


async def _restoring(cfg: KafkaConfig, batches: AsyncIterator[list[Any]]) -> AsyncIterator[Any]:
    """``batches`` of a read the engine restores from: a topic deleted meanwhile is its state
    lost (:class:`~combee_stream.kafka.topics.TopicLostError`), not a user's mistake."""
    try:
        async for batch in batches:
            yield batch
    except TopicMissingError as exc:
        raise lost_topic_error(cfg, exc.topic) from exc


class HorizonAt(msgspec.Struct, frozen=True):
    """Where a key's dedup record is (the engine's index), and the version it was written with."""

    offset: int
    version: int


async def index_horizons(
    cfg: KafkaConfig, partition: int, env: Mapping[str, str] | None = None
) -> dict[str, HorizonAt]:
    """Where each key's dedup record is in one partition of the dedup topic (the newest per key;
    a tombstone drops the key). Only the version is decoded of each record (the digests are
    read back when the key becomes active). An undecodable record is skipped with a warning:
    a horizon is a help against re-sends, never the key's state."""
    topic = cfg.dedup_topic_name
    consumer = reading_consumer(cfg, env)
    await start_client(consumer, cfg)
    found: dict[str, HorizonAt] = {}
    try:
        try:
            tps = await assign_from_start(consumer, topic, [partition])
        except TopicMissingError as exc:
            raise lost_topic_error(cfg, topic) from exc
        async for batch in _restoring(cfg, until_end(consumer, tps)):
            for record in batch:
                key = record.key.decode(errors="replace") if record.key else ""
                if record.value is None:
                    found.pop(key, None)
                    continue
                try:
                    version = msgspec.json.decode(record.value, type=_VersionOnly).version
                except msgspec.MsgspecError as exc:
                    log.warning(
                        "undecodable dedup record skipped",
                        topic=topic,
                        partition=partition,
                        offset=record.offset,
                        reason=str(exc),
                    )
                    continue
                current = found.get(key)
                if current is None or version >= current.version:
                    found[key] = HorizonAt(offset=record.offset, version=version)
    finally:
        await consumer.stop()
    return found


class _VersionOnly(msgspec.Struct):
    version: int


class UpdateFetcher:
    """Reads a key's newest update back from the prompts topic at its known offset (the
    engine's index), so an idle key's playbook need not stay in memory, and its dedup horizon
    from the dedup topic likewise. One consumer, one read at a time."""

    def __init__(self, cfg: KafkaConfig, env: Mapping[str, str] | None = None) -> None:
        self._cfg = cfg
        self._env = env
        # Made on first use: a consumer made and never started warns "Unclosed" when an
        # engine stops at a start check.
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = anyio.Lock()

    async def aclose(self) -> None:
        if self._consumer is not None:
            await stop_quietly(self._consumer)

    async def update_at(self, partition: int, offset: int, key: str) -> PromptUpdate | None:
        """The update of ``key`` at ``offset``; past it when compaction moved things (the
        newest of a key is never compacted away, so reading on finds it)."""
        value = await self._value_at(self._cfg.prompts_topic, partition, offset, key)
        return None if value is None else decode(value, PromptUpdate)

    async def horizon_at(self, partition: int, offset: int, key: str) -> DedupHorizon | None:
        """The dedup record of ``key`` at ``offset`` (or past it, as :meth:`update_at`); None
        when it cannot be decoded (a warning: the key's version alone is restored then)."""
        value = await self._value_at(self._cfg.dedup_topic_name, partition, offset, key)
        if value is None:
            return None
        try:
            return decode(value, DedupHorizon)
        except DecodeError as exc:
            log.warning("undecodable dedup record skipped", key=key, offset=offset, reason=str(exc))
            return None

    async def _value_at(self, topic: str, partition: int, offset: int, key: str) -> bytes | None:
        """The value of the first record of ``key`` at or after ``offset`` (None: none)."""
        async with self._lock:
            consumer = self._consumer
            if consumer is None:
                consumer = reading_consumer(self._cfg, self._env)
                await start_client(consumer, self._cfg)  # stops it when it fails
                self._consumer = consumer
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek(tp, offset)
            end = (await consumer.end_offsets([tp]))[tp]
            watch = TopicWatch(consumer)
            wanted = key.encode()
            while await consumer.position(tp) < end:
                batch = (await consumer.getmany(tp, timeout_ms=500, max_records=50)).get(tp, [])
                if not batch:
                    try:
                        await watch.check([topic])
                    except TopicMissingError as exc:
                        raise lost_topic_error(self._cfg, topic) from exc
                for record in batch:
                    if record.key == wanted and record.value is not None:
                        return bytes(record.value)
            return None


__all__ = [
    "TOPIC_CHECK_S",
    "HorizonAt",
    "Newest",
    "TopicMissingError",
    "TopicWatch",
    "UndecodableStateError",
    "UpdateFetcher",
    "assign_from_start",
    "content_digest",
    "decode_update",
    "index_horizons",
    "index_partition",
    "read_to_end",
    "read_updates",
    "reading_consumer",
    "until_end",
]
