"""Topics, producing, the DLQ, compaction and the subscriber, against the real local broker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from combee_stream.config import Config, KafkaConfig
from combee_stream.errors import UserError
from combee_stream.kafka import dlq
from combee_stream.kafka import ingest as ing
from combee_stream.kafka.client import make_producer
from combee_stream.kafka.producer import TraceProducer, publish_update
from combee_stream.kafka.reader import read_to_end
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.kafka.topics import TopicMismatchError, ensure_topics
from combee_stream.prompts_cli import seed_prompt
from combee_stream.schemas import (
    AddOp,
    Bullet,
    BulletTag,
    Delta,
    Feedback,
    Playbook,
    PromptUpdate,
    Reflection,
    RemoveOp,
    Section,
    Source,
    Step,
    Trace,
    UpdateOp,
    UpdateStats,
    decode,
    encode,
    utcnow,
)

FAST_COMPACTION = {
    "segment.ms": "100",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "100",
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def kafka_cfg(config: Config, unique: str, **overrides: object) -> KafkaConfig:
    fields = {
        "traces_topic": f"t.traces.{unique}",
        "prompts_topic": f"t.prompts.{unique}",
        "history_topic": f"t.history.{unique}",
        "dlq_topic": f"t.dlq.{unique}",
        "group_id": f"g.{unique}",
        "partitions": 3,
        **overrides,
    }
    return msgspec.structs.replace(config.kafka, **fields)


def make_trace(key: str, n: int) -> Trace:
    return Trace(
        key=key,
        trace_id=f"{key}-{n}",
        task=f"task {n}",
        output="42",
        steps=[Step(kind="tool_call", name="calc", content="6*7"), Step("observation", "42")],
        feedback=Feedback(passed=n % 2 == 0, text=f"feedback {n}"),
        bullet_ids=["strat-00001"],
        started_at=utcnow(),
        metadata={"agent": "a1"},
    )


def make_update(key: str, version: int) -> PromptUpdate:
    playbook = Playbook(
        key=key,
        version=version,
        sections=[Section("STRATEGIES & INSIGHTS", [Bullet("strat-00001", f"v{version}", 1, 0)])],
        next_id=2,
    )
    return PromptUpdate(
        key=key,
        version=version,
        parent_version=version - 1,
        playbook=playbook,
        prompt=f"prompt v{version}",
        stats=UpdateStats(traces_learned=version, window_traces=1, trace_ids=[f"t{version}"]),
        watermark={0: version},
        created_at=utcnow(),
    )


async def consume_all(
    cfg: KafkaConfig, topic: str, expected: int, wait_s: float = 30.0
) -> list[object]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=cfg.bootstrap_servers,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
    )
    await consumer.start()
    records: list[object] = []
    try:
        with anyio.move_on_after(wait_s):
            while len(records) < expected:
                for batch in (await consumer.getmany(timeout_ms=500)).values():
                    records.extend(batch)
        # Read a little longer: more than expected is a failure we must see.
        for batch in (await consumer.getmany(timeout_ms=500)).values():
            records.extend(batch)
    finally:
        await consumer.stop()
    return records


@pytest.mark.anyio
async def test_every_schema_round_trips_through_kafka(config: Config, unique: str) -> None:
    cfg = kafka_cfg(config, unique)
    topic = f"t.roundtrip.{unique}"
    records: list[object] = [
        make_trace("k1", 1),
        Reflection(
            key="k1",
            source=Source("k1-1", 0, 7),
            key_insight="check units",
            bullet_tags=[BulletTag("strat-00001", "helpful")],
        ),
        Delta(
            key="k1",
            operations=[AddOp("OTHERS", "x"), UpdateOp("strat-00001", "y"), RemoveOp("z")],
            tags=[BulletTag("strat-00001", "harmful")],
            sources=[Source("k1-1", 0, 7)],
            base_version=3,
        ),
        make_update("k1", 2).playbook,
        make_update("k1", 2),
    ]
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    producer = make_producer(cfg)
    await producer.start()
    try:
        for record in records:
            await producer.send_and_wait(topic, value=encode(record), key=b"k1")
    finally:
        await producer.stop()
    received = await consume_all(cfg, topic, len(records))
    decoded = [
        decode(r.value, type(original))  # type: ignore[attr-defined]
        for r, original in zip(received, records, strict=True)
    ]
    assert decoded == records


BAD_RECORDS: list[tuple[bytes | None, bytes | None, str]] = [
    (b"k1", b"{not json", "malformed JSON"),
    (b"k1", b"\x00\xff\xfe garbage", "malformed JSON"),
    (b"k1", b"", "malformed JSON"),
    (b"k1", None, "tombstone"),
    (b"k1", b'{"key":"k1","trace_id":"x","task":"t"}', "missing required field `feedback`"),
    (b"k1", b'{"key":"k1","trace_id":"x","task":"t","feedback":{}}', "at least one of"),
    (
        b"k1",
        b'{"key":"k1","trace_id":"x","task":"t","feedback":{"score":"high"}}',
        "$.feedback.score",
    ),
    (
        b"k1",
        b'{"key":"k1","trace_id":"x","task":"t","feedback":{"passed":true},"bogus":1}',
        "unknown field `bogus`",
    ),
    (
        b"k1",
        b'{"key":"k1","trace_id":"x","task":"t","feedback":{"passed":true},"schema":99}',
        "unsupported schema version 99",
    ),
    (
        b"other",
        b'{"key":"k1","trace_id":"x","task":"t","feedback":{"passed":true}}',
        "does not match trace key",
    ),
]


@pytest.mark.anyio
async def test_bad_records_go_to_dlq_with_reasons_and_good_ones_flow(
    config: Config, unique: str
) -> None:
    cfg = kafka_cfg(config, unique)
    await ensure_topics(cfg)
    good = [make_trace(f"k{i % 4}", i) for i in range(50)]
    async with TraceProducer(cfg) as producer:
        bad_positions: dict[tuple[int, int], str] = {}
        for i, trace in enumerate(good):
            await producer.send(trace)
            if i % 5 == 4:  # interleave the 10 bad records with the good ones
                key, value, reason = BAD_RECORDS[i // 5]
                if value is None:  # send_raw always sends bytes; a tombstone has no value
                    position = await _send_tombstone(cfg, key)
                else:
                    position = await producer.send_raw(key.decode() if key else None, value)
                bad_positions[position] = reason

    consumer = AIOKafkaConsumer(
        cfg.traces_topic,
        bootstrap_servers=cfg.bootstrap_servers,
        group_id=cfg.group_id,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    dlq_producer = make_producer(cfg)
    await consumer.start()
    await dlq_producer.start()
    seen: list[Trace] = []
    all_good = anyio.Event()

    async def run_ingest() -> None:
        async for item in ing.ingest(consumer, dlq_producer, cfg.dlq_topic):
            assert item.source.trace_id == item.trace.trace_id
            seen.append(item.trace)
            if len(seen) == len(good):
                all_good.set()

    try:
        # Ingest keeps running while the DLQ is read: the bad records sit in several
        # partitions and may be reached after the last good one.
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_ingest)
            dead = await consume_all(cfg, cfg.dlq_topic, len(bad_positions), wait_s=60)
            with anyio.fail_after(60):
                await all_good.wait()
            tg.cancel_scope.cancel()
    finally:
        await consumer.stop()
        await dlq_producer.stop()

    assert sorted(t.trace_id for t in seen) == sorted(t.trace_id for t in good)
    assert len(dead) == len(bad_positions)
    for record in dead:
        headers = {k: v.decode() for k, v in record.headers}  # type: ignore[attr-defined]
        position = (int(headers[dlq.H_PARTITION]), int(headers[dlq.H_OFFSET]))
        assert position in bad_positions, headers
        assert bad_positions.pop(position) in headers[dlq.H_ERROR]
        assert headers[dlq.H_TOPIC] == cfg.traces_topic
        assert headers[dlq.H_STAGE] == "decode"
        assert headers[dlq.H_SCHEMA] == "1"
    assert bad_positions == {}


async def _send_tombstone(cfg: KafkaConfig, key: bytes | None) -> tuple[int, int]:
    producer = AIOKafkaProducer(bootstrap_servers=cfg.bootstrap_servers)
    await producer.start()
    try:
        meta = await producer.send_and_wait(cfg.traces_topic, value=None, key=key)
        return meta.partition, meta.offset
    finally:
        await producer.stop()


@pytest.mark.anyio
async def test_prompts_topic_is_really_compacted(config: Config, unique: str) -> None:
    cfg = kafka_cfg(config, unique, partitions=1, prompts_topic_configs=FAST_COMPACTION)
    await ensure_topics(cfg)
    producer = make_producer(cfg)
    await producer.start()
    try:
        for version in range(1, 6):
            for key in ("a", "b", "c"):
                await publish_update(producer, cfg, make_update(key, version))
        await anyio.sleep(0.5)  # > segment.ms, so the next append rolls the segment
        await publish_update(producer, cfg, make_update("roll", 1))
    finally:
        await producer.stop()

    deadline = time.monotonic() + 60
    while True:
        records = await read_to_end(cfg, cfg.prompts_topic)
        keys = Counter(r.key.decode() for r in records)  # type: ignore[attr-defined]
        if all(keys[k] == 1 for k in ("a", "b", "c")):
            break
        assert time.monotonic() < deadline, f"not compacted after 60 s: {keys}"
        await anyio.sleep(1)
    versions = {
        r.key.decode(): decode(r.value, PromptUpdate).version  # type: ignore[attr-defined]
        for r in records
    }
    assert versions == {"a": 5, "b": 5, "c": 5, "roll": 1}


@pytest.mark.anyio
async def test_subscriber_catches_up_follows_and_ignores_stale(config: Config, unique: str) -> None:
    cfg = kafka_cfg(config, unique)
    await ensure_topics(cfg)
    producer = make_producer(cfg)
    await producer.start()
    try:
        for version in (1, 2, 3):
            await publish_update(producer, cfg, make_update("a", version))
        await publish_update(producer, cfg, make_update("b", 1))
        async with PromptSubscriber(cfg) as prompts:
            assert {k: u.version for k, u in prompts.snapshot().items()} == {"a": 3, "b": 1}
            await publish_update(producer, cfg, make_update("a", 2))  # stale
            await publish_update(producer, cfg, make_update("a", 4))
            await publish_update(producer, cfg, make_update("b", 2))
            live: list[tuple[str, int]] = []
            with anyio.fail_after(30):
                async for update in prompts:
                    live.append((update.key, update.version))
                    if len(live) == 2:
                        break
            assert sorted(live) == [("a", 4), ("b", 2)]
            assert prompts.latest("a").version == 4  # type: ignore[union-attr]
            assert prompts.ignored_stale == 1
        async with PromptSubscriber(cfg, keys={"b"}) as only_b:
            assert set(only_b.snapshot()) == {"b"}
    finally:
        await producer.stop()


@pytest.mark.anyio
async def test_topic_creation_is_idempotent_and_mismatch_is_reported(
    config: Config, unique: str
) -> None:
    cfg = kafka_cfg(config, unique)
    first = await ensure_topics(cfg)
    assert set(first.values()) == {"created"}
    second = await ensure_topics(cfg)
    assert set(second.values()) == {"exists"}

    with pytest.raises(TopicMismatchError, match=r"kafka\.partitions = 3"):
        await ensure_topics(msgspec.structs.replace(cfg, partitions=5))

    other = kafka_cfg(config, unique + "m")
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(other.traces_topic, 2, 1)])
    finally:
        await admin.close()
    with pytest.raises(TopicMismatchError, match="co-partitioned"):
        await ensure_topics(other)

    delete_policy = kafka_cfg(config, unique + "d")
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(delete_policy.prompts_topic, 3, 1)])
    finally:
        await admin.close()
    with pytest.raises(TopicMismatchError, match="must be compact"):
        await ensure_topics(delete_policy)


@pytest.mark.anyio
async def test_seed_prompt_reaches_a_subscriber(config: Config, unique: str) -> None:
    cfg = msgspec.structs.replace(config, kafka=kafka_cfg(config, unique))
    await ensure_topics(cfg.kafka)
    seeded = await seed_prompt(cfg, "support-bot", "You are a helpful support agent.")
    assert (seeded.version, seeded.parent_version) == (0, -1)
    async with PromptSubscriber(cfg.kafka, keys={"support-bot"}) as prompts:
        latest = prompts.latest("support-bot")
    assert latest is not None
    assert latest.prompt == "You are a helpful support agent."
    assert latest.playbook.base_prompt == latest.prompt
    with pytest.raises(UserError, match="already has version 0"):
        await seed_prompt(cfg, "support-bot", "again")
    with pytest.raises(UserError, match="invalid key"):
        await seed_prompt(cfg, "bad key with spaces", "x")


def run_cli(
    *args: str, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "combee_stream", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cli_produce_validates_and_subscribe_once(
    config: Config, unique: str, tmp_path: Path
) -> None:
    cfg = kafka_cfg(config, unique)
    env = {
        "COMBEE__KAFKA__BOOTSTRAP_SERVERS": cfg.bootstrap_servers,
        "COMBEE__KAFKA__TRACES_TOPIC": cfg.traces_topic,
        "COMBEE__KAFKA__PROMPTS_TOPIC": cfg.prompts_topic,
        "COMBEE__KAFKA__HISTORY_TOPIC": cfg.history_topic,
        "COMBEE__KAFKA__DLQ_TOPIC": cfg.dlq_topic,
    }
    created = run_cli("topics", "create", env_extra=env)
    assert created.returncode == 0, created.stderr
    assert created.stdout.count(": created") == 5  # the dedup topic too

    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(encode(make_trace("k1", i)).decode() for i in range(3)) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(encode(make_trace("k1", 9)).decode() + '\n{"key": 1}\n')
    refused = run_cli("produce", str(bad), env_extra=env)
    assert refused.returncode == 2
    assert f"{bad}:2:" in refused.stderr and "$.key" in refused.stderr
    sent = run_cli("produce", str(good), env_extra=env)
    assert sent.returncode == 0, sent.stderr
    raw = run_cli("produce", "--raw", str(bad), env_extra=env)
    assert raw.returncode == 0, raw.stderr

    seed = tmp_path / "prompt.txt"
    seed.write_text("Be precise.")
    assert run_cli("prompts", "set", "k1", str(seed), env_extra=env).returncode == 0
    once = run_cli("subscribe", "--once", env_extra=env)
    assert once.returncode == 0, once.stderr
    lines = [json.loads(line) for line in once.stdout.splitlines()]
    assert [(u["key"], u["version"], u["prompt"]) for u in lines] == [("k1", 0, "Be precise.")]

    # One default label for every reader: production, pinned here below the newest version.
    seed.write_text("Be precise and brief.")
    assert run_cli("prompts", "set", "k1", str(seed), "--force", env_extra=env).returncode == 0
    pinned = run_cli("prompts", "promote", "k1", "--version", "0", env_extra=env)
    assert pinned.returncode == 0, pinned.stderr
    served = run_cli("subscribe", "--once", env_extra=env)
    newest = run_cli("subscribe", "--once", "--label", "latest", env_extra=env)
    assert [json.loads(line)["version"] for line in served.stdout.splitlines()] == [0]
    assert [json.loads(line)["version"] for line in newest.stdout.splitlines()] == [1]


def test_schema_command_prints_json_schema() -> None:
    out = run_cli("schema", "trace")
    assert out.returncode == 0
    schema = json.loads(out.stdout)
    trace = schema["$defs"]["Trace"]
    assert set(trace["required"]) == {"key", "trace_id", "task", "feedback"}
