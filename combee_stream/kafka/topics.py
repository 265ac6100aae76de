"""Create and check the engine's topics (and the ingest stage's: its inputs and its state).

Traces and prompts are co-partitioned: the same partition count and the same key hashing (every
producer in this package uses aiokafka's default murmur2 partitioner, the Java client's), so a
key's traces and its prompt versions live in the same partition number and move together when a
consumer group rebalances. The prompts topic must be compacted: it is the engine's state store,
with the history topic (every version, the labels) and the dedup topic (each key's last trace
ids) beside it, co-partitioned and compacted alike.

A state topic deleted under a running engine is its state lost: :func:`lost_topic_error` says
so and how to recover (the engine checks its topics while it runs); at start,
:func:`ensure_topics` refuses to recreate a lost prompts topic under committed progress.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Final

import anyio
import msgspec
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from combee_stream.config import DEDUP_RECORD_BYTES, IngestConfig, KafkaConfig
from combee_stream.errors import EngineHalted, UserError
from combee_stream.kafka.client import client_kwargs, start_client
from combee_stream.logs import get_logger
from combee_stream.retry import RetryPolicy

log = get_logger(__name__)


class TopicSpec(msgspec.Struct, frozen=True):
    name: str
    partitions: int
    configs: dict[str, str]


class TopicMismatchError(UserError):
    """An existing topic does not match what the engine needs."""


def run_topics(cfg: KafkaConfig, run: str, **overrides: object) -> KafkaConfig:
    """``cfg`` with topics and a consumer group of one run's own (``RUN.traces``,
    ``RUN.prompts``, ``RUN.history``, ``RUN.dlq``, group ``RUN.group``), so the runs on one
    broker (demos, benchmarks, tests) never see each other's data; ``overrides`` replace other
    fields (``partitions``, say)."""
    return msgspec.structs.replace(
        cfg,
        traces_topic=f"{run}.traces",
        prompts_topic=f"{run}.prompts",
        history_topic=f"{run}.history",
        dlq_topic=f"{run}.dlq",
        group_id=f"{run}.group",
        **overrides,
    )


def topic_specs(cfg: KafkaConfig) -> list[TopicSpec]:
    prompts_configs = {
        "cleanup.policy": "compact",
        "max.message.bytes": str(cfg.max_message_bytes),
        **cfg.prompts_topic_configs,
    }
    dedup_configs = {**prompts_configs, "max.message.bytes": str(dedup_max_bytes(cfg))}
    dlq_configs = {"retention.ms": str(cfg.dlq_retention_ms)}
    # The ingest stage writes traces up to kafka.max_message_bytes (and cuts dead letters).
    traces_configs = {"max.message.bytes": str(cfg.max_message_bytes)}
    return [
        TopicSpec(cfg.traces_topic, cfg.partitions, traces_configs),
        TopicSpec(cfg.prompts_topic, cfg.partitions, prompts_configs),
        # Versions, labels and label moves (kafka/history.py): compacted like the prompts.
        TopicSpec(cfg.history_topic, cfg.partitions, prompts_configs),
        # Each key's dedup horizon (schemas.DedupHorizon), one record per key: compacted too.
        TopicSpec(cfg.dedup_topic_name, cfg.partitions, dedup_configs),
        TopicSpec(cfg.dlq_topic, cfg.partitions, dlq_configs),
    ]


def dedup_max_bytes(cfg: KafkaConfig) -> int:
    """The dedup topic's max.message.bytes: room for the largest horizon the config allows."""
    return max(cfg.max_message_bytes, DEDUP_RECORD_BYTES)


def engine_topics(cfg: KafkaConfig) -> list[str]:
    """Every topic the engine reads or writes."""
    return [s.name for s in topic_specs(cfg)]


class TopicLostError(EngineHalted):
    """A topic of the engine's was deleted while it ran (its state, for the prompts, history
    and dedup topics): it stopped instead of retrying against a topic that is gone."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


def state_recovery(cfg: KafkaConfig) -> str:
    """What to do once the engine's state (the prompts topic) is lost."""
    return (
        "Recover by restoring the topic from a backup (a mirror, or `combee-stream prompts "
        "set KEY FILE` per key), or start over on purpose: reset the group's offsets to the "
        f"earliest (kafka-consumer-groups --group {cfg.group_id} --reset-offsets --to-earliest "
        "--all-topics --execute) or choose a new kafka.group_id, then run again."
    )


