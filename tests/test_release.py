"""The live canary and automatic rollback on the real broker: agents (the example agent through
the simulator's agent role) ask for production with a session id, the engine scores each
version from the traces they send back, and moves the labels; what the stable agents are
served is checked at every step. Traces are untrusted: forged claims of a version, traces that
name no version and one session's flood do not decide a canary."""

from __future__ import annotations

import itertools
import re

import anyio
import msgspec
import pytest
from engine_support import CANARY_SECRET, SECRETS, engine_config, produce, read_updates

from combee_stream import Engine
from combee_stream.config import Config, GateConfig
from combee_stream.engine.release import Tally, bounds
from combee_stream.evaluation.answerer import Answerer
from combee_stream.kafka.history import PRODUCTION, in_canary, read_history
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.llm import LLMClient
from combee_stream.schemas import Feedback, LabelMove, Trace
from combee_stream.sim import SimSettings, sim_server
from combee_stream.sim.tasks import sim_tasks, task_traces
from combee_stream.tasks.base import Task, is_correct, task_feedback

pytestmark = pytest.mark.anyio
KEY = "sim-k0"
LIVE = GateConfig(
    live_min_samples=10, live_max_looks=3, margin=0.1, confidence=0.9, live_min_sessions=1
)


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


def sessions(
    fraction: float, n: int, *, inside: bool, secret: str | None = CANARY_SECRET
) -> list[str]:
    """``n`` session ids in (or out of) the canary share of KEY, by the split keyed with
    ``secret`` (None: the public, unkeyed hash)."""
    ids = (f"agent-{i}" for i in itertools.count())
    return list(
        itertools.islice(
            (s for s in ids if in_canary(s, fraction, key=KEY, secret=secret) == inside), n
        )
    )


