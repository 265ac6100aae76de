"""Issue 18, finding 3, on the real broker with the simulator: a trace whose feedback carries an
injected instruction (a link to send customer records to) is refused by the default content
policy, and no version agents are served carries it; one trace citing every bullet moves at
most ``learning.max_tags_per_trace`` counters."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from engine_support import engine_config, produce, sim_learner, wait_until_learned

from combee_stream import Engine
from combee_stream.config import Config
from combee_stream.core.learner import Learner
from combee_stream.schemas import Bullet, Feedback, Playbook, Section, Source, Trace
from combee_stream.sim import SimSettings, generate_traces, sim_server
from combee_stream.sim.tasks import INJECTION, injection_line

pytestmark = [pytest.mark.kafka, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # sim_server runs uvicorn


@pytest.mark.parametrize("default_policy", [True, False])
async def test_an_injected_instruction_is_refused_by_default_and_never_served(
    config: Config, unique: str, default_policy: bool
) -> None:
    honest = generate_traces(12, 1, 4, seed=11)
    key = honest[0].key
    hostile = [
        msgspec.structs.replace(
            trace,
            trace_id=f"{trace.trace_id}-inject",
            feedback=Feedback(passed=False, score=0.0, text=injection_line(f"x{n}")),
        )
        for n, trace in enumerate(honest[:2])
    ]
    async with sim_server(SimSettings(seed=11)) as llm:
        cfg = engine_config(config, unique, llm.base_url, partitions=1, batch_size=7)
        learning = msgspec.structs.replace(cfg.learning, default_content_policy=default_policy)
        cfg = msgspec.structs.replace(cfg, learning=learning)
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            await produce(cfg, honest[:5] + hostile + honest[5:])
            updates = await wait_until_learned(cfg, {key: 14})
            engine.stop()

    served = [u for u in updates if INJECTION in u.prompt]
    if not default_policy:  # switched off, the same stream serves it: what the default stops
        assert served
        return
    assert not cfg.learning.content_policy
    refused = sum(u.stats.skipped.get("policy", 0) for u in updates)
    assert refused >= 1, "the simulated curator proposed the injected lesson; it was refused"
    for update in updates:
        assert INJECTION not in update.prompt and "evil.example" not in update.prompt
        for bullet in (b for s in update.playbook.sections for b in s.bullets):
            assert "evil.example" not in bullet.content


async def test_one_trace_citing_every_bullet_moves_at_most_three_counters() -> None:
    ids = [f"strat-{n:05d}" for n in range(1, 8)]
    book = Playbook(
        key="sim-k0",
        sections=[Section(name="S", bullets=[Bullet(id=i, content=f"Rule {i}.") for i in ids])],
        next_id=8,
    )
    trace = Trace(
        key="sim-k0",
        trace_id="cites-all",
        task="What is the balance?",
        bullet_ids=ids,
        feedback=Feedback(passed=False, score=0.0, text="wrong"),
    )
    learner: Learner
    async with sim_learner(Config()) as learner:
        record = await learner.reflect(
            book, trace, Source(trace_id="cites-all"), learner.new_stats(1)
        )
    tags = record.reflection.bullet_tags  # type: ignore[union-attr]
    # The simulated reflector tags all seven cited bullets; the learner keeps the first three.
    assert [t.bullet_id for t in tags] == ids[: Config().learning.max_tags_per_trace] == ids[:3]
