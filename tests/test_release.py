"""The live canary and automatic rollback on the real broker: agents (the example agent through
the simulator's agent role) ask for production with a session id, the engine scores each
version from the traces they send back, and moves the labels; what the stable agents are
served is checked at every step."""

from __future__ import annotations

import itertools
import re

import anyio
import msgspec
import pytest
from engine_support import engine_config, produce, read_updates

from combee_stream.agent.answerer import Answerer
from combee_stream.config import Config, GateConfig
from combee_stream.core.llm import LLMClient
from combee_stream.engine import Engine
from combee_stream.engine.release import Tally, bounds
from combee_stream.kafka.history import PRODUCTION, in_canary, read_history
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.schemas import Feedback, LabelMove, Trace
from combee_stream.sim import SimSettings, sim_server
from combee_stream.sim.tasks import sim_tasks, task_traces
from combee_stream.tasks.base import Task, is_correct, task_feedback

pytestmark = pytest.mark.anyio
KEY = "sim-k0"
LIVE = GateConfig(live_min_samples=10, live_max_looks=3, margin=0.1, confidence=0.9)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_welch_bounds() -> None:
    good, bad = Tally(), Tally()
    for i in range(20):
        good.add(1.0 if i % 10 else 0.0)
        bad.add(0.0 if i % 10 else 1.0)
    _, high = bounds(bad, good, 1.645)
    assert high < 0 < good.mean - bad.mean
    same = Tally(10, 10.0, 10.0)
    assert bounds(same, same, 1.645) == (0.0, 0.0)


def session_pair(fraction: float) -> tuple[str, str]:
    ids = (f"agent-{i}" for i in itertools.count())
    inside = next(s for s in ids if in_canary(s, fraction))
    outside = next(s for s in ids if not in_canary(s, fraction))
    return inside, outside


def gated(config: Config, unique: str, url: str, gate: GateConfig) -> Config:
    cfg = engine_config(config, unique, url, batch_size=8, max_wait_s=1.0)
    return msgspec.structs.replace(
        cfg, gate=gate, learning=msgspec.structs.replace(cfg.learning, seed=0)
    )


def live_trace(task: Task, session: str, n: int, version: int, output: str) -> Trace:
    return Trace(
        key=KEY,
        trace_id=f"live-{session}-{n}",
        task=task.question,
        output=output,
        prompt_version=version,
        feedback=task_feedback(task, output),
        metadata={"session": session},
    )


def samples_of(move: LabelMove) -> int:
    found = re.search(r"\(n=(\d+)\)", move.why)
    assert found is not None, move.why
    return int(found.group(1))


