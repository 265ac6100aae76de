"""The ingest stage on the real broker: OpenTelemetry spans of real instrumented agent runs
(the OpenTelemetry SDK and ``opentelemetry-instrumentation-openai-v2`` around the ``openai``
client, against the simulator) encoded as the Collector's Kafka exporter writes them, split
across messages and partitions and shuffled; feedback that comes later; bad input; SIGKILL.

Every claim is checked on the topics: the traces topic (read committed) holds each trace once,
with the right key, task, steps and output; the DLQ holds what could not be a trace, with why.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx2
import msgspec
import otel_agent
import otel_support
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from engine_support import REPO, engine_config, env_for, kill, wait_until_learned
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from otel_agent import AgentRun, encode, per_trace_slices, run_agent
from otel_support import run_collector
from prometheus_client.parser import text_string_to_metric_families

from combee_stream import Engine
from combee_stream.config import Config
from combee_stream.formats.genai import trace_from_spans
from combee_stream.formats.otlp import decode_telemetry
from combee_stream.http import free_port
from combee_stream.ingest import IngestStage
from combee_stream.ingest.assembler import NO_FEEDBACK
from combee_stream.kafka.client import make_producer
from combee_stream.kafka.dlq import H_ERROR, H_OFFSET, H_PARTITION, H_STAGE, H_TOPIC
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.reader import read_to_end, reading_consumer
from combee_stream.schemas import Feedback, FeedbackRecord, Trace, decode
from combee_stream.sim import SimSettings, sim_server
from combee_stream.sim.tasks import sim_tasks

pytestmark = pytest.mark.kafka
SEED = 3


def ingest_config(cfg: Config, unique: str, **ingest: Any) -> Config:
    settings = msgspec.structs.replace(
        cfg.ingest,
        spans_topic=f"i.spans.{unique}",
        logs_topic=f"i.logs.{unique}",
        state_topic=f"i.state.{unique}",
        group_id=f"i.group.{unique}",
        **{"gap_s": 0.5, "trace_timeout_s": 8.0, "metrics_port": 0, **ingest},
    )
    kafka = msgspec.structs.replace(cfg.kafka, feedback_topic=f"i.feedback.{unique}")
    return msgspec.structs.replace(cfg, ingest=settings, kafka=kafka)


async def agent_runs(base_url: str, n: int, keys: Sequence[str]) -> list[AgentRun]:
    tasks = sim_tasks(n, keys=1, lessons=n, seed=SEED)
    return [
        await run_agent(base_url, task.question, key=keys[i % len(keys)], version=0)
        for i, task in enumerate(tasks)
    ]


def shuffled_records(
    runs: Sequence[AgentRun], encoding: str, partitions: int, rng: random.Random
) -> list[tuple[bytes | None, bytes, int]]:
    """(key, value, partition) records in three shapes the exporter writes or that batching
    produces: whole batches of several traces (unkeyed), one slice per trace keyed by its id,
    and one span per message on any partition; then shuffled."""
    records: list[tuple[bytes | None, bytes, int]] = []
    thirds = [runs[0::3], runs[1::3], runs[2::3]]
    batch = [span for run in thirds[0] for span in run.spans]
    records.append((None, encode(batch, encoding), rng.randrange(partitions)))  # type: ignore[arg-type]
    for run in thirds[1]:
        for key, value in per_trace_slices(run.spans, encoding):  # type: ignore[arg-type]
            records.append((key, value, rng.randrange(partitions)))
    for run in thirds[2]:
        for span in run.spans:
            records.append((None, encode([span], encoding), rng.randrange(partitions)))  # type: ignore[arg-type]
    rng.shuffle(records)
    return records


async def send_records(cfg: Config, topic: str, records: Sequence[tuple[Any, bytes, int]]) -> None:
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for key, value, partition in records:
            await producer.send_and_wait(topic, value=value, key=key, partition=partition)
    finally:
        await producer.stop()


async def written_traces(cfg: Config) -> list[Trace]:
    return [decode(r.value, Trace) for r in await read_to_end(cfg.kafka, cfg.kafka.traces_topic)]


async def wait_for_traces(cfg: Config, n: int, limit_s: float = 120.0) -> list[Trace]:
    with anyio.fail_after(limit_s):
        while True:
            traces = await written_traces(cfg)
            if len(traces) >= n:
                return traces
            await anyio.sleep(0.5)


async def dead_letters(cfg: Config) -> list[Any]:
    return [
        r
        for r in await read_to_end(cfg.kafka, cfg.kafka.dlq_topic)
        if dict(r.headers).get(H_STAGE) == b"ingest"
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["otlp_proto", "otlp_json"])
async def test_agent_spans_become_traces_once_and_the_engine_learns_from_their_feedback(
    config: Config, unique: str, encoding: str
) -> None:
    keys = ["calc-a", "calc-b"]
    async with sim_server(SimSettings(seed=SEED)) as sim:
        cfg = engine_config(config, unique, sim.base_url, batch_size=3, max_wait_s=0.5)
        cfg = ingest_config(cfg, unique, encoding=encoding, feedback_wait_s=3.0)
        runs = await agent_runs(sim.base_url, 9, keys)
        tasks = {t.question: t for t in sim_tasks(9, keys=1, lessons=9, seed=SEED)}
        records = shuffled_records(runs, encoding, cfg.kafka.partitions, random.Random(7))
        stage, engine = IngestStage(cfg), Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run)
            tg.start_soon(engine.run)
            await stage.started.wait()
            await send_records(cfg, cfg.ingest.spans_topic, records)
            # The environment's verdict comes after the run, keyed by trace id.
            async with TraceProducer(cfg.kafka) as producer:
                for i, run in enumerate(runs):
                    task = tasks[run.task]
                    feedback = Feedback(
                        passed=False,
                        ground_truth=task.answer,
                        text=task.metadata["feedback"],
                    )
                    await producer.send_feedback(
                        FeedbackRecord(key=keys[i % 2], trace_id=run.trace_id, feedback=feedback)
                    )
            traces = await wait_for_traces(cfg, len(runs))
            updates = await wait_until_learned(cfg, {"calc-a": 5, "calc-b": 4}, 120)
            stage.stop()
            engine.stop()
    written = Counter(t.trace_id for t in traces)
    assert written == Counter(run.trace_id for run in runs), "every trace once, none other"
    by_id = {t.trace_id: t for t in traces}
    for i, run in enumerate(runs):
        trace = by_id[run.trace_id]
        assert trace.key == keys[i % 2]
        assert trace.task == run.task and trace.output == run.output
        kinds = [s.kind for s in trace.steps]
        assert "tool_call" in kinds and "observation" in kinds, kinds
        assert kinds.index("tool_call") < kinds.index("observation")
        assert trace.feedback.passed is False and trace.feedback.ground_truth
    learned = {tid for u in updates for tid in u.stats.trace_ids}
    assert learned == set(written), "the engine learned every assembled trace"
    lessons = {b.content for u in updates for s in u.playbook.sections for b in s.bullets}
    assert lessons, "the lessons in the late feedback reached the playbooks"
    assert await dead_letters(cfg) == []


@pytest.mark.anyio
async def test_bad_input_is_dead_lettered_with_its_reason_and_good_traces_pass(
    config: Config, unique: str
) -> None:
    async with sim_server(SimSettings(seed=SEED)) as sim:
        cfg = engine_config(config, unique, sim.base_url)
        cfg = ingest_config(cfg, unique, max_spans_per_trace=4, trace_timeout_s=3.0)
        [good, flood] = await agent_runs(sim.base_url, 2, ["calc-a"])
        whole = encode(good.spans, "otlp_proto")
        json_value = encode(good.spans, "otlp_json")
        bad = [
            (None, whole[: len(whole) // 2], 0),  # truncated protobuf
            (None, json_value, 1),  # the wrong encoding
            (None, os.urandom(300), 2),
        ]
        # A flood: the same trace's spans again and again under new span ids.
        many = [s for _ in range(3) for s in flood.spans]
        flooded = [(None, encode([span], "otlp_proto"), 0) for span in _respanned(many)]
        stage = IngestStage(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run)
            await stage.started.wait()
            await send_records(cfg, cfg.ingest.spans_topic, [*bad, *flooded, (None, whole, 1)])
            orphan = FeedbackRecord(key="calc-a", trace_id="f" * 32, feedback=Feedback(passed=True))
            async with TraceProducer(cfg.kafka) as producer:
                await producer.send_feedback(orphan)
            with anyio.fail_after(60):
                while True:
                    letters = await dead_letters(cfg)
                    if any(r.key == orphan.trace_id.encode() for r in letters):
                        break
                    await anyio.sleep(0.5)
            traces = await wait_for_traces(cfg, 1)
            stage.stop()
    assert [t.trace_id for t in traces] == [good.trace_id]
    reasons = [dict(r.headers)[H_ERROR].decode() for r in letters]
    assert sum("OTLP" in r or "protobuf" in r.lower() for r in reasons) == 3, reasons
    assert any(r.startswith("span_flood") for r in reasons), reasons
    assert any(r.startswith("orphan_feedback") and "f" * 32 in r for r in reasons), reasons
    decoded = [r for r in letters if r.value in (whole[: len(whole) // 2], json_value)]
    assert len(decoded) == 2, "undecodable records are kept byte for byte"


def letter_sources(letters: Sequence[Any]) -> Counter[tuple[str, int, int]]:
    """How many dead letters name each source record (topic, partition, offset)."""
    out: Counter[tuple[str, int, int]] = Counter()
    for r in letters:
        h = dict(r.headers)
        out[(h[H_TOPIC].decode(), int(h[H_PARTITION]), int(h[H_OFFSET]))] += 1
    return out


async def wait_for_letters(cfg: Config, n: int, limit_s: float = 60.0) -> list[Any]:
    with anyio.fail_after(limit_s):
        while len(letters := await dead_letters(cfg)) < n:  # noqa: ASYNC110
            await anyio.sleep(0.3)
    return letters


@pytest.mark.anyio
async def test_dead_lettered_input_is_committed_and_never_dead_lettered_again(
    config: Config, unique: str
) -> None:
    """Partitions holding nothing but bad records (truncated protobuf, random bytes, a
    tombstone, an oversized record, feedback that is not JSON): each is dead-lettered once and
    its offset committed with it, so a restarted stage reads none of them again."""
    cfg = ingest_config(engine_config(config, unique, "http://127.0.0.1:9"), unique)
    # The stage reads with a 64 KiB limit; the broker (and the sender) take 1 MiB.
    small = msgspec.structs.replace(cfg.kafka, max_message_bytes=65_536)
    stage_cfg = msgspec.structs.replace(cfg, kafka=small)
    spans, feedback = cfg.ingest.spans_topic, cfg.kafka.feedback_topic
    whole = otel_agent.encode_proto(otel_agent.openinference_run("What is 6 * 7?").spans)
    bad: list[tuple[str, Any, bytes | None, int]] = [
        (spans, None, whole[: len(whole) // 2], 0),
        (spans, b"tomb", None, 0),
        (spans, None, os.urandom(300), 1),
        (spans, None, b"\n" + os.urandom(100_000), 1),  # over the stage's 64 KiB
        (feedback, None, b"not json", 0),
    ]

    async def send(records: Sequence[tuple[str, Any, bytes | None, int]]) -> None:
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            for topic, key, value, partition in records:
                await producer.send_and_wait(topic, value=value, key=key, partition=partition)
        finally:
            await producer.stop()

    stage = IngestStage(stage_cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send(bad)
        first = await wait_for_letters(cfg, len(bad))
        await wait_fully_committed(cfg, 60, spans, feedback)
        stage.stop()
    # A restart, then one more bad record behind the old ones on each partition: once its
    # letter is there, the restarted stage has read past the old ones.
    more = [
        (spans, None, b"\xff" * 20, 0),
        (spans, None, b"\xfe" * 20, 1),
        (feedback, None, b"{", 0),
    ]
    stage = IngestStage(stage_cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send(more)
        letters = await wait_for_letters(cfg, len(bad) + len(more))
        await wait_fully_committed(cfg, 60, spans, feedback)
        stage.stop()
    assert len(first) == len(bad)
    sources = letter_sources(letters)
    assert len(sources) == len(bad) + len(more) and set(sources.values()) == {1}, sources
    reasons = [dict(r.headers)[H_ERROR].decode() for r in letters]
    assert any(r.startswith("oversized") and "65536" in r for r in reasons), reasons
    assert any("tombstone" in r for r in reasons), reasons


async def export_spans(http_endpoint: str, runs: Sequence[AgentRun]) -> None:
    """Each run's spans to a Collector over OTLP/HTTP, as an agent's exporter sends them."""
    exporter = OTLPSpanExporter(endpoint=f"{http_endpoint}/v1/traces")
    for run in runs:
        result = await anyio.to_thread.run_sync(exporter.export, run.spans)
        assert result == SpanExportResult.SUCCESS
    exporter.shutdown()


def letter_kinds(letters: Sequence[Any], trace_id: str) -> list[str]:
    """The rejection kinds of the dead letters that name ``trace_id``, in the order they were
    written: one trace's letters may be keyed apart (by its trace id before its prompt key is
    known, by the key after), so they can sit on different DLQ partitions."""
    ordered = sorted(letters, key=lambda r: r.timestamp)
    reasons = [dict(r.headers)[H_ERROR].decode() for r in ordered]
    return [r.split(":", 1)[0] for r in reasons if trace_id in r]


@pytest.mark.anyio
async def test_a_rejection_survives_a_restart_its_input_read_again_and_its_late_root(
    config: Config, unique: str
) -> None:
    """Trace X has no root span and is dead-lettered (no_root) while the message holding its
    spans is still held by trace Y (complete, waiting for its feedback). After a restart that
    message is read again: X is not dead-lettered twice, and its root, arriving now, is late
    (never written as a trace of one span)."""
    cfg = ingest_config(
        engine_config(config, unique, "http://127.0.0.1:9"),
        unique,
        trace_timeout_s=2.0,
        feedback_wait_s=120.0,
    )
    x, y = otel_agent.openinference_run("What is 6 * 7?"), otel_agent.openinference_run("2 + 2?")
    held = [s for s in x.spans if s is not x.root] + y.spans
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send_records(cfg, cfg.ingest.spans_topic, [(None, encode(held, "otlp_proto"), 0)])
        with anyio.fail_after(60):
            while not letter_kinds(await dead_letters(cfg), x.trace_id):  # noqa: ASYNC110
                await anyio.sleep(0.3)
        stage.stop()
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send_records(cfg, cfg.ingest.spans_topic, [(None, encode([x.root], "otlp_proto"), 1)])
        async with TraceProducer(cfg.kafka) as producer:
            verdict = Feedback(passed=True, text="right")
            await producer.send_feedback(
                FeedbackRecord(key="oi-agent", trace_id=y.trace_id, feedback=verdict)
            )
        traces = await wait_for_traces(cfg, 1)
        with anyio.fail_after(60):
            while "late_span" not in letter_kinds(await dead_letters(cfg), x.trace_id):  # noqa: ASYNC110
                await anyio.sleep(0.3)
        await wait_fully_committed(cfg, 60)
        stage.stop()
    assert [(t.trace_id, t.feedback.passed) for t in traces] == [(y.trace_id, True)]
    assert letter_kinds(await dead_letters(cfg), x.trace_id) == ["no_root", "late_span"]


def sample(stage: IngestStage, name: str, **labels: str) -> float:
    return stage.metrics.registry.get_sample_value(name, labels or None) or 0.0


@pytest.mark.anyio
async def test_paused_at_max_open_traces_feedback_still_joins_and_every_trace_is_written_once(
    config: Config, unique: str
) -> None:
    """A cap of 2 open traces and 8 in flight, each waiting for its feedback (sent after all
    the spans): the stage pauses the spans topic only, so the feedback still comes and every
    trace is written once with it; feedback read before its spans does not count toward the
    cap (it would hold the spans back until it timed out)."""
    cfg = ingest_config(
        engine_config(config, unique, "http://127.0.0.1:9"),
        unique,
        max_open_traces=2,
        feedback_wait_s=120.0,
    )
    runs = [otel_agent.openinference_run(f"What is {n} + {n}?") for n in range(8)]
    stage = IngestStage(cfg)

    def records(batch: Sequence[AgentRun]) -> list[tuple[Any, bytes, int]]:
        return [(None, encode(r.spans, "otlp_proto"), i % 3) for i, r in enumerate(batch)]

    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send_records(cfg, cfg.ingest.spans_topic, records(runs[:4]))
        with anyio.fail_after(60):
            while sample(stage, "combee_ingest_pauses_total") < 1:  # noqa: ASYNC110
                await anyio.sleep(0.2)
        await send_records(cfg, cfg.ingest.spans_topic, records(runs[4:]))
        async with TraceProducer(cfg.kafka) as producer:
            for run in runs:
                feedback = Feedback(passed=True, text=f"checked {run.task}")
                await producer.send_feedback(
                    FeedbackRecord(key="oi-agent", trace_id=run.trace_id, feedback=feedback)
                )
        traces = await wait_for_traces(cfg, len(runs))
        await wait_fully_committed(cfg, 60, cfg.ingest.spans_topic, cfg.kafka.feedback_topic)
        stage.stop()
    assert Counter(t.trace_id for t in traces) == Counter(r.trace_id for r in runs)
    by_id = {r.trace_id: r for r in runs}
    for trace in traces:
        assert trace.feedback.text == f"checked {by_id[trace.trace_id].task}", trace.feedback
    assert sample(stage, "combee_ingest_feedback_joined_total") == len(runs)
    assert await dead_letters(cfg) == []


def _respanned(spans: Sequence[Any]) -> list[Any]:
    """Copies of ``spans`` under fresh span ids (SDK ReadableSpans keep their context)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    out = []
    for i, span in enumerate(spans):
        ctx = span.get_span_context()
        fresh = SpanContext(ctx.trace_id, 0x1000 + i, False, ctx.trace_flags, ctx.trace_state)
        out.append(
            ReadableSpan(
                name=span.name,
                context=fresh,
                parent=span.parent,
                resource=span.resource,
                attributes=span.attributes,
                events=span.events,
                kind=span.kind,
                instrumentation_scope=span.instrumentation_scope,
                start_time=span.start_time,
                end_time=span.end_time,
            )
        )
    return out