def lost_topic_error(cfg: KafkaConfig, topic: str) -> TopicLostError:
    """The one line for ``topic`` gone under a running engine: what it held, what to do."""
    if topic == cfg.prompts_topic:
        what = (
            "the engine's state (every key's newest version) is lost; nothing was published "
            f"elsewhere. {state_recovery(cfg)}"
        )
    elif topic == cfg.history_topic:
        what = (
            "the versions' history and the labels (production pins, approval) are lost; "
            "recreate it with `combee-stream topics create` (labels start over: pin production "
            "again with `combee-stream prompts promote`), then run again."
        )
    elif topic == cfg.dedup_topic_name:
        what = (
            "the keys' dedup horizons are lost (a re-send of a trace learned before a key's "
            "newest version would be learned again); recreate it with `combee-stream topics "
            "create`, then run again."
        )
    elif topic == cfg.traces_topic:
        what = (
            "its input is gone (with the traces not yet learned); recreate it with "
            "`combee-stream topics create`, then run again."
        )
    else:
        what = (
            "dead letters cannot be written (and the parked ones are gone); recreate it with "
            "`combee-stream topics create`, then run again."
        )
    return TopicLostError(topic, f"topic {topic!r} was deleted while the engine ran: {what}")


async def absent_topics(client: Any, names: Sequence[str]) -> list[str]:
    """Which of ``names`` the cluster's fresh metadata does not list (one metadata request for
    every topic: it never auto-creates one, as a request naming the topics could). Raises
    KafkaError when no broker answers: an outage, not a missing topic."""
    cluster = await client.fetch_all_metadata()
    present = cluster.topics()
    return [name for name in names if name not in present]


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for topic in await admin.describe_topics(names):
        if topic["error_code"] == 0:
            counts[topic["topic"]] = len(topic["partitions"])
    return counts


async def _wait_visible(
    admin: AIOKafkaAdminClient, names: list[str], limit_s: float = 30.0
) -> dict[str, int]:
    """Partition counts once every topic is in the metadata (new topics take a moment)."""
    with anyio.move_on_after(limit_s):
        while True:
            counts = await _partition_counts(admin, names)
            if len(counts) == len(names):
                return counts
            await anyio.sleep(0.1)
    missing = sorted(set(names) - set(counts))
    raise UserError(f"topics {missing} did not appear in the cluster metadata within {limit_s} s")


async def topic_config(admin: AIOKafkaAdminClient, name: str, key: str) -> str | None:
    """One config value of a topic as the broker has it (its default when not set)."""
    return await _config_value(admin, ConfigResource(ConfigResourceType.TOPIC, name, {key: None}))


async def broker_config(admin: AIOKafkaAdminClient, key: str) -> str | None:
    """One config value of a broker of the cluster (None when it cannot be read: an ACL)."""
    try:
        cluster = await admin.describe_cluster()
        broker = str(cluster["brokers"][0]["node_id"])
        resource = ConfigResource(ConfigResourceType.BROKER, broker, {key: None})
        return await _config_value(admin, resource)
    except (KafkaError, IndexError, KeyError):
        return None


async def _config_value(admin: AIOKafkaAdminClient, resource: ConfigResource) -> str | None:
    [response] = await admin.describe_configs([resource])
    [key] = resource.configs
    for found in response.to_object()["resources"]:
        for entry in found["config_entries"]:
            if entry["config_names"] == key:
                value = entry["config_value"]
                return None if value is None else str(value)
    return None


# Reading the group's progress before a prompts topic is created: about 15 s of retries.
_CHECK_RETRY: Final = RetryPolicy(base_s=0.5, max_s=5.0)
_CHECK_ATTEMPTS: Final = 6


class StateLostError(UserError):
    """The prompts topic is gone while the consumer group has progress on the traces topic
    (at start; under a running engine it is :class:`TopicLostError`)."""