def session_pair(fraction: float) -> tuple[str, str]:
    return sessions(fraction, 1, inside=True)[0], sessions(fraction, 1, inside=False)[0]


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
        session=session,
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
        engine = Engine(cfg, env=SECRETS)
        agent_llm = LLMClient(cfg.llm, env={})
        answerer = Answerer(agent_llm)
        counter = itertools.count()
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            await produce(cfg, teach)
            async with (
                PromptSubscriber(
                    cfg.kafka,
                    keys={KEY},
                    label=PRODUCTION,
                    session=inside,
                    canary_secret=CANARY_SECRET,
                ) as a,
                PromptSubscriber(
                    cfg.kafka,
                    keys={KEY},
                    label=PRODUCTION,
                    session=outside,
                    canary_secret=CANARY_SECRET,
                ) as b,
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
        engine = Engine(cfg, env=SECRETS)
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


def scored(session: str | None, n: int, version: int, score: float) -> Trace:
    """A trace that claims ``version`` and ``score`` (nothing more is needed to write one)."""
    task = sim_tasks(1, 1, 8, start=900 + n)[0]
    return Trace(
        key=KEY,
        trace_id=f"claim-{n}",
        task=task.question,
        output="0",
        prompt_version=version,
        feedback=Feedback(passed=score > 0.5, score=score),
        session=session,
    )


def live_counts(engine: Engine) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for family in engine.metrics.live_traces.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


async def wait_for_move(cfg: Config, word: str, limit_s: float = 60) -> LabelMove:
    with anyio.fail_after(limit_s):
        while True:
            history = await read_history(cfg.kafka, KEY)
            found = [m for m in history.moves if word in m.why]
            if found:
                return found[-1]
            await anyio.sleep(0.3)


@pytest.mark.kafka
async def test_forged_live_traces_do_not_promote_and_stop_the_canary(
    config: Config, unique: str
) -> None:
    """The issue's attack: 24 traces claiming the candidate with score 1 and 24 claiming
    production with score 0, from no session, random sessions, and sessions that the public
    (unkeyed) hash puts in the arm they claim; and ordinary learning traces, which name no
    version. Before, those counted as production v0 samples at 0.0, the forged ones as samples
    too, and the candidate was promoted."""
    gate = msgspec.structs.replace(LIVE, canary=True, canary_fraction=0.1, live_min_sessions=3)
    teach = task_traces(sim_tasks(8, 1, 8))
    assert all(t.prompt_version is None for t in teach)
    public_in = sessions(gate.canary_fraction, 8, inside=True, secret=None)
    public_out = sessions(gate.canary_fraction, 8, inside=False, secret=None)
    async with sim_server(SimSettings(seed=0)) as llm:
        cfg = gated(config, unique, llm.base_url, gate)
        engine = Engine(cfg, env=SECRETS)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            await produce(cfg, teach)
            started = await wait_for_move(cfg, "canary: v")
            candidate = started.to_version
            assert candidate is not None and candidate >= 1
            # A session in the keyed canary arm is served the candidate only by a subscriber
            # holding the canary secret; one without it cannot tell its arm: production.
            [agent] = sessions(gate.canary_fraction, 1, inside=True)
            for held, expected in ((CANARY_SECRET, candidate), (None, None)):
                async with PromptSubscriber(
                    cfg.kafka, keys={KEY}, label=PRODUCTION, session=agent, env={},
                    canary_secret=held,
                ) as sub:  # fmt: skip
                    served = sub.latest(KEY)  # production is v0: no record, None
                    assert (served.version if served else None) == expected
            forged = []
            for i in range(24):
                picks = (
                    (None, f"rand-{i}", public_in[i % 8]),
                    (None, f"rand-{i}", public_out[i % 8]),
                )
                forged.append(scored(picks[0][i % 3], 2 * i, candidate, 1.0))
                forged.append(scored(picks[1][i % 3], 2 * i + 1, 0, 0.0))
            await produce(cfg, forged)
            stop = await wait_for_move(cfg, "canary stopped")
            counts = live_counts(engine)
            engine.stop()
    history = await read_history(cfg.kafka, KEY)
    assert not [m for m in history.moves if "canary passed" in m.why]
    assert history.labels.production == 0  # production never moved to the candidate
    assert stop.label == "candidate" and stop.to_version is None and stop.by.endswith("engine")
    assert "gate.live_max_unattributed = 0.2" in stop.why, stop.why
    found = re.search(
        r"(\d+) of (\d+) scored traces .*\((\d+) forged.*; (\d+) name no session", stop.why
    )
    assert found is not None, stop.why
    untrusted, claimed, forged_n, unattributed = map(int, found.groups())
    assert claimed >= gate.live_min_samples and untrusted > 0.2 * claimed
    assert forged_n >= 1 and unattributed >= 1 and forged_n + unattributed == untrusted
    # Traces that name no version are no sample of v0: every learning trace is counted so.
    assert counts.get("no_version") == len(teach)
    assert counts.get("forged", 0) >= forged_n and counts.get("unattributed", 0) >= unattributed
    assert engine.metrics.gate_reviews.labels("canary", "stopped")._value.get() >= 1


@pytest.mark.kafka
async def test_one_session_cannot_promote_a_candidate(config: Config, unique: str) -> None:
    """Attributable traces (each from a session its arm serves the version it claims) of one
    session per arm: without gate.live_min_sessions they would promote at the first look."""
    gate = msgspec.structs.replace(LIVE, canary=True, canary_fraction=0.5, live_min_sessions=3)
    inside, outside = session_pair(gate.canary_fraction)
    teach = task_traces(sim_tasks(8, 1, 8))
    async with sim_server(SimSettings(seed=0)) as llm:
        cfg = gated(config, unique, llm.base_url, gate)
        engine = Engine(cfg, env=SECRETS)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            await produce(cfg, teach)
            started = await wait_for_move(cfg, "canary: v")
            candidate = started.to_version
            assert candidate is not None
            claims = [
                trace
                for i in range(gate.live_min_samples * gate.live_max_looks)
                for trace in (
                    scored(inside, 2 * i, candidate, 1.0),
                    scored(outside, 2 * i + 1, 0, 0.0),
                )
            ]
            await produce(cfg, claims)
            refused = await wait_for_move(cfg, "canary refused")
            counts = live_counts(engine)
            engine.stop()
    history = await read_history(cfg.kafka, KEY)
    assert not [m for m in history.moves if "canary passed" in m.why]
    assert "gate.live_min_sessions = 3" in refused.why, refused.why
    assert counts.get("sample") == len(claims)  # all attributable: only the sessions were few