async def wait_fully_committed(cfg: Config, limit_s: float, *topics: str) -> None:
    """Until the ingest group's committed offsets on ``topics`` (default: the spans topic)
    are their end offsets."""
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.kafka.bootstrap_servers)
    consumer = reading_consumer(cfg.kafka)
    await admin.start()
    await consumer.start()
    try:
        tps = [
            TopicPartition(topic, p)
            for topic in topics or [cfg.ingest.spans_topic]
            for p in range(cfg.kafka.partitions)
        ]
        with anyio.fail_after(limit_s):
            while True:
                end = await consumer.end_offsets(tps)
                committed = await admin.list_consumer_group_offsets(cfg.ingest.group_id)
                at = {tp: meta.offset for tp, meta in committed.items()}
                if all(at.get(tp, 0) == end[tp] for tp in tps):
                    return
                await anyio.sleep(0.5)
    finally:
        await consumer.stop()
        await admin.close()


def ingest_env(cfg: Config) -> dict[str, str]:
    s = cfg.ingest
    env = env_for(cfg)
    env.update(
        {
            "COMBEE__KAFKA__FEEDBACK_TOPIC": cfg.kafka.feedback_topic,
            "COMBEE__INGEST__SPANS_TOPIC": s.spans_topic,
            "COMBEE__INGEST__LOGS_TOPIC": s.logs_topic,
            "COMBEE__INGEST__STATE_TOPIC": s.state_topic,
            "COMBEE__INGEST__GROUP_ID": s.group_id,
            "COMBEE__INGEST__GAP_S": str(s.gap_s),
            "COMBEE__INGEST__TRACE_TIMEOUT_S": str(s.trace_timeout_s),
            "COMBEE__INGEST__FEEDBACK_WAIT_S": str(s.feedback_wait_s),
            "COMBEE__INGEST__METRICS_PORT": str(s.metrics_port),
        }
    )
    return env


