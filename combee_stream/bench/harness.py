"""Shared plumbing of the Kafka suites: broker, fresh topics, the simulator in its own process,
an engine config pointed at both, the engine running in a task group, bulk producing, and
reading the engine's metrics."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx2
import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from combee_stream.config import Config, KafkaConfig
from combee_stream.errors import UserError
from combee_stream.http import free_port
from combee_stream.kafka.broker import start_broker
from combee_stream.kafka.client import client_kwargs
from combee_stream.kafka.reader import read_updates as read_topic_updates
from combee_stream.kafka.topics import run_topics
from combee_stream.llm import LLMClient
from combee_stream.logs import get_logger
from combee_stream.schemas import PromptUpdate, Trace, encode
from combee_stream.sim import SimSettings, simulated_llm
from combee_stream.wiring import Engine

log = get_logger(__name__)

_READY = re.compile(r"at (http://\S+/v1)")


async def with_broker(config: Config) -> Config:
    """Start the local broker of ``config.broker`` if needed (idempotent; left running) and
    point ``config.kafka`` at it."""
    bootstrap = await anyio.to_thread.run_sync(start_broker, config.broker)
    kafka = msgspec.structs.replace(config.kafka, bootstrap_servers=bootstrap)
    return msgspec.structs.replace(config, kafka=kafka)


def fresh_topics(config: Config, suite: str, partitions: int = 3) -> Config:
    """Topics and a consumer group of their own, so runs never see each other's data."""
    kafka = run_topics(config.kafka, f"bench.{suite}.{uuid.uuid4().hex[:8]}", partitions=partitions)
    return msgspec.structs.replace(config, kafka=kafka)


def engine_config(
    config: Config,
    llm_url: str,
    *,
    concurrency: int,
    batch_size: int,
    max_wait_s: float,
    pipelined: bool = True,
    timeout_s: float = 60.0,
    queue_size: int | None = None,
    seed: int | None = None,
) -> Config:
    """``config`` with every LLM role on ``llm_url`` (the simulator) and a fixed batch size (no
    controller): the engine setup every Kafka suite measures."""
    llm = simulated_llm(
        llm_url, config.llm, concurrency=concurrency, timeout_s=timeout_s, memo_path=""
    )
    learning = msgspec.structs.replace(
        config.learning,
        strategy="combee",
        batch_size=batch_size,
        min_batch_size=batch_size,
        max_batch_size=batch_size,
        seed=config.learning.seed if seed is None else seed,
    )
    engine = msgspec.structs.replace(
        config.engine,
        max_wait_s=max_wait_s,
        pipelined=pipelined,
        metrics_port=0,
        queue_size=queue_size or config.engine.queue_size,
    )
    return msgspec.structs.replace(config, llm=llm, learning=learning, engine=engine)


@contextlib.asynccontextmanager
async def running_engine(
    config: Config, *, http_client: httpx2.AsyncClient | None = None
) -> AsyncIterator[tuple[Engine, LLMClient]]:
    """The engine of ``config`` running in a task group with its own LLM client, started; on
    exit it is stopped (drained, committed, closed) and the client closed."""
    client = LLMClient(config.llm, http_client=http_client, env={})
    try:
        engine = Engine(config, llm=client)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            yield engine, client
            engine.stop()
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def sim_process(settings: SimSettings) -> AsyncIterator[str]:
    """The simulator served over HTTP by its own process (``combee-stream sim llm-server``), so
    its CPU is not charged to the engine under test. Yields its base URL."""
    lat = settings.latency
    command = [
        sys.executable,
        "-m",
        "combee_stream",
        "--log-level",
        "warning",
        "sim",
        "llm-server",
        "--port",
        str(free_port()),
        "--seed",
        str(settings.seed),
        "--latency-base",
        repr(lat.base_s),
        "--latency-per-in-token",
        repr(lat.per_input_token_s),
        "--latency-per-out-token",
        repr(lat.per_output_token_s),
        "--jitter",
        repr(lat.jitter),
        "--time-scale",
        repr(settings.time_scale),
    ]
    if settings.overload is not None:
        command += ["--overload", str(settings.overload)]
    async with await anyio.open_process(command) as process:
        try:
            assert process.stdout is not None
            url = ""
            buffered = b""
            with anyio.fail_after(60):
                async for chunk in process.stdout:
                    buffered += chunk
                    found = _READY.search(buffered.decode(errors="replace"))
                    if found:
                        url = found.group(1)
                        break
            if not url:
                raise UserError(f"the simulator did not start: {buffered.decode(errors='replace')}")
            yield url
        finally:
            process.terminate()
            with anyio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()


