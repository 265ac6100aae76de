"""The streaming engine end to end: real broker, simulated LLM over real HTTP."""

from __future__ import annotations

import anyio
import pytest
from engine_support import audit, engine_config, lessons_of, produce, wait_until_learned

from combee_stream.config import Config
from combee_stream.engine.runner import Engine
from combee_stream.sim import LatencyModel, SimSettings, generate_traces, sim_server


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
