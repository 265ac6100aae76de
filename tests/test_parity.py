"""One loop for every driver: the same traces and settings through the engine (real broker) and
through offline ``learn`` give the same versions, field by field, except what is documented as
driver-specific (wall times, offsets)."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
from engine_support import audit, engine_config, produce, wait_until_learned

from combee_stream import Engine, run_learn
from combee_stream.config import Config
from combee_stream.kafka.topics import ensure_topics
from combee_stream.schemas import PromptUpdate, decode, encode
from combee_stream.sim import SimSettings, generate_traces, sim_server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def comparable(update: PromptUpdate) -> PromptUpdate:
    """``update`` without its driver-specific fields (UpdateStats.delay_s, watermark,
    created_at)."""
    stats = msgspec.structs.replace(update.stats, delay_s=0.0)
    return msgspec.structs.replace(update, stats=stats, watermark={}, created_at=None)


@pytest.mark.anyio
async def test_engine_and_offline_learn_write_the_same_versions(
    config: Config, unique: str, tmp_path: Path
) -> None:
    traces = generate_traces(48, 2, 8, seed=6)  # 24 traces per key, every lesson 3 times
    expected = {k: sum(t.key == k for t in traces) for k in {t.key for t in traces}}
    async with sim_server(SimSettings(seed=6)) as llm:  # zero latency
        # The paper's synchronous loop, which offline learning runs; fixed batch of 6, and a
        # max wait long enough that every window closes by size in both drivers.
        cfg = engine_config(config, unique, llm.base_url, batch_size=6, max_wait_s=60.0)
        cfg = msgspec.structs.replace(
            cfg, engine=msgspec.structs.replace(cfg.engine, pipelined=False)
        )
        await ensure_topics(cfg.kafka)
        where = await produce(cfg, traces)  # the whole backlog before the engine starts
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            streamed = await wait_until_learned(cfg, expected)
            engine.stop()

        path = tmp_path / "traces.jsonl"
        path.write_bytes(b"".join(encode(t) + b"\n" for t in traces))
        report = await run_learn(cfg, path, tmp_path / "out", env={})
    assert report.complete and report.failed_traces == 0
    offline = [decode(line, PromptUpdate) for line in (tmp_path / "out/history.jsonl").open("rb")]

    assert audit(streamed).problems == [] and audit(offline).problems == []
    for key in sorted(expected):
        online_chain = sorted((u for u in streamed if u.key == key), key=lambda u: u.version)
        offline_chain = [u for u in offline if u.key == key]
        assert len(online_chain) == len(offline_chain) == 4
        for online, file in zip(online_chain, offline_chain, strict=True):
            assert comparable(online) == comparable(file), (key, online.version)
            assert file.watermark == {}  # offline learning reads no offsets
            highest = max(where[t][1] for t in online.stats.trace_ids)
            partition = where[online.stats.trace_ids[0]][0]
            assert online.watermark[partition] >= highest
        # the learning really happened: every lesson of the key, in both
        assert len(online_chain[-1].playbook.sections) > 0
        bullets = sum(len(s.bullets) for s in online_chain[-1].playbook.sections)
        assert bullets == 8