def rss_mb() -> float:
    """This process's resident memory (VmRSS), in MiB; NaN where /proc has none."""
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bulk_batch_bytes(kafka: KafkaConfig) -> int:
    """Large batches for bulk loads, yet within what ``topics create`` lets the traces topic take
    (``kafka.max_message_bytes`` bounds a whole record batch; half leaves room for framing)."""
    return min(1 << 20, kafka.max_message_bytes // 2)


async def produce_bulk(kafka: KafkaConfig, traces: Sequence[Trace], chunk: int = 2000) -> None:
    """Send ``traces`` fast: unawaited sends in chunks, then one wait per chunk."""
    producer = AIOKafkaProducer(
        **client_kwargs(kafka), linger_ms=20, max_batch_size=bulk_batch_bytes(kafka), acks=1
    )
    await producer.start()
    try:
        for start in range(0, len(traces), chunk):
            futures = [
                await producer.send(kafka.traces_topic, value=encode(t), key=t.key.encode())
                for t in traces[start : start + chunk]
            ]
            for future in futures:
                await future
    finally:
        await producer.stop()


async def delete_topics(kafka: KafkaConfig) -> None:
    """Drop a run's topics (the broker's disk is shared with the tests)."""
    admin = AIOKafkaAdminClient(**client_kwargs(kafka))
    await admin.start()
    try:
        await admin.delete_topics([kafka.traces_topic, kafka.prompts_topic, kafka.dlq_topic])
    except Exception as exc:  # best effort: a leftover topic only costs disk
        log.warning("bench.delete_topics_failed", error=str(exc))
    finally:
        await admin.close()


async def read_updates(kafka: KafkaConfig) -> list[PromptUpdate]:
    """Every PromptUpdate on the prompts topic (the run's own topic: not compacted away yet)."""
    return await read_topic_updates(kafka, strict=True)


def metric_total(metric: Any, suffix: str = "") -> float:
    """Sum of a prometheus metric's samples named ``<name><suffix>`` over all labels."""
    total = 0.0
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name + suffix:
                total += sample.value
    return total


class Progress(msgspec.Struct):
    first_read: float  # anyio.current_time() when the engine had read its first trace
    done: float  # ... when the engine had published versions learning ``total`` traces
    marks: dict[int, float]  # published count -> time first seen


async def watch_engine(metrics: Any, total: int, limit_s: float, every_s: float = 0.01) -> Progress:
    """Poll an engine's metrics until ``total`` traces are published (or TimeoutError)."""
    first = 0.0
    marks: dict[int, float] = {}
    with anyio.fail_after(limit_s):
        while True:
            now = anyio.current_time()
            if not first and metric_total(metrics.traces_in, "_total") > 0:
                first = now
            published = int(metric_total(metrics.trace_to_publish, "_count"))
            if published and published not in marks:
                marks[published] = now
            if published >= total:
                return Progress(first_read=first or now, done=now, marks=marks)
            await anyio.sleep(every_s)


__all__ = [
    "Progress",
    "bulk_batch_bytes",
    "delete_topics",
    "engine_config",
    "fresh_topics",
    "metric_total",
    "produce_bulk",
    "read_updates",
    "rss_mb",
    "running_engine",
    "sim_process",
    "watch_engine",
    "with_broker",
]
