"""PromptSubscriber: what agents use to always start their next task with the newest prompt.

It reads the compacted prompts topic from the beginning (so it knows the newest version of every
key the moment ``__aenter__`` returns), then follows live updates. A version older than or equal
to the one it holds is ignored, so a late or replayed record can never roll a key back.

Forks: two different updates with one version number for one key (a zombie writer, or two
engines on one key) are reported, in ``forks`` and as an error log line, and the rule is that
the first published one stands (it is the one every reader saw first; the engine restores it
and continues from it).

    async with PromptSubscriber(config.kafka, keys={"support-bot"}) as prompts:
        prompt = prompts.latest("support-bot")
        async for update in prompts:      # newer versions as they are published
            ...

Labels (:mod:`combee_stream.kafka.history`): with ``label="production"`` (what agents should
ask for; ``PromptClient`` does) or another label, or ``version=N`` (pinned), ``latest(key)`` is
the version the label points at, read from the history topic when it is not the newest, and
iterating yields an update whenever the version served changes (a new version while production
follows latest, a promotion, a rollback). Without either it is the newest version (the engine's
restore and ``inspect`` read it so). Given a ``session`` id, a subscriber asking for production
is served the candidate while a live canary runs and the session hashes into its share: a hash
keyed with the canary secret (``canary_secret``, default the environment's
``COMBEE_CANARY_SECRET``) when the engine's labels say the split is keyed. A subscriber that does
not hold the same secret cannot tell its arm and is served production (with a warning).

A topic it reads that does not exist, or is deleted while it runs, raises
:class:`~combee_stream.kafka.reader.TopicMissingError` (within seconds: it never waits on a
topic that is gone); ``PromptClient`` and ``subscribe`` back off and try again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping
from types import TracebackType
from typing import Any, Self

from aiokafka import TopicPartition

from combee_stream.config import CANARY_SECRET_ENV, KafkaConfig, secret
from combee_stream.errors import DecodeError
from combee_stream.kafka.client import partitions_of, start_client
from combee_stream.kafka.history import (
    CANDIDATE,
    KeyHistory,
    canary_arm,
    parse,
    partition_of,
    resolve,
)
from combee_stream.kafka.reader import (
    TopicWatch,
    assign_from_start,
    content_digest,
    decode_update,
    reading_consumer,
    until_end,
)
from combee_stream.logs import get_logger
from combee_stream.schemas import Labels, PromptUpdate

log = get_logger(__name__)

# What a missing topic means to a reader of prompts: never created, or deleted.
MISSING_HINT = (
    ": no engine has published here yet (`combee-stream topics create` creates it), or it was "
    "deleted (then the engine's state is lost: `combee-stream run` says how to recover)"
)
DELETED_HINT = " (the engine's state is lost: `combee-stream run` says how to recover)"


class PromptSubscriber:
    def __init__(
        self,
        cfg: KafkaConfig,
        *,
        keys: Collection[str] | None = None,
        partitions: Collection[int] | None = None,
        env: Mapping[str, str] | None = None,
        poll_timeout_ms: int = 500,
        label: str | None = None,
        version: int | None = None,
        session: str | None = None,
        canary_secret: str | None = None,
    ) -> None:
        if label is not None and version is not None:
            raise ValueError("ask for a label or pin a version, not both")
        self._cfg = cfg
        # The agent's session (or agent) id: with it, asking for production during a live
        # canary serves the candidate to the sessions in the canary share (sticky by hash).
        self._session = session
        self._canary_secret = canary_secret or secret(CANARY_SECRET_ENV, env)
        self._unkeyed_warned: set[str] = set()  # keys whose keyed split this one cannot tell
        self._label = label
        self._version = version
        self._history: dict[str, KeyHistory] = {}
        self._served: dict[str, int] = {}  # key -> version last served (labels / pins)
        self._topic = cfg.prompts_topic
        self._keys = frozenset(keys) if keys is not None else None
        # Only these partitions of the prompts topic (the engine restores the keys of the
        # traces partitions it was assigned; co-partitioning makes the numbers match).
        self._partitions = frozenset(partitions) if partitions is not None else None
        self._poll_timeout_ms = poll_timeout_ms
        self._latest: dict[str, PromptUpdate] = {}
        self.offsets: dict[str, int] = {}  # key -> offset of its newest update on the topic
        self.ignored_stale = 0
        self.forks: list[tuple[str, int]] = []  # (key, version) seen twice with other content
        self._consumer = reading_consumer(cfg, env)
        self._watch = TopicWatch(self._consumer)
        self._topics = [cfg.prompts_topic]  # and the history topic, when it serves labels

    async def __aenter__(self) -> Self:
        await start_client(self._consumer, self._cfg)
        try:
            await self._catch_up()
        except BaseException:
            await self._consumer.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._consumer.stop()

    @property
    def _labeled(self) -> bool:
        return self._label is not None or self._version is not None

    async def _catch_up(self) -> None:
        partitions = self._partitions
        if partitions is None and self._keys is not None and self._labeled:
            # Co-partitioned: a key's history is in the partition number of its prompts.
            partitions = frozenset(partition_of(k, self._cfg.partitions) for k in self._keys)
        tps = await assign_from_start(
            self._consumer,
            self._topic,
            partitions,
            hint=MISSING_HINT,
            partitions_hint=": traces and prompts topics must be co-partitioned",
        )
        if self._labeled and not await partitions_of(self._consumer, self._cfg.history_topic):
            # A deployment older than the history topic: nothing has labels there yet.
            log.warning(
                "no history topic: serving the newest version (run `combee-stream topics "
                "create` to add it)",
                topic=self._cfg.history_topic,
            )
            self._label = self._version = None
        if self._labeled:
            history = [TopicPartition(self._cfg.history_topic, tp.partition) for tp in tps]
            self._consumer.assign([*tps, *history])
            await self._consumer.seek_to_beginning(*tps, *history)
            tps = [*tps, *history]
            self._topics.append(self._cfg.history_topic)
        async for batch in until_end(self._consumer, tps, self._poll_timeout_ms, hint=DELETED_HINT):
            for record in batch:
                self._accept(record)
        for key in self._history.keys() | self._latest.keys():
            served = self.latest(key)
            if served is not None:
                self._served[key] = served.version

    async def _poll(self) -> list[PromptUpdate]:
        accepted: list[PromptUpdate] = []
        batches = await self._consumer.getmany(timeout_ms=self._poll_timeout_ms)
        if not batches:  # quiet, or a topic gone (aiokafka would wait on it for ever)
            await self._watch.check(self._topics, DELETED_HINT)
        for records in batches.values():
            for record in records:
                update = self._accept(record)
                if update is not None and not self._labeled:
                    accepted.append(update)
        if self._labeled:
            for key in self._history.keys() | self._latest.keys():
                served = self.latest(key)
                if served is not None and self._served.get(key) != served.version:
                    self._served[key] = served.version
                    accepted.append(served)
        return accepted

    def _accept(self, record: Any) -> PromptUpdate | None:
        if record.topic == self._cfg.history_topic:
            parse(record, self._history, self._keys)
            return None
        try:
            update = decode_update(record)
        except DecodeError as exc:
            log.warning("undecodable prompt update skipped", offset=record.offset, reason=str(exc))
            return None
        if update is None:  # tombstone: the key was deleted
            key = record.key.decode() if record.key else ""
            self._latest.pop(key, None)
            return None
        if self._keys is not None and update.key not in self._keys:
            return None
        current = self._latest.get(update.key)
        if current is not None and update.version <= current.version:
            self.ignored_stale += 1
            if update.version == current.version and _differs(update, current):
                self.forks.append((update.key, update.version))
                log.error(
                    "fork: a second, different update with the same version (the first stands)",
                    key=update.key,
                    version=update.version,
                    offset=record.offset,
                )
            return None
        self._latest[update.key] = update
        self.offsets[update.key] = record.offset
        return update

    def latest(self, key: str) -> PromptUpdate | None:
        """The version served for ``key``: the newest, or the one the label or pin names
        (None if the key has none, or the label points nowhere)."""
        newest = self._latest.get(key)
        if not self._labeled:
            return newest
        history = self._history.get(key)
        if self._version is not None:
            target: int | None = self._version
        else:
            assert self._label is not None
            labels = history.labels if history is not None else Labels(key=key)
            top = max(
                [*(history.versions if history else ()), *([newest.version] if newest else [])],
                default=None,
            )
            target = resolve(labels, self._label, top, self._session, self._canary_secret)
            self._warn_unkeyed(labels)
        if target is None:
            return None
        if newest is not None and newest.version == target:
            return newest
        return history.versions.get(target) if history is not None else None

    def _warn_unkeyed(self, labels: Labels) -> None:
        if (
            self._session
            and labels.canary > 0
            and CANDIDATE in labels.labels
            and labels.key not in self._unkeyed_warned
            and canary_arm(labels, self._session, self._canary_secret) is None
        ):
            self._unkeyed_warned.add(labels.key)
            log.warning(
                "the live canary's split is keyed with a secret this subscriber does not hold: "
                f"serving production (set {CANARY_SECRET_ENV} as the engine's "
                "gate.canary_secret_env)",
                key=labels.key,
            )

    def labels(self, key: str) -> Labels:
        """The key's labels as last read (only with ``label`` or ``version``)."""
        history = self._history.get(key)
        return history.labels if history is not None else Labels(key=key)

    def snapshot(self) -> dict[str, PromptUpdate]:
        return dict(self._latest)

    async def poll(self) -> list[PromptUpdate]:
        """Read what has arrived (waiting at most the poll timeout); newer versions only."""
        return await self._poll()

    async def __aiter__(self) -> AsyncIterator[PromptUpdate]:
        while True:
            for update in await self._poll():
                yield update


def _differs(a: PromptUpdate, b: PromptUpdate) -> bool:
    """Two records of one version that are not the same version (a retried send re-writes the
    same update: not a fork)."""
    return content_digest(a) != content_digest(b)


__all__ = ["DELETED_HINT", "MISSING_HINT", "PromptSubscriber"]
