"""Helpers for engine tests: configs pointed at the test broker and the simulated LLM, and an
audit of the prompts topic that proves (or disproves) exactly-once learning."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec

from combee_stream.config import Config
from combee_stream.core.controller import FixedBatch
from combee_stream.core.learner import Learner
from combee_stream.core.pipeline import KeyPipeline, MemorySink, PipelineSettings, closed_inbox
from combee_stream.core.versions import KeyChain
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.reader import read_to_end
from combee_stream.kafka.reader import read_updates as read_topic_updates
from combee_stream.kafka.topics import run_topics
from combee_stream.llm import LLMClient
from combee_stream.schemas import PromptUpdate, Source, Trace
from combee_stream.sim import IN_PROCESS_BASE_URL, SimSettings, sim_http_client, simulated_llm
from combee_stream.sim.markers import retained_ids
from combee_stream.wiring import build_learner

REPO = Path(__file__).resolve().parents[1]
# The deployment's secrets a test engine runs with (the held-out choice, the canary split).
HOLDOUT_SECRET = "test holdout key, not a deployment's"
CANARY_SECRET = "test canary key, not a deployment's"
SECRETS = {"COMBEE_HOLDOUT_SECRET": HOLDOUT_SECRET, "COMBEE_CANARY_SECRET": CANARY_SECRET}


def engine_config(
    config: Config,
    unique: str,
    llm_url: str,
    *,
    partitions: int = 3,
    batch_size: int | str = 10,
    guarantee: str = "at_least_once_watermark",
    max_wait_s: float = 0.5,
    session_timeout_ms: int | None = None,
) -> Config:
    kafka = run_topics(
        config.kafka,
        f"e.{unique}",
        partitions=partitions,
        session_timeout_ms=session_timeout_ms or config.kafka.session_timeout_ms,
    )
    llm = simulated_llm(llm_url, config.llm, max_attempts=6, timeout_s=5.0)
    learning = msgspec.structs.replace(
        config.learning,
        batch_size=batch_size,  # type: ignore[arg-type]
        min_batch_size=2,
        max_batch_size=40,
    )
    engine = msgspec.structs.replace(
        config.engine,
        processing_guarantee=guarantee,  # type: ignore[arg-type]
        max_wait_s=max_wait_s,
        metrics_port=0,
        shutdown_grace_s=20.0,
    )
    return msgspec.structs.replace(config, kafka=kafka, llm=llm, learning=learning, engine=engine)


@asynccontextmanager
async def sim_learner(cfg: Config, seed: int = 0) -> AsyncIterator[Learner]:
    """``build_learner(cfg)`` with every LLM role on an in-process simulator."""
    cfg = msgspec.structs.replace(cfg, llm=simulated_llm(IN_PROCESS_BASE_URL, cfg.llm))
    async with sim_http_client(SimSettings(seed=seed)) as http:
        llm = LLMClient(cfg.llm, http_client=http, env={})
        try:
            yield build_learner(cfg, llm, env=SECRETS)
        finally:
            await llm.aclose()


async def learned_in_memory(
    learner: Learner, key: str, traces: list[Trace], batch_size: int
) -> list[PromptUpdate]:
    """The versions one key's pipeline publishes learning ``traces`` in windows of
    ``batch_size``, one window at a time, into a MemorySink (no Kafka)."""
    items = [(t, Source(t.trace_id, 0, i)) for i, t in enumerate(traces)]
    sink = MemorySink()
    pipeline = KeyPipeline(
        KeyChain(key), learner, FixedBatch(batch_size), sink, closed_inbox(items),
        PipelineSettings(pipelined=False, max_windows_in_flight=1),
    )  # fmt: skip
    await pipeline.run()
    return sink.updates


def env_for(cfg: Config) -> dict[str, str]:
    """COMBEE__* overrides that make ``combee-stream run`` (a subprocess) use ``cfg``."""
    k, r, e, lrn = cfg.kafka, cfg.llm.curator, cfg.engine, cfg.learning
    env = {
        "COMBEE__KAFKA__BOOTSTRAP_SERVERS": k.bootstrap_servers,
        "COMBEE__KAFKA__TRACES_TOPIC": k.traces_topic,
        "COMBEE__KAFKA__PROMPTS_TOPIC": k.prompts_topic,
        "COMBEE__KAFKA__HISTORY_TOPIC": k.history_topic,
        "COMBEE__KAFKA__DLQ_TOPIC": k.dlq_topic,
        "COMBEE__KAFKA__GROUP_ID": k.group_id,
        "COMBEE__KAFKA__PARTITIONS": str(k.partitions),
        "COMBEE__KAFKA__SESSION_TIMEOUT_MS": str(k.session_timeout_ms),
        "COMBEE__LLM__MAX_ATTEMPTS": str(cfg.llm.max_attempts),
        "COMBEE__LLM__TIMEOUT_S": str(cfg.llm.timeout_s),
        "COMBEE__ENGINE__PROCESSING_GUARANTEE": f'"{e.processing_guarantee}"',
        "COMBEE__ENGINE__MAX_WAIT_S": str(e.max_wait_s),
        "COMBEE__ENGINE__METRICS_PORT": "0",
        "COMBEE__ENGINE__SHUTDOWN_GRACE_S": str(e.shutdown_grace_s),
        "COMBEE__LEARNING__BATCH_SIZE": str(lrn.batch_size)
        if isinstance(lrn.batch_size, int)
        else '"auto"',
        "COMBEE__LEARNING__MIN_BATCH_SIZE": str(lrn.min_batch_size),
        "COMBEE__LEARNING__MAX_BATCH_SIZE": str(lrn.max_batch_size),
    }
    for role in ("REFLECTOR", "CURATOR", "COMBINER"):
        env[f"COMBEE__LLM__{role}__BASE_URL"] = r.base_url
        env[f"COMBEE__LLM__{role}__MODEL"] = r.model
    return env


def spawn_engine(
    cfg: Config, log_path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``combee-stream run`` as a real process (so it can be SIGKILLed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMBEE__")}
    env.update(env_for(cfg))
    env.update(extra_env or {})
    env["PYTHONUNBUFFERED"] = "1"
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "combee_stream", "--log-level", "info", "run"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    proc.wait(timeout=60)


async def produce(cfg: Config, traces: list[Trace]) -> dict[str, tuple[int, int]]:
    """Send traces; returns trace_id -> (partition, offset)."""
    where: dict[str, tuple[int, int]] = {}
    async with TraceProducer(cfg.kafka) as producer:
        for trace in traces:
            where[trace.trace_id] = await producer.send(trace)
    return where


async def read_updates(cfg: Config) -> list[PromptUpdate]:
    """Every committed PromptUpdate on the prompts topic, in topic order per partition."""
    return await read_topic_updates(cfg.kafka, strict=True)


async def read_dlq(cfg: Config) -> list[Any]:
    return await read_to_end(cfg.kafka, cfg.kafka.dlq_topic)


class Audit(msgspec.Struct):
    """What the prompts topic proves about one run."""

    learned: Counter[str]  # trace_id -> how many versions (on the winning chain) learned it
    chains_ok: bool  # per key: versions 1..n, each parent = previous
    problems: list[str]
    final: dict[str, PromptUpdate]


def audit(updates: list[PromptUpdate]) -> Audit:
    by_key: dict[str, list[PromptUpdate]] = defaultdict(list)
    for u in updates:
        by_key[u.key].append(u)
    learned: Counter[str] = Counter()
    problems: list[str] = []
    final: dict[str, PromptUpdate] = {}
    for key, versions in by_key.items():
        versions.sort(key=lambda u: u.version)
        numbers = [u.version for u in versions]
        if numbers != list(range(1, len(versions) + 1)):
            problems.append(f"{key}: versions {numbers} are not 1..n without gaps or repeats")
        for prev, cur in itertools.pairwise(versions):
            if cur.parent_version != prev.version:
                problems.append(f"{key}: v{cur.version} has parent {cur.parent_version}")
            if cur.stats.traces_learned != prev.stats.traces_learned + cur.stats.window_traces:
                problems.append(f"{key}: v{cur.version} traces_learned does not add up")
        for u in versions:
            learned.update(u.stats.trace_ids)
        final[key] = versions[-1]
    return Audit(learned, not problems, problems, final)


def lessons_of(playbook: Any) -> set[str]:
    return retained_ids(playbook)


async def wait_until_learned(
    cfg: Config, expected: dict[str, int], limit_s: float = 180.0
) -> list[PromptUpdate]:
    """Poll the prompts topic until every key's newest version has learned ``expected[key]``."""
    with anyio.fail_after(limit_s):
        while True:
            updates = await read_updates(cfg)
            newest: dict[str, int] = {}
            for u in updates:
                newest[u.key] = max(newest.get(u.key, 0), u.stats.traces_learned)
            if all(newest.get(k, 0) >= n for k, n in expected.items()):
                return updates
            await anyio.sleep(0.5)