async def _refuse_lost_state(admin: AIOKafkaAdminClient, cfg: KafkaConfig) -> None:
    """A missing prompts topic next to committed progress on the traces topic means the
    engine's state was lost (the topic was deleted): recreating it empty would restart every
    key at version 1, with no warning, and skip the traces already committed. Fails closed:
    when the group's progress cannot be read (retried with the one retry policy), nothing is
    created."""
    rng = random.Random()
    for attempt in range(1, _CHECK_ATTEMPTS + 1):
        try:
            offsets = await admin.list_consumer_group_offsets(cfg.group_id)
            break
        except KafkaError as exc:  # no coordinator yet, an ACL, the broker going away
            if attempt == _CHECK_ATTEMPTS:
                raise StateLostError(
                    f"the prompts topic {cfg.prompts_topic!r} does not exist and the progress "
                    f"of consumer group {cfg.group_id!r} on {cfg.traces_topic!r} could not be "
                    f"read ({exc!r}, {attempt} attempts): refusing to create the topic, since "
                    "its state may have been lost. Check the broker and the group's Describe "
                    "ACL, then run again"
                ) from exc
            await anyio.sleep(_CHECK_RETRY.delay(attempt, rng))
    committed = sorted(
        tp.partition
        for tp, at in offsets.items()
        if tp.topic == cfg.traces_topic and at is not None and at.offset >= 0
    )
    if committed:
        raise StateLostError(
            f"the prompts topic {cfg.prompts_topic!r} does not exist, but consumer group "
            f"{cfg.group_id!r} has committed offsets on {cfg.traces_topic!r} (partitions "
            f"{committed}): the engine's state was lost. Refusing to start every key again "
            f"from nothing. {state_recovery(cfg)}"
        )


async def ensure_topics(cfg: KafkaConfig, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Create missing topics, verify existing ones. Returns {topic: "created" | "exists"}.

    Idempotent. Raises TopicMismatchError when existing topics break co-partitioning, the
    prompts, history or dedup topic is not compacted, or the prompts, history or traces topic
    takes less than ``kafka.max_message_bytes`` (the dedup topic: :func:`dedup_max_bytes`);
    and StateLostError instead of recreating a lost prompts topic under a consumer group that
    has (or may have) made progress. Warns when the DLQ's retention differs from
    ``kafka.dlq_retention_ms``, the broker auto-creates topics, or the dedup topic is created
    next to an existing prompts topic (an upgrade, or it was deleted).
    """
    specs = topic_specs(cfg)
    admin = AIOKafkaAdminClient(**client_kwargs(cfg, env))
    await start_client(admin, cfg)
    try:
        existing = await _partition_counts(admin, [s.name for s in specs])
        missing = [s for s in specs if s.name not in existing]
        if cfg.prompts_topic not in existing and cfg.traces_topic in existing:
            await _refuse_lost_state(admin, cfg)
        result = {s.name: "exists" for s in specs if s.name in existing}
        if cfg.dedup_topic_name not in existing and cfg.prompts_topic in existing:
            # An upgrade from a build without it, or the topic was deleted: each key's horizon
            # starts again from its newest version's ids.
            log.warning(
                "creating the dedup topic next to an existing prompts topic: until a key "
                "publishes its next versions, a re-send of a trace learned before its newest "
                "version is not recognised",
                topic=cfg.dedup_topic_name,
            )
        result.update(await _create(admin, missing, cfg.replication_factor))
        counts = await _wait_visible(admin, [s.name for s in specs])
        traces, prompts = counts.get(cfg.traces_topic), counts.get(cfg.prompts_topic)
        if traces != prompts:
            raise TopicMismatchError(
                f"traces topic {cfg.traces_topic!r} has {traces} partitions but prompts topic "
                f"{cfg.prompts_topic!r} has {prompts}: they must be co-partitioned (same count) "
                "so a key's traces and prompt versions share a partition"
            )
        for name, role in ((cfg.history_topic, "history"), (cfg.dedup_topic_name, "dedup")):
            count = counts.get(name)
            if count != traces:
                raise TopicMismatchError(
                    f"{role} topic {name!r} has {count} partitions but the traces topic has "
                    f"{traces}: a key's {role} records are written to its own partition number"
                )
        if traces != cfg.partitions:
            raise TopicMismatchError(
                f"existing topics have {traces} partitions but kafka.partitions = "
                f"{cfg.partitions}: set kafka.partitions = {traces} (partitions cannot shrink, "
                "and growing them moves keys between partitions)"
            )
        compacted = (
            (cfg.prompts_topic, "prompts"),
            (cfg.history_topic, "history"),
            (cfg.dedup_topic_name, "dedup"),
        )
        for name, role in compacted:
            policy = await topic_config(admin, name, "cleanup.policy") or "delete"
            if policy != "compact":
                # compact,delete would drop a key's newest version (or its history) after
                # retention.ms: the engine would then restart the key from nothing.
                raise TopicMismatchError(
                    f"{role} topic {name!r} has cleanup.policy={policy}; it must be compact, "
                    "and only compact (it holds prompt versions of every key, forever)"
                )
        # A version goes to the prompts and the history topic (the same update in one
        # transaction), and the ingest stage writes traces up to the same bound.
        for name, role in (*compacted, (cfg.traces_topic, "traces")):
            limit = await topic_config(admin, name, "max.message.bytes")
            if role == "dedup":
                if limit is not None and int(limit) < dedup_max_bytes(cfg):
                    raise TopicMismatchError(
                        f"dedup topic {name!r} takes records of at most {limit} bytes, but a "
                        f"key's dedup record may take {dedup_max_bytes(cfg)}: raise the "
                        "topic's max.message.bytes to that"
                    )
            elif limit is not None and int(limit) < cfg.max_message_bytes:
                raise TopicMismatchError(
                    f"{role} topic {name!r} takes records of at most {limit} bytes but "
                    f"kafka.max_message_bytes = {cfg.max_message_bytes}: lower the setting, or "
                    "raise the topic's max.message.bytes"
                )
        retention = await topic_config(admin, cfg.dlq_topic, "retention.ms")
        if retention is not None and int(retention) != cfg.dlq_retention_ms:
            # Not fatal (an operator may keep dead letters longer on purpose), but a shorter
            # retention deletes parked traces before anyone replays them.
            log.warning(
                "the DLQ topic's retention differs from kafka.dlq_retention_ms (not changed)",
                topic=cfg.dlq_topic,
                retention_ms=int(retention),
                configured_ms=cfg.dlq_retention_ms,
            )
        if await broker_config(admin, "auto.create.topics.enable") == "true":
            log.warning(
                "the broker has auto.create.topics.enable=true: a deleted prompts topic can be "
                "recreated empty by any client's metadata request, behind the engine's check of "
                "lost state; set it to false (the project's broker and compose file do)"
            )
        return result
    finally:
        await admin.close()


def ingest_topic_specs(cfg: KafkaConfig, ingest: IngestConfig) -> list[TopicSpec]:
    """The ingest stage's input topics (the Collector writes spans and logs; agents write
    feedback) and its state topic: compacted, one partition (it holds a record per trace
    being written, read whole at every start)."""
    inputs = [ingest.spans_topic, ingest.logs_topic, cfg.feedback_topic]
    return [
        *(TopicSpec(name, cfg.partitions, {}) for name in inputs),
        TopicSpec(ingest.state_topic, 1, {"cleanup.policy": "compact"}),
    ]


async def ensure_ingest_topics(
    cfg: KafkaConfig, ingest: IngestConfig, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The engine's topics (:func:`ensure_topics`) and the ingest stage's, created if missing."""
    result = await ensure_topics(cfg, env)
    specs = ingest_topic_specs(cfg, ingest)
    admin = AIOKafkaAdminClient(**client_kwargs(cfg, env))
    await start_client(admin, cfg)
    try:
        existing = await _partition_counts(admin, [s.name for s in specs])
        result.update({s.name: "exists" for s in specs if s.name in existing})
        missing = [s for s in specs if s.name not in existing]
        result.update(await _create(admin, missing, cfg.replication_factor))
        await _wait_visible(admin, [s.name for s in specs])
    finally:
        await admin.close()
    return result


