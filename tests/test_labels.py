"""History and labels on the real broker: every version kept for kafka.history_versions in the
history topic (written with the prompts topic in one transaction), production served by
label, a rollback to a version the prompts topic no longer holds as its newest, a promotion
back to latest, the audit of every move, and a subscriber started afterwards seeing the same."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from engine_support import engine_config, produce, wait_until_learned
from test_hardening import lesson_trace

from combee_stream import Engine
from combee_stream.config import Config
from combee_stream.kafka.history import PRODUCTION, move_label, read_history
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.sim import SimSettings, sim_server

pytestmark = pytest.mark.kafka


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_production_is_served_by_label_rolled_back_and_promoted(
    config: Config, unique: str
) -> None:
    key = "labelled"
    async with sim_server(SimSettings(seed=1)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=1, max_wait_s=0.2)
        cfg = msgspec.structs.replace(
            cfg, kafka=msgspec.structs.replace(cfg.kafka, history_versions=3)
        )
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            for i in (1, 2, 3):  # one window, one version each
                await produce(cfg, [lesson_trace(key, f"t{i}", f"l{i}", f"rule {i} of the key")])
                await wait_until_learned(cfg, {key: i}, 60)
            history = await read_history(cfg.kafka, key)
            assert sorted(history.versions) == [1, 2, 3]
            async with (
                PromptSubscriber(cfg.kafka, keys={key}, label=PRODUCTION) as production,
                PromptSubscriber(cfg.kafka, keys={key}, label="latest") as latest,
            ):
                first = production.latest(key)
                assert first is not None and first.version == 3, "production follows latest"
                move = await move_label(
                    cfg.kafka, key, PRODUCTION, None, by="ops", why="v3 looks bad", rollback=True
                )
                assert (move.from_version, move.to_version) == (3, 2)
                with anyio.fail_after(30):
                    [served] = [u async for u in _next(production)]
                assert served.version == 2 and served == history.versions[2]
                # The engine goes on learning; production stays where it was put.
                await produce(cfg, [lesson_trace(key, "t4", "l4", "rule 4 of the key")])
                await wait_until_learned(cfg, {key: 4}, 60)
                with anyio.fail_after(30):
                    [newest] = [u async for u in _next(latest)]
                assert newest.version == 4
                await production.poll()
                held = production.latest(key)
                assert held is not None and held.version == 2
                promoted = await move_label(cfg.kafka, key, PRODUCTION, None, by="ops", why="ok")
                assert (promoted.from_version, promoted.to_version) == (2, None)
                with anyio.fail_after(30):
                    [back] = [u async for u in _next(production)]
                assert back.version == 4
            engine.stop()
    # Read again from scratch (a restart): the same labels, history trimmed to the last 3.
    history = await read_history(cfg.kafka, key)
    assert sorted(history.versions) == [2, 3, 4]
    assert history.resolve(PRODUCTION) == 4 and history.labels.production is None
    assert [(m.seq, m.label, m.from_version, m.to_version, m.by, m.why) for m in history.moves] == [
        (1, PRODUCTION, 3, 2, "ops", "v3 looks bad"),
        (2, PRODUCTION, 2, None, "ops", "ok"),
    ], "every move once, with who and why"
    async with PromptSubscriber(cfg.kafka, keys={key}, version=2) as pinned:
        old = pinned.latest(key)
    assert old is not None and old.version == 2, "a pinned version is served from the history"


async def _next(sub: PromptSubscriber):  # type: ignore[no-untyped-def]
    """The next update the subscriber yields (one)."""
    async for update in sub:
        yield update
        return


@pytest.mark.anyio
async def test_in_approval_mode_no_version_reaches_production_without_a_promotion(
    config: Config, unique: str
) -> None:
    key = "approved"
    async with sim_server(SimSettings(seed=1)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=1, max_wait_s=0.2)
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            await produce(cfg, [lesson_trace(key, "t1", "l1", "rule 1 of the key")])
            await wait_until_learned(cfg, {key: 1}, 60)
            on = await move_label(cfg.kafka, key, PRODUCTION, None, by="ops", approval=True)
            assert (on.from_version, on.to_version, on.approval) == (1, 1, True)
            for i in (2, 3):
                await produce(cfg, [lesson_trace(key, f"t{i}", f"l{i}", f"rule {i} of the key")])
                await wait_until_learned(cfg, {key: i}, 60)
            held = await read_history(cfg.kafka, key)
            assert held.newest == 3 and held.resolve(PRODUCTION) == 1, "nothing auto-promoted"
            promoted = await move_label(cfg.kafka, key, PRODUCTION, None, by="ops", why="ok")
            assert promoted.to_version == 3, "a promotion in approval mode pins the newest"
            await produce(cfg, [lesson_trace(key, "t4", "l4", "rule 4 of the key")])
            await wait_until_learned(cfg, {key: 4}, 60)
            engine.stop()
    after = await read_history(cfg.kafka, key)
    assert after.newest == 4 and after.resolve(PRODUCTION) == 3 and after.labels.approval
