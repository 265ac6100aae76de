"""The agent SDK against the real broker (prompt refresh, traces with their version and cited
bullets, the snapshot while the broker is down), and the whole loop with the simulator's
agent: its accuracy on held-out tasks rises as the engine publishes versions."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from engine_support import audit, engine_config, read_updates

from combee_stream import Engine
from combee_stream.agent import PromptClient, RunRecorder
from combee_stream.config import BrokerConfig, Config
from combee_stream.evaluation import Answerer, evaluate
from combee_stream.kafka.broker import start_broker, stop_broker
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.reader import read_to_end
from combee_stream.kafka.topics import ensure_topics
from combee_stream.llm import LLMClient
from combee_stream.prompts_cli import seed_prompt
from combee_stream.schemas import DecodeError, Feedback, PromptUpdate, Trace, decode
from combee_stream.sim import SimSettings, sim_server
from combee_stream.sim.tasks import sim_tasks
from combee_stream.tasks import task_feedback


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_prompt_client_follows_versions_and_traces_carry_version_and_citations(
    config: Config, unique: str, tmp_path: Path
) -> None:
    cfg = engine_config(config, unique, "http://127.0.0.1:9/v1")
    await ensure_topics(cfg.kafka)
    await seed_prompt(cfg, "bot", "You are careful.")
    snapshot = tmp_path / "prompt.json"
    async with PromptClient(
        cfg.kafka, "bot", snapshot=snapshot, fallback="fallback", session="agent-1"
    ) as prompts:
        first = prompts.current()
        assert (first.version, first.text, first.source) == (0, "You are careful.", "broker")
        assert snapshot.is_file()
        async with anyio.create_task_group() as tg:

            async def reseed() -> None:
                await anyio.sleep(0.5)
                await seed_prompt(cfg, "bot", "You are very careful.", force=True)

            tg.start_soon(reseed)
            with anyio.fail_after(30):
                second = await prompts.next_version()
        assert (second.version, second.text) == (1, "You are very careful.\n")
        run = RunRecorder(second, "2 + 2?", trace_id="t-1")
        run.thought("add them")
        run.cite("strat-00001", "made-up-id")  # neither is in the prompt: both dropped
        async with TraceProducer(cfg.kafka) as producer:
            sent = await run.send(producer, output="4", feedback=Feedback(passed=True))
    assert sent.prompt_version == 1 and sent.bullet_ids == [] and sent.key == "bot"
    assert sent.session == "agent-1"  # the session it was served to: the live canary checks it
    (record,) = await read_to_end(cfg.kafka, cfg.kafka.traces_topic)
    received = decode(record.value, Trace)
    assert received == sent and [s.kind for s in received.steps] == ["thought"]


def test_a_trace_that_names_no_version_has_none() -> None:
    """``prompt_version`` and ``session`` are optional: absent, they are None (not version 0),
    and a record written before them still decodes."""
    bare = b'{"key": "bot", "trace_id": "t", "task": "x", "feedback": {"passed": true}}'
    assert decode(bare, Trace).prompt_version is None and decode(bare, Trace).session is None
    old = b'{"key": "bot", "trace_id": "t", "task": "x", "feedback": {"passed": true}, '
    assert decode(old + b'"prompt_version": 0}', Trace).prompt_version == 0
    assert decode(old + b'"prompt_version": null}', Trace).prompt_version is None
    with pytest.raises(DecodeError, match=r"\$\.session"):
        decode(old + b'"session": "a\\u2028b"}', Trace)
    with pytest.raises(DecodeError, match="session must be printable"):
        decode(old + b'"session": "a\\u200bb"}', Trace)  # a zero-width space


@pytest.mark.anyio
@pytest.mark.restarts_broker
async def test_prompt_client_serves_the_snapshot_while_the_broker_is_down(
    config: Config, unique: str, tmp_path: Path, kafka_broker: BrokerConfig
) -> None:
    cfg = engine_config(config, unique, "http://127.0.0.1:9/v1")
    await ensure_topics(cfg.kafka)
    await seed_prompt(cfg, "bot", "Version zero.")
    snapshot = tmp_path / "prompt.json"
    async with PromptClient(cfg.kafka, "bot", snapshot=snapshot) as prompts:
        assert prompts.current().source == "broker"
    await anyio.to_thread.run_sync(stop_broker, kafka_broker)
    try:
        async with PromptClient(
            cfg.kafka, "bot", snapshot=snapshot, fallback="bundled", connect_timeout_s=3
        ) as prompts:
            served = prompts.current()
            assert (served.source, served.version, served.text) == ("snapshot", 0, "Version zero.")
        async with PromptClient(
            cfg.kafka, "bot", snapshot=tmp_path / "none.json", fallback="bundled",
            connect_timeout_s=3,
        ) as prompts:  # fmt: skip
            served = prompts.current()
            assert (served.source, served.version, served.text) == ("fallback", -1, "bundled")
    finally:
        await anyio.to_thread.run_sync(start_broker, kafka_broker)


@pytest.mark.anyio
async def test_the_simulated_agent_gets_better_as_the_engine_learns(
    config: Config, unique: str
) -> None:
    """The loop of the README: agent -> traces -> engine -> versions -> agent. The agent works
    in two rounds of four tasks (four lessons each); after each round, its accuracy on held-out
    tasks (the same eight lessons, never the same task) is measured with the newest prompt."""
    key = "sim-k0"
    train = sim_tasks(8, keys=1, lessons=8, seed=3)
    held_out = sim_tasks(16, keys=1, lessons=8, seed=3, start=1000)
    assert {t.question for t in train}.isdisjoint({t.question for t in held_out})
    async with sim_server(SimSettings(seed=3)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=4)
        engine = Engine(cfg)
        accuracy: dict[int, float] = {}
        async with LLMClient(cfg.llm, env={}) as client, anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            answerer = Answerer(client)
            async with PromptClient(cfg.kafka, key) as prompts, TraceProducer(cfg.kafka) as out:
                start = prompts.current()
                first = await evaluate(answerer, start.text, held_out, label="start")
                accuracy[start.version] = first.accuracy
                # each answer keeps its output tokens (what bench quality's floor adds up)
                assert all(o.tokens_out > 0 for o in first.outcomes)
                assert sum(o.tokens_out for o in first.outcomes) == first.tokens_out
                for done, batch in ((4, train[:4]), (8, train[4:])):
                    for task in batch:  # the agent at work: every run becomes a trace
                        prompt = prompts.current()
                        answer = await answerer.answer(prompt.text, task.question)
                        run = RunRecorder(prompt, task.question, trace_id=task.id)
                        run.record(answer)
                        feedback = task_feedback(task, answer.output)
                        await run.send(out, output=answer.output, feedback=feedback)
                    with anyio.fail_after(120):
                        while learned(updates := await read_updates(cfg)) < done:  # noqa: ASYNC110
                            await anyio.sleep(0.2)
                        newest = prompts.current()
                        while newest.version < max(u.version for u in updates):
                            newest = await prompts.next_version()
                    accuracy[newest.version] = (
                        await evaluate(answerer, newest.text, held_out, label=f"v{newest.version}")
                    ).accuracy
            engine.stop()
    updates = await read_updates(cfg)
    result = audit(updates)
    assert result.problems == [] and max(result.learned.values()) == 1
    assert set(result.learned) == {t.id for t in train}
    assert list(accuracy.values()) == [0.0, 0.5, 1.0], accuracy
    assert list(accuracy) == sorted(accuracy)  # measured on newer and newer versions


def learned(updates: list[PromptUpdate]) -> int:
    return max((u.stats.traces_learned for u in updates), default=0)