async def _create(
    admin: AIOKafkaAdminClient, specs: list[TopicSpec], replication: int
) -> dict[str, str]:
    if not specs:
        return {}
    response = await admin.create_topics(
        [NewTopic(s.name, s.partitions, replication, topic_configs=s.configs) for s in specs]
    )
    result: dict[str, str] = {}
    for name, code, message in _topic_errors(response):
        if code == TopicAlreadyExistsError.errno:  # lost a race with another creator
            result[name] = "exists"
        elif code != 0:
            raise UserError(f"could not create topic {name}: error {code} {message}")
        else:
            result[name] = "created"
            log.info("topic created", topic=name)
    return result


def _topic_errors(response: object) -> list[tuple[str, int, str]]:
    obj = response.to_object()  # type: ignore[attr-defined]
    return [
        (t["topic"], t["error_code"], t.get("error_message") or "") for t in obj["topic_errors"]
    ]


__all__ = [
    "StateLostError",
    "TopicLostError",
    "TopicMismatchError",
    "TopicSpec",
    "absent_topics",
    "broker_config",
    "dedup_max_bytes",
    "engine_topics",
    "ensure_ingest_topics",
    "ensure_topics",
    "ingest_topic_specs",
    "lost_topic_error",
    "run_topics",
    "state_recovery",
    "topic_config",
    "topic_specs",
]
