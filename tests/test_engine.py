"""The streaming engine end to end: real broker, simulated LLM over real HTTP."""

from __future__ import annotations

import os
import re
import sys

import anyio
import httpx2
import msgspec
import pytest
from engine_support import (
    audit,
    engine_config,
    env_for,
    lessons_of,
    produce,
    wait_until_learned,
)

from combee_stream import Engine
from combee_stream.config import Config
from combee_stream.http import free_port
from combee_stream.kafka.topics import ensure_topics
from combee_stream.schemas import Feedback, Trace
from combee_stream.sim import LatencyModel, SimSettings, generate_traces, sim_server
from combee_stream.sim.markers import marker_line
from combee_stream.sim.traces import lesson_text


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_200_traces_4_keys_3_partitions_learned_exactly_once(
    config: Config, unique: str
) -> None:
    traces = generate_traces(200, 4, 10, seed=3)
    expected = {k: sum(t.key == k for t in traces) for k in {t.key for t in traces}}
    settings = SimSettings(seed=3, latency=LatencyModel(base_s=0.02))
    async with sim_server(settings) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=10)
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            where = await produce(cfg, traces)
            updates = await wait_until_learned(cfg, expected)
            engine.stop()

    result = audit(updates)
    assert result.problems == []
    assert set(result.learned) == {t.trace_id for t in traces}
    assert max(result.learned.values()) == 1  # nobody learned twice
    for key, update in result.final.items():
        own = {f"k{key.removeprefix('sim-k')}-l{i:03d}" for i in range(10)}
        assert lessons_of(update.playbook) == own, key  # its own lessons, none of another key
        assert update.stats.traces_learned == expected[key]
        # the watermark covers the key's highest offset in its partition
        offsets = [where[t.trace_id] for t in traces if t.key == key]
        partitions = {p for p, _ in offsets}
        assert len(partitions) == 1
        partition = partitions.pop()
        assert update.watermark == {partition: max(o for _, o in offsets)}


@pytest.mark.anyio
async def test_metrics_health_and_inspect(config: Config, unique: str) -> None:
    traces = generate_traces(20, 1, 4, seed=4)
    port = free_port()
    async with sim_server(SimSettings(seed=4)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=5)
        cfg = msgspec.structs.replace(
            cfg, engine=msgspec.structs.replace(cfg.engine, metrics_port=port)
        )
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg, httpx2.AsyncClient() as http:
            tg.start_soon(engine.run)
            await engine.started.wait()
            base = f"http://127.0.0.1:{port}"
            with anyio.fail_after(30):
                while True:  # the endpoint comes up with the engine; ready once restored
                    try:
                        if (await http.get(f"{base}/readyz")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        pass
                    await anyio.sleep(0.1)
            assert (await http.get(f"{base}/healthz")).status_code == 200
            await produce(cfg, traces)
            await wait_until_learned(cfg, {"sim-k0": 20})
            metrics = (await http.get(f"{base}/metrics")).text
            engine.stop()
    assert "combee_traces_in_total{partition=" in metrics
    assert 'combee_prompt_version{key="sim-k0"} 4.0' in metrics
    assert 'combee_llm_calls{role="reflector"} 20.0' in metrics
    # The simulator serves each prompt's prefix shared with a recent one from its cache: the
    # reflector prompts share their instructions, so part of every prompt after the first.
    cached = re.search(r'combee_llm_tokens\{direction="cached",role="reflector"\} (\S+)', metrics)
    sent = re.search(r'combee_llm_tokens\{direction="in",role="reflector"\} (\S+)', metrics)
    assert cached is not None and sent is not None, [
        line for line in metrics.splitlines() if "combee_llm_tokens" in line
    ]
    assert 0 < float(cached.group(1)) < float(sent.group(1))
    assert 'combee_llm_bad_replies{kind="truncated",role="reflector"} 0.0' in metrics
    assert "combee_trace_to_publish_seconds_count 20.0" in metrics

    env = {**os.environ, **env_for(cfg)}
    cli = [sys.executable, "-m", "combee_stream", "inspect", "sim-k0"]
    shown = await anyio.run_process(cli, env=env, check=False)
    assert shown.returncode == 0, shown.stderr.decode()
    out = shown.stdout.decode()
    assert "# sim-k0 — version 4" in out
    assert [line.split()[0] for line in out.splitlines()[-4:]] == ["1", "2", "3", "4"]
    diff = await anyio.run_process([*cli, "--diff", "1", "4"], env=env, check=False)
    assert diff.returncode == 0, diff.stderr.decode()
    assert diff.stdout.decode().startswith("--- sim-k0 v1")
    assert "\n+[" in diff.stdout.decode()  # bullets learned after v1


@pytest.mark.anyio
async def test_backlog_larger_than_the_queue_pauses_partitions_and_loses_nothing(
    config: Config, unique: str
) -> None:
    traces = generate_traces(240, 6, 4, seed=8)
    expected = {k: sum(t.key == k for t in traces) for k in {t.key for t in traces}}
    async with sim_server(SimSettings(seed=8, latency=LatencyModel(base_s=0.05))) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=5)
        cfg = msgspec.structs.replace(
            cfg, engine=msgspec.structs.replace(cfg.engine, queue_size=20)
        )
        await ensure_topics(cfg.kafka)
        await produce(cfg, traces)  # the whole backlog is there before the engine starts
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            updates = await wait_until_learned(cfg, expected)
            engine.stop()
    result = audit(updates)
    assert result.problems == []
    assert set(result.learned) == {t.trace_id for t in traces}
    assert max(result.learned.values()) == 1
    pauses = engine.metrics.registry.get_sample_value("combee_backpressure_pauses_total")
    assert pauses is not None and pauses >= 1