def spawn_ingest(cfg: Config, log_path: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMBEE__")}
    env.update(ingest_env(cfg))
    env["PYTHONUNBUFFERED"] = "1"
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "combee_stream", "--log-level", "info", "ingest", "otel"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.anyio
@pytest.mark.timeout(600)
async def test_a_killed_ingest_stage_loses_and_duplicates_no_trace(
    config: Config, unique: str, tmp_path: Path
) -> None:
    """SIGKILL while traces are open and while transactions are in flight, twice; the
    restarted stage (same instance number: it fences the dead one's transaction) ends with
    every trace on the traces topic exactly once."""
    async with sim_server(SimSettings(seed=SEED)) as sim:
        cfg = engine_config(config, unique, sim.base_url)
        # A killed member's partitions come back only after its session times out (10 s) and
        # the group rebalances, and a run's spans are spread over every partition: until then
        # the new member completes no trace (it would lack the spans the dead member's
        # partitions hold: 16 late_span letters in a run before it waited), so the trace
        # timeout must outlast the session (with the 8 s of the other tests, 8 of 30 traces
        # were dead-lettered).
        session_s = cfg.kafka.session_timeout_ms / 1000
        cfg = ingest_config(cfg, unique, gap_s=1.0, trace_timeout_s=3 * session_s)
        runs = await agent_runs(sim.base_url, 30, ["calc-a", "calc-b", "calc-c"])
        rng = random.Random(11)

        def messages(spans: Sequence[Any]) -> list[tuple[None, bytes, int]]:
            """One span per message on any partition, shuffled."""
            out = [
                (None, encode([span], "otlp_proto"), rng.randrange(cfg.kafka.partitions))
                for span in spans
            ]
            rng.shuffle(out)
            return out

        # The first 3 runs' root spans are held back: their traces stay open, so the offsets
        # of the other traces written meanwhile cannot be committed, and a restart reads those
        # spans again. (A run's spans come within seconds of one another: a span arriving
        # after its trace was complete would be dead-lettered as late.)
        slow, first, second = runs[:3], runs[3:15], runs[15:]
        roots = [run.root for run in slow]
        early = [s for run in [*slow, *first] for s in run.spans if s not in roots]
        log_path = tmp_path / "ingest.log"
        proc = spawn_ingest(cfg, log_path)
        try:
            await send_records(cfg, cfg.ingest.spans_topic, messages(early))
            await wait_for_traces(cfg, len(first), 120)  # the slow ones still open
            kill(proc)
            proc = spawn_ingest(cfg, log_path)
            later = messages(roots) + messages([s for run in second for s in run.spans])
            await send_records(cfg, cfg.ingest.spans_topic, later)
            await anyio.sleep(rng.uniform(0.5, 2.0))
            kill(proc)
            proc = spawn_ingest(cfg, log_path)
            try:
                await wait_for_traces(cfg, len(runs), 180)
                # Everything read is done only once every trace was written or dead-lettered:
                # a span read again and taken for a new trace would hold its offset open.
                await wait_fully_committed(cfg, 60)
            except TimeoutError:
                got = Counter(t.trace_id for t in await written_traces(cfg))
                missing = [run.trace_id for run in runs if run.trace_id not in got]
                raise AssertionError(
                    f"{len(got)} of {len(runs)} traces written, missing {missing}; "
                    f"dead letters {len(await dead_letters(cfg))}\n" + log_path.read_text()[-6000:]
                ) from None
            traces = await written_traces(cfg)
        finally:
            kill(proc, signal.SIGTERM)
    counts = Counter(t.trace_id for t in traces)
    assert counts == Counter(run.trace_id for run in runs), log_path.read_text()[-3000:]
    reasons = [dict(r.headers)[H_ERROR].decode() for r in await dead_letters(cfg)]
    assert reasons == [], "\n".join(reasons)


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_ingest_otel_alone_serves_its_metrics_consistent_with_what_it_ingested(
    config: Config, unique: str, tmp_path: Path
) -> None:
    """`combee-stream ingest otel` as its own process serves /metrics, /healthz and /readyz on
    ingest.metrics_port: 3 traces with feedback, 1 without, 1 with no root span (expired) and
    1 orphaned feedback item are counted as such."""
    port = free_port()
    cfg = ingest_config(
        engine_config(config, unique, "http://127.0.0.1:9"),
        unique,
        trace_timeout_s=3.0,
        feedback_wait_s=2.0,
        metrics_port=port,
    )
    runs = [otel_agent.openinference_run(f"What is {n} * 3?") for n in range(5)]
    expired = runs.pop()
    log_path = tmp_path / "ingest.log"
    proc = spawn_ingest(cfg, log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx2.AsyncClient() as http:
            with anyio.fail_after(60):
                while True:  # up once the stage reads
                    try:
                        if (await http.get(f"{base}/readyz")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        pass
                    await anyio.sleep(0.2)
            assert (await http.get(f"{base}/healthz")).status_code == 200
            spans = [s for r in runs for s in r.spans]
            spans += [s for s in expired.spans if s is not expired.root]
            await send_records(
                cfg, cfg.ingest.spans_topic, [(None, encode(spans, "otlp_proto"), 0)]
            )
            async with TraceProducer(cfg.kafka) as producer:
                for run in [*runs[:3], None]:
                    trace_id = run.trace_id if run else "e" * 32
                    await producer.send_feedback(
                        FeedbackRecord(
                            key="oi-agent", trace_id=trace_id, feedback=Feedback(score=1)
                        )
                    )
            await wait_for_traces(cfg, 4)
            await wait_for_letters(cfg, 2)
            with anyio.fail_after(30):
                while True:  # the endpoint is another process: until it has counted the letters
                    families = {
                        f.name: f
                        for f in text_string_to_metric_families(
                            (await http.get(f"{base}/metrics")).text
                        )
                    }
                    values = {
                        (s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in families.values()
                        for s in f.samples
                    }
                    if (
                        sum(
                            v for (n, _), v in values.items() if n == "combee_ingest_rejected_total"
                        )
                        >= 2
                    ):
                        break
                    await anyio.sleep(0.2)
    finally:
        kill(proc, signal.SIGTERM)
    assert values[("combee_ingest_traces_total", ())] == 4, log_path.read_text()[-2000:]
    assert values[("combee_ingest_assembly_seconds_count", ())] == 4
    assert values[("combee_ingest_feedback_joined_total", ())] == 3
    assert values[("combee_ingest_without_feedback_total", ())] == 1
    assert values[("combee_ingest_rejected_total", (("kind", "no_root"),))] == 1
    assert values[("combee_ingest_rejected_total", (("kind", "orphan_feedback"),))] == 1
    assert values[("combee_ingest_open_traces", ())] == 0
    assert values[("combee_ingest_spans_total", ())] == len(spans)


@pytest.mark.anyio
async def test_evaluation_log_records_on_the_logs_topic_join_their_trace_and_none_is_dropped(
    config: Config, unique: str
) -> None:
    """gen_ai.evaluation.result events emitted through the OTel SDK's LoggerProvider and
    encoded by its OTLP log encoder, on the logs topic: the one in the run's span context joins
    its trace; one emitted outside any span is dead-lettered (untraced_feedback); one whose
    evaluator failed (error.type) is no outcome, and is counted."""
    cfg = ingest_config(engine_config(config, unique, "http://127.0.0.1:9"), unique)
    cfg = msgspec.structs.replace(
        cfg, ingest=msgspec.structs.replace(cfg.ingest, feedback_wait_s=2.0)
    )
    run = otel_agent.openinference_run("What is 6 * 7?")
    records = [
        *otel_agent.evaluation_records(run.root, name="correctness", label="correct", score=1.0),
        *otel_agent.evaluation_records(run.root, name="toxicity", error_type="TimeoutError"),
        *otel_agent.evaluation_records(None, name="lost", label="pass"),
    ]
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send_records(
            cfg, cfg.ingest.spans_topic, [(None, encode(run.spans, "otlp_proto"), 0)]
        )
        logs = otel_agent.encode_logs_proto(records)
        await send_records(cfg, cfg.ingest.logs_topic, [(None, logs, 1)])
        [trace] = await wait_for_traces(cfg, 1)
        [letter] = await wait_for_letters(cfg, 1)
        await wait_fully_committed(cfg, 60, cfg.ingest.spans_topic, cfg.ingest.logs_topic)
        stage.stop()
    assert trace.trace_id == run.trace_id
    assert trace.feedback == Feedback(score=1.0, passed=True, text="correctness (correct)")
    reason = dict(letter.headers)[H_ERROR].decode()
    assert reason.startswith("untraced_feedback") and b'"lost"' in letter.value, reason
    assert letter_sources([letter]) == Counter({(cfg.ingest.logs_topic, 1, 0): 1})
    assert sample(stage, "combee_ingest_evaluation_errors_total", kind="error") == 1
    assert sample(stage, "combee_ingest_rejected_total", kind="untraced_feedback") == 1


@pytest.mark.anyio
async def test_feedback_within_the_wait_is_combined_and_a_verdict_after_writing_is_late(
    config: Config, unique: str
) -> None:
    """ingest.feedback_wait_s = 3: trace A's two evaluations, the second sent after A is
    complete, are combined; trace B, whose feedback never came in time, is written without it,
    and the FeedbackRecord sent for it afterwards is dead-lettered as late_feedback."""
    cfg = ingest_config(engine_config(config, unique, "http://127.0.0.1:9"), unique)
    cfg = msgspec.structs.replace(
        cfg, ingest=msgspec.structs.replace(cfg.ingest, feedback_wait_s=3.0)
    )
    a, b = otel_agent.openinference_run("What is 6 * 7?"), otel_agent.openinference_run("2 + 2?")

    def evaluation(name: str, score: float, label: str) -> bytes:
        records = otel_agent.evaluation_records(a.root, name=name, score=score, label=label)
        return otel_agent.encode_logs_proto(records)

    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        spans = [(None, encode(r.spans, "otlp_proto"), i) for i, r in enumerate([a, b])]
        await send_records(cfg, cfg.ingest.spans_topic, spans)
        await send_records(
            cfg, cfg.ingest.logs_topic, [(None, evaluation("judge", 1.0, "pass"), 0)]
        )
        await anyio.sleep(1.5)  # A is complete (gap_s 0.5) and waits until 3 s after that
        await send_records(cfg, cfg.ingest.logs_topic, [(None, evaluation("rule", 0.0, "fail"), 1)])
        traces = {t.trace_id: t for t in await wait_for_traces(cfg, 2)}
        async with TraceProducer(cfg.kafka) as producer:
            late = FeedbackRecord(key="oi-agent", trace_id=b.trace_id, feedback=Feedback(score=1))
            await producer.send_feedback(late)
        [letter] = await wait_for_letters(cfg, 1)
        stage.stop()
    assert traces[a.trace_id].feedback == Feedback(
        score=0.5, passed=False, text="judge (pass)\nrule (fail)"
    )
    assert traces[b.trace_id].feedback == NO_FEEDBACK
    reason = dict(letter.headers)[H_ERROR].decode()
    assert reason.startswith("late_feedback") and "already written without it" in reason
    assert b.trace_id in reason and letter.key == b.trace_id.encode()


@pytest.mark.anyio
async def test_phoenix_annotations_on_the_feedback_topic_join_their_trace(
    config: Config, unique: str
) -> None:
    """Phoenix REST annotation bodies on the feedback topic: a span annotation sent before the
    span it names, and a trace annotation after the trace is complete, are combined into the
    trace; an annotation of a span that never comes is dead-lettered (orphan_feedback)."""
    cfg = ingest_config(
        engine_config(config, unique, "http://127.0.0.1:9"),
        unique,
        feedback_wait_s=2.0,
        trace_timeout_s=4.0,
    )
    run = otel_agent.openinference_run("What is 6 * 7?")
    llm = next(s for s in run.spans if s.name == "ChatCompletion")
    llm_id = format(llm.get_span_context().span_id, "016x")

    def body(**item: Any) -> bytes:
        return msgspec.json.encode({"data": [{"annotator_kind": "HUMAN", **item}]})

    on_span = body(
        span_id=llm_id,
        name="tool_choice",
        annotator_kind="LLM",
        result={"label": "correct", "score": 1.0, "explanation": "calculator was right"},
    )
    on_trace = body(trace_id=run.trace_id, name="thumbs", result={"label": "no", "score": 0.0})
    lost = body(span_id="00000000000000ff", name="thumbs", result={"label": "yes"})
    key = run.trace_id.encode()
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send_records(cfg, cfg.kafka.feedback_topic, [(key, on_span, 0), (None, lost, 0)])
        await send_records(cfg, cfg.ingest.spans_topic, [(key, encode(run.spans, "otlp_proto"), 0)])
        await anyio.sleep(1.0)  # complete (gap_s 0.5); it waits for feedback 2 s after that
        await send_records(cfg, cfg.kafka.feedback_topic, [(key, on_trace, 0)])
        [trace] = await wait_for_traces(cfg, 1)
        [letter] = await wait_for_letters(cfg, 1)
        await wait_fully_committed(cfg, 60, cfg.ingest.spans_topic, cfg.kafka.feedback_topic)
        stage.stop()
    assert trace.trace_id == run.trace_id and trace.task == "What is 6 * 7?"
    assert trace.feedback == Feedback(
        score=0.5,
        passed=False,  # the user's "no"
        text="tool_choice (correct, LLM): calculator was right\nthumbs (no, HUMAN)",
    )
    reason = dict(letter.headers)[H_ERROR].decode()
    assert reason.startswith("orphan_feedback: annotation 'thumbs' for span 00000000000000ff")
    assert letter_sources([letter]) == Counter({(cfg.kafka.feedback_topic, 0, 1): 1})
    assert sample(stage, "combee_ingest_feedback_joined_total") == 1


otelcol_binary = otel_support.otelcol_binary  # the session fixture, for this module


@pytest.mark.anyio
@pytest.mark.timeout(900)  # the collector's first build, when `make otelcol-prepare` has not run
async def test_through_the_real_collector_agents_get_a_new_prompt_version(
    otelcol_binary: Path, config: Config, unique: str
) -> None:
    """Instrumented agent runs export OTLP/HTTP to the real OpenTelemetry Collector, whose
    Kafka exporter writes them to the spans topic (per-trace messages keyed by trace id); the
    ingest stage and the engine in one task group turn them into new prompt versions."""
    async with sim_server(SimSettings(seed=SEED)) as sim:
        cfg = engine_config(config, unique, sim.base_url, batch_size=2, max_wait_s=0.5)
        cfg = ingest_config(cfg, unique, feedback_wait_s=3.0)
        runs = await agent_runs(sim.base_url, 4, ["calc-a"])
        tasks = {t.question: t for t in sim_tasks(4, keys=1, lessons=4, seed=SEED)}
        stage, engine = IngestStage(cfg), Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run)
            tg.start_soon(engine.run)
            await stage.started.wait()  # the spans topic exists (the broker does not auto-create)
            with run_collector(
                cfg.kafka.bootstrap_servers,
                encoding="otlp_proto",
                partition_traces_by_id=True,
                traces_topic=cfg.ingest.spans_topic,
                logs_topic=cfg.ingest.logs_topic,
                binary=otelcol_binary,
            ) as collector:
                await export_spans(collector.http_endpoint, runs)
                async with TraceProducer(cfg.kafka) as producer:
                    for run in runs:
                        task = tasks[run.task]
                        feedback = Feedback(passed=False, text=task.metadata["feedback"])
                        await producer.send_feedback(
                            FeedbackRecord(key="calc-a", trace_id=run.trace_id, feedback=feedback)
                        )
                traces = await wait_for_traces(cfg, len(runs))
                updates = await wait_until_learned(cfg, {"calc-a": len(runs)}, 120)
            stage.stop()
            engine.stop()
    assert sorted(t.trace_id for t in traces) == sorted(run.trace_id for run in runs)
    newest = max(updates, key=lambda u: u.version)
    assert newest.version >= 1 and newest.stats.traces_learned == len(runs)
    assert any(s.bullets for s in newest.playbook.sections), "the lessons reached the prompt"


@pytest.mark.anyio
@pytest.mark.timeout(900)  # the collector's first build, when `make otelcol-prepare` has not run
async def test_the_collectors_otlp_json_is_assembled_as_its_protobuf_would_be(
    otelcol_binary: Path, config: Config, unique: str
) -> None:
    """The real Collector's kafka exporter writing ``otlp_json`` (hex ids, its own JSON of
    int64s and arrays), read with ``ingest.encoding = "otlp_json"``: each instrumented run is
    one trace with the key, task, steps and output its spans give in protobuf."""
    async with sim_server(SimSettings(seed=SEED)) as sim:
        runs = await agent_runs(sim.base_url, 2, ["calc-json"])
    cfg = ingest_config(
        engine_config(config, unique, "http://127.0.0.1:9"), unique, encoding="otlp_json"
    )
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        with run_collector(
            cfg.kafka.bootstrap_servers,
            encoding="otlp_json",
            partition_traces_by_id=True,
            traces_topic=cfg.ingest.spans_topic,
            logs_topic=cfg.ingest.logs_topic,
            binary=otelcol_binary,
        ) as collector:
            await export_spans(collector.http_endpoint, runs)
            traces = {t.trace_id: t for t in await wait_for_traces(cfg, len(runs))}
        stage.stop()
    written = await read_to_end(cfg.kafka, cfg.ingest.spans_topic)
    assert written and all(b'"resourceSpans"' in r.value for r in written), "the Collector's JSON"
    assert await dead_letters(cfg) == []
    assert sorted(traces) == sorted(run.trace_id for run in runs)
    for run in runs:
        trace = traces[run.trace_id]
        assert (trace.key, trace.task) == ("calc-json", run.task)
        assert [(s.kind, s.name) for s in trace.steps] == [
            ("message", None),
            ("tool_call", "calculator"),
            ("observation", "calculator"),
            ("message", None),
        ]
        assert trace.output and trace.output == json.loads(trace.steps[0].content)["final_answer"]
        spans = decode_telemetry(encode(run.spans, "otlp_proto"), "otlp_proto", "traces").spans
        assert trace == trace_from_spans(spans, [], cfg.ingest, feedback=NO_FEEDBACK)


@pytest.mark.anyio
@pytest.mark.timeout(900)  # the collector's first build, when `make otelcol-prepare` has not run
async def test_the_pydantic_ai_example_file_is_learned_from_through_a_real_collector(
    otelcol_binary: Path, config: Config, unique: str
) -> None:
    """examples/pydantic_ai_agent.py itself, as a process (configured by its environment: the
    simulator as OPENAI_BASE_URL, the real Collector as OTEL_EXPORTER_OTLP_ENDPOINT, COMBEE__*
    for the broker): its runs become traces keyed support-bot and a new prompt version."""
    tasks = sim_tasks(2, keys=1, lessons=2, seed=SEED)
    async with sim_server(SimSettings(seed=SEED)) as sim:
        cfg = engine_config(config, unique, sim.base_url, batch_size=2, max_wait_s=0.5)
        cfg = ingest_config(cfg, unique)
        stage, engine = IngestStage(cfg), Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run)
            tg.start_soon(engine.run)
            await stage.started.wait()
            with run_collector(
                cfg.kafka.bootstrap_servers,
                encoding="otlp_proto",
                partition_traces_by_id=True,
                traces_topic=cfg.ingest.spans_topic,
                logs_topic=cfg.ingest.logs_topic,
                binary=otelcol_binary,
            ) as collector:
                env = {
                    k: v
                    for k, v in os.environ.items()
                    if not k.startswith(("COMBEE__", "OTEL_", "OPENAI_"))
                }
                env.update(ingest_env(cfg))
                env.update(
                    OPENAI_BASE_URL=sim.base_url,
                    OPENAI_API_KEY="sim",
                    OTEL_EXPORTER_OTLP_ENDPOINT=collector.http_endpoint,
                    PYTHONPATH=str(REPO),  # this checkout's combee_stream, not an installed one
                )
                # The simulator's agent role reads its question from a <question> block.
                questions = [otel_agent.question(t.question) for t in tasks]
                example = [sys.executable, str(REPO / "examples" / "pydantic_ai_agent.py")]
                done = await anyio.run_process(
                    [*example, *questions], env=env, cwd=REPO, check=False
                )
                assert done.returncode == 0, done.stderr.decode()[-3000:]
                traces = await wait_for_traces(cfg, len(tasks))
                updates = await wait_until_learned(cfg, {"support-bot": len(tasks)}, 120)
            stage.stop()
            engine.stop()
    assert [(t.key, t.prompt_version) for t in traces] == [("support-bot", 0)] * len(tasks)
    assert sorted(t.task for t in traces) == sorted(questions), "the user message, not the prompt"
    assert all(t.metadata["agent"] == "support-bot" and t.output for t in traces)
    newest = max(updates, key=lambda u: u.version)
    assert newest.version >= 1 and newest.stats.traces_learned == len(tasks)


@pytest.mark.anyio
async def test_a_pydantic_ai_agent_is_learned_from_with_only_the_span_processor(
    config: Config, unique: str
) -> None:
    """A real agent framework from PyPI (Pydantic AI, which writes the GenAI conventions
    itself), with nothing of combee-stream but PromptSpanProcessor: its spans become a trace
    with its key, version, task and output."""
    from opentelemetry.sdk.trace import TracerProvider
    from pydantic_ai import Agent
    from pydantic_ai.models.instrumented import InstrumentationSettings
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from combee_stream.otel import PromptSpanProcessor
    from combee_stream.sim.app import CHAT_MODEL

    task = sim_tasks(1, keys=1, lessons=1, seed=SEED)[0]
    async with sim_server(SimSettings(seed=SEED)) as sim:
        cfg = ingest_config(engine_config(config, unique, sim.base_url), unique)
        collector = otel_agent.SpanCollector()
        provider = TracerProvider()
        provider.add_span_processor(PromptSpanProcessor("pai-bot", 4))
        provider.add_span_processor(SimpleSpanProcessor(collector))
        model = OpenAIChatModel(
            CHAT_MODEL, provider=OpenAIProvider(base_url=sim.base_url, api_key="sim")
        )
        agent = Agent(model, name="pai-bot", system_prompt="You answer support questions.")
        agent.instrument = InstrumentationSettings(tracer_provider=provider)
        # The simulator's agent role reads its question from a <question> block.
        result = await agent.run(otel_agent.question(task.question))
        provider.shutdown()
        stage = IngestStage(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run)
            await stage.started.wait()
            await send_records(
                cfg, cfg.ingest.spans_topic, [(None, encode(collector.spans, "otlp_proto"), 0)]
            )
            [trace] = await wait_for_traces(cfg, 1)
            stage.stop()
    assert (trace.key, trace.prompt_version) == ("pai-bot", 4)
    assert task.question in trace.task and "You answer support" not in trace.task
    assert trace.output == result.output and trace.metadata["agent"] == "pai-bot"
    assert [s.kind for s in trace.steps] == ["message"], trace.steps


@pytest.mark.anyio
async def test_a_trace_too_large_for_the_traces_topic_is_dead_lettered_not_a_poison_pill(
    config: Config, unique: str
) -> None:
    """30 tool calls of 4,000 characters each: the trace's record would pass the broker's limit
    (here kafka.max_message_bytes = 64 KiB), so it is dead-lettered, cut, and the next trace
    is written as usual."""
    async with sim_server(SimSettings(seed=SEED)) as sim:
        cfg = ingest_config(engine_config(config, unique, sim.base_url), unique)
        cfg = msgspec.structs.replace(
            cfg, kafka=msgspec.structs.replace(cfg.kafka, max_message_bytes=65_536)
        )
        provider, collector = otel_agent.tracer_provider()
        tracer = provider.get_tracer("tests.big")
        task = otel_agent._messages_attribute("user", "Summarise the logs.")
        with tracer.start_as_current_span(
            "invoke_agent", attributes={"gen_ai.operation.name": "invoke_agent",
                                        "combee.prompt.key": "big", "gen_ai.input.messages": task}
        ):  # fmt: skip
            for i in range(30):
                attributes = {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "read_log",
                    "gen_ai.tool.call.result": f"{i} " + "x" * 4000,
                }
                with tracer.start_as_current_span("execute_tool read_log", attributes=attributes):
                    pass
        provider.shutdown()
        [small] = await agent_runs(sim.base_url, 1, ["calc-a"])
        stage = IngestStage(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run)
            await stage.started.wait()
            records = [(None, encode(collector.spans, "otlp_proto"), 0)]
            records.append((None, encode(small.spans, "otlp_proto"), 0))
            await send_records(cfg, cfg.ingest.spans_topic, records)
            traces = await wait_for_traces(cfg, 1)
            with anyio.fail_after(30):
                while not (letters := await dead_letters(cfg)):  # noqa: ASYNC110
                    await anyio.sleep(0.3)
            stage.stop()
    assert [t.trace_id for t in traces] == [small.trace_id]
    [letter] = letters
    reason = dict(letter.headers)[H_ERROR].decode()
    assert "kafka.max_message_bytes" in reason and len(letter.value) <= 65_536 // 2


# --------------------------------------------------------------------------- hostile input


def orphan_flood(n: int, service: str, seed: int = 5) -> list[Any]:
    """``n`` spans, each a child span of a trace of its own whose root never comes (its parent
    is remote), from ``service``: issue 18's flood of 389-byte OTLP records, sized for a test."""
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    rng = random.Random(seed)
    provider, collector = otel_agent.tracer_provider(service_name=service)
    tracer = provider.get_tracer("tests.flood")
    for _ in range(n):
        parent = SpanContext(
            rng.getrandbits(128), rng.getrandbits(64), True, TraceFlags(TraceFlags.SAMPLED)
        )
        context = otel_trace.set_span_in_context(NonRecordingSpan(parent))
        with tracer.start_as_current_span("chat", context=context):
            pass
    provider.shutdown()
    return list(collector.spans)


async def send_fast(cfg: Config, topic: str, records: Sequence[tuple[Any, bytes, int]]) -> float:
    """Send without waiting for each record (batched); returns when the broker has them all,
    the time the last was acknowledged (anyio.current_time)."""
    producer = make_producer(cfg.kafka, linger_ms=20)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, value=value, key=key, partition=partition)
            for key, value, partition in records
        ]
        for future in futures:
            await future
        return anyio.current_time()
    finally:
        await producer.stop()


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_an_orphan_flood_of_one_service_is_shed_and_holds_back_no_other_service(
    config: Config, unique: str
) -> None:
    """3,000 OTLP records from service `flood`, each one child span of a trace of its own
    (its root never comes), then, behind them, a good trace of another service. Before the
    bounds the spans topic paused at max_open_traces (400 here) and the orphans left only by
    timing out, so the good trace waited for rounds of timeouts. Now `flood` is shed from its
    own orphans at max_open_traces_per_service (50): the good trace is written before any
    orphan could time out, and every orphan is dead-lettered with why (shed, or expired)."""
    cfg = ingest_config(
        engine_config(config, unique, "http://127.0.0.1:9"),
        unique,
        max_open_traces=400,
        max_open_traces_per_service=50,
        max_orphan_traces=200,
        orphan_timeout_s=20.0,
        trace_timeout_s=60.0,
    )
    flood = orphan_flood(3_000, "flood")
    good = otel_agent.openinference_run("What is 6 * 7?")
    records = [(None, encode([span], "otlp_proto"), i % 3) for i, span in enumerate(flood)]
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send_fast(cfg, cfg.ingest.spans_topic, records)
        sent = await send_fast(
            cfg, cfg.ingest.spans_topic, [(None, encode(good.spans, "otlp_proto"), 0)]
        )
        [trace] = await wait_for_traces(cfg, 1, limit_s=cfg.ingest.trace_timeout_s)
        held_back = anyio.current_time() - sent
        letters = await wait_for_letters(cfg, len(flood), limit_s=120)
        await wait_fully_committed(cfg, 60)
        stage.stop()
    assert trace.trace_id == good.trace_id and trace.key == "oi-agent"
    assert held_back < cfg.ingest.orphan_timeout_s, f"held back {held_back:.1f} s by the flood"
    reasons = [dict(r.headers)[H_ERROR].decode() for r in letters]
    shed = [r for r in reasons if r.startswith("orphan_shed: ")]
    expired = [r for r in reasons if r.startswith("no_root: ")]
    assert len(shed) + len(expired) == len(letters) == len(flood), "each orphan, once"
    assert len(expired) <= 50 and all("ingest.orphan_timeout_s" in r for r in expired)
    assert all("'flood' holds more than 50 open traces" in r for r in shed), shed[:3]
    assert sample(stage, "combee_ingest_pauses_total") == 0, "the spans topic never paused"
    assert good.trace_id not in "".join(reasons)