@pytest.mark.kafka
async def test_the_canary_promotes_a_good_candidate_and_refuses_a_poisoned_one(
    config: Config, unique: str
) -> None:
    gate = msgspec.structs.replace(LIVE, canary=True, canary_fraction=0.5)
    inside, outside = session_pair(gate.canary_fraction)
    tasks = sim_tasks(16, 1, 8)  # lessons l000-l007, twice
    teach, poison = task_traces(tasks[:8]), task_traces(tasks[8:], poisoned={t.id for t in tasks})
    served_outside: list[int] = []
    async with sim_server(SimSettings(seed=0)) as llm:
        cfg = gated(config, unique, llm.base_url, gate)
        engine = Engine(cfg)
        agent_llm = LLMClient(cfg.llm, env={})
        answerer = Answerer(agent_llm)
        counter = itertools.count()
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            await produce(cfg, teach)
            async with (
                PromptSubscriber(cfg.kafka, keys={KEY}, label=PRODUCTION, session=inside) as a,
                PromptSubscriber(cfg.kafka, keys={KEY}, label=PRODUCTION, session=outside) as b,
            ):
                versions = {}

                async def round_of_work() -> None:
                    batch = []
                    for session, sub in ((inside, a), (outside, b)):
                        await sub.poll()
                        served = sub.latest(KEY)
                        prompt, version = (served.prompt, served.version) if served else ("", 0)
                        versions[version] = prompt
                        if session == outside:
                            served_outside.append(version)
                            assert "poison." not in prompt, f"production served v{version}"
                        for task in tasks[:8][next(counter) % 2 :: 2]:
                            answer = await answerer.answer(prompt, task.question)
                            batch.append(
                                live_trace(task, session, next(counter), version, answer.output)
                            )
                    await produce(cfg, batch)

                async def moves_why(word: str) -> list[LabelMove]:
                    history = await read_history(cfg.kafka, KEY)
                    return [m for m in history.moves if word in m.why]

                with anyio.fail_after(150):
                    while not await moves_why("canary passed"):
                        await round_of_work()
                        await anyio.sleep(0.3)
                    await produce(cfg, poison)
                    while not await moves_why("canary refused"):
                        await round_of_work()
                        await anyio.sleep(0.3)
                    # The refused line is reverted: a version from production's playbook.
                    while True:
                        updates = [u for u in await read_updates(cfg) if u.key == KEY]
                        if any(u.stats.reverted_to is not None for u in updates):
                            break
                        await round_of_work()
                        await anyio.sleep(0.3)
            engine.stop()
        await agent_llm.aclose()
    history = await read_history(cfg.kafka, KEY)
    by_version = {u.version: u for u in updates}
    passed = [m for m in history.moves if "canary passed" in m.why and m.label == PRODUCTION]
    refused = [m for m in history.moves if "canary refused" in m.why]
    assert passed and refused
    for move in passed:  # only clean versions reached production, each on enough samples
        assert move.to_version is not None
        assert "poison." not in by_version[move.to_version].prompt
        assert samples_of(move) >= gate.live_min_samples
    assert samples_of(refused[-1]) >= gate.live_min_samples
    assert "poison." in by_version[refused[-1].from_version or 0].prompt  # the bad one
    reverted = next(u for u in updates if u.stats.reverted_to is not None)
    assert "poison." not in reverted.prompt
    assert max(served_outside) >= 1  # the stable agents got the promoted version
    assert history.labels.production is not None
    assert "poison." not in by_version[history.labels.production].prompt


@pytest.mark.kafka
async def test_a_live_regression_rolls_production_back(config: Config, unique: str) -> None:
    gate = msgspec.structs.replace(LIVE, rollback=True)
    tasks = sim_tasks(8, 1, 8)
    async with sim_server(SimSettings(seed=0)) as llm:
        cfg = gated(config, unique, llm.base_url, gate)
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            async with PromptSubscriber(
                cfg.kafka, keys={KEY}, label=PRODUCTION, session="agent-x"
            ) as agents:
                await produce(cfg, task_traces(tasks))
                with anyio.fail_after(60):
                    while (agents.latest(KEY) or _none).version < 1:
                        await agents.poll()
                # Agents do well with v1 ...
                good = [
                    msgspec.structs.replace(
                        live_trace(t, "agent-x", i, 1, t.answer),
                        feedback=Feedback(passed=True, score=1.0),
                    )
                    for i, t in enumerate(tasks * 2)
                ]
                await produce(cfg, good[:12])
                with anyio.fail_after(60):
                    while (agents.latest(KEY) or _none).version < 2:
                        await agents.poll()
                # ... and badly with what production serves next (an injected regression).
                regressed = (agents.latest(KEY) or _none).version
                assert all(is_correct(t, t.answer) for t in tasks)
                bad = [
                    msgspec.structs.replace(
                        live_trace(t, "agent-x", 100 + i, regressed, "0"),
                        feedback=Feedback(passed=False, score=0.0),
                    )
                    for i, t in enumerate(tasks * 2)
                ]
                await produce(cfg, bad[:12])
                with anyio.fail_after(60):
                    async for update in agents:
                        if update.version == 1:
                            break  # production moved back: agents get the previous prompt
            engine.stop()
    history = await read_history(cfg.kafka, KEY)
    [move] = [m for m in history.moves if m.label == PRODUCTION]
    assert move.by == "combee-stream engine" and move.to_version == 1
    assert "rollback" in move.why and samples_of(move) >= gate.live_min_samples
    assert history.labels.production == 1


class _None:
    version = 0


_none = _None()