def twin_traces(key: str, families: int) -> list[Trace]:
    """Two traces per lesson family whose lessons say the same with a few more words: too far
    apart for the word-level review (core.hygiene), close for an embedding."""
    traces = []
    for i in range(families):
        text = lesson_text(3, f"x{i}")
        for variant, wording in (("a", text), ("b", text[:-1] + ", every single time.")):
            traces.append(
                Trace(
                    key=key,
                    trace_id=f"{key}-{i}{variant}",
                    task=f"Task {i}{variant}",
                    feedback=Feedback(passed=False, text=marker_line(f"e{i}{variant}", wording)),
                )
            )
    return traces


@pytest.mark.anyio
@pytest.mark.parametrize("enabled", [True, False], ids=["embeddings", "no-embeddings"])
async def test_semantic_dedup_runs_in_the_engine_when_embeddings_are_enabled(
    config: Config, unique: str, enabled: bool
) -> None:
    traces = twin_traces("emb", 6)
    async with sim_server(SimSettings(seed=5)) as llm:
        cfg = engine_config(config, f"{unique}{int(enabled)}", llm.base_url, batch_size=4)
        embeddings = msgspec.structs.replace(cfg.llm.embeddings, enabled=enabled, threshold=0.75)
        cfg = msgspec.structs.replace(
            cfg, llm=msgspec.structs.replace(cfg.llm, embeddings=embeddings)
        )
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            await produce(cfg, traces)
            updates = await wait_until_learned(cfg, {"emb": len(traces)})
            engine.stop()
        embed_calls = llm.stats()["roles"].get("embeddings", {}).get("completed", 0)
    result = audit(updates)
    assert result.problems == [] and max(result.learned.values()) == 1
    final = result.final["emb"].playbook
    lessons = lessons_of(final)
    families = {lesson_id[:-1] for lesson_id in lessons}
    assert families == {f"e{i}" for i in range(6)}, "every lesson kept once at least"
    if enabled:
        assert embed_calls > 0
        assert len(lessons) == 6, f"one bullet per family of near duplicates: {sorted(lessons)}"
    else:
        assert embed_calls == 0
        assert len(lessons) == 12, "without embeddings these rewordings are all kept"