def _respan(span: Any, **changes: Any) -> Any:
    """A copy of an SDK span with other start / end times."""
    from opentelemetry.sdk.trace import ReadableSpan

    fields = {
        "name": span.name,
        "context": span.get_span_context(),
        "parent": span.parent,
        "resource": span.resource,
        "attributes": span.attributes,
        "events": span.events,
        "kind": span.kind,
        "instrumentation_scope": span.instrumentation_scope,
        "start_time": span.start_time,
        "end_time": span.end_time,
    }
    return ReadableSpan(**{**fields, **changes})


@pytest.mark.anyio
async def test_a_root_that_never_ends_or_ends_before_it_starts_is_dead_lettered_as_such(
    config: Config, unique: str
) -> None:
    """Two runs whose root span is wrong: one sent unended (no end time), whose letter said
    its root "did not arrive"; one ending before it starts, which was written as it was. And a
    good run beside them."""
    cfg = ingest_config(
        engine_config(config, unique, "http://127.0.0.1:9"),
        unique,
        trace_timeout_s=3.0,
    )
    unended, backwards, fine = (
        otel_agent.openinference_run(f"What is {n} * 7?") for n in (4, 5, 6)
    )

    def with_root(run: AgentRun, root: Any) -> list[Any]:
        return [root if s is run.root else s for s in run.spans]

    start = backwards.root.start_time
    spans = [
        *with_root(unended, _respan(unended.root, end_time=None)),
        *with_root(backwards, _respan(backwards.root, start_time=start + 10**9, end_time=start)),
        *fine.spans,
    ]
    stage = IngestStage(cfg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.run)
        await stage.started.wait()
        await send_records(cfg, cfg.ingest.spans_topic, [(None, encode(spans, "otlp_proto"), 0)])
        # The unended root waits out trace_timeout_s; the others were decided at their gap.
        with anyio.fail_after(60):
            while not letter_kinds(await dead_letters(cfg), unended.trace_id):  # noqa: ASYNC110
                await anyio.sleep(0.3)
        await wait_fully_committed(cfg, 60)
        stage.stop()
    traces, letters = await written_traces(cfg), await dead_letters(cfg)
    assert [t.trace_id for t in traces] == [fine.trace_id]
    reasons = [dict(r.headers)[H_ERROR].decode() for r in letters]
    [never] = [r for r in reasons if unended.trace_id in r]
    assert never.startswith("unended_root: ") and "arrived but never ended" in never, never
    [early] = [r for r in reasons if backwards.trace_id in r]
    assert early.startswith("unmappable: ") and "ends before it starts" in early, early
