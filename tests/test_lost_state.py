"""State that survives, and state that is lost (issue 18, findings 4 and 5), on the real broker.

- The dedup horizon: a trace re-sent after its key was evicted, after a restart and after a
  rebalance is learned once and counted as a duplicate, though its version is no longer the
  key's newest (the horizon is kept on the dedup topic, not only in the newest version).
- A prompts topic deleted under a running engine: reported within seconds, the engine halts
  with that reason and publishes nothing elsewhere; SIGTERM ends it within its grace even while
  a publish waits on the topic that is gone; subscribers say what is missing and back off.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest
import structlog.testing
from aiokafka.admin import AIOKafkaAdminClient
from engine_support import (
    audit,
    engine_config,
    env_for,
    kill,
    produce,
    read_updates,
    spawn_engine,
    wait_until_learned,
)

from combee_stream import Engine
from combee_stream.agent import PromptClient
from combee_stream.config import Config
from combee_stream.core.versions import seed_update
from combee_stream.kafka.producer import make_producer, publish_update
from combee_stream.kafka.reader import read_to_end
from combee_stream.kafka.topics import TopicLostError, ensure_topics
from combee_stream.schemas import Feedback, PromptUpdate, Trace
from combee_stream.sim import SimServer, SimSettings, sim_server
from combee_stream.sim.markers import marker_line


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def lesson(key: str, trace_id: str) -> Trace:
    return Trace(
        key=key,
        trace_id=trace_id,
        task="A task.",
        feedback=Feedback(passed=False, text=marker_line(f"l-{trace_id}", f"rule of {trace_id}")),
    )


def duplicates_of(engine: Engine) -> float:
    return engine.metrics.registry.get_sample_value("combee_traces_duplicate_total") or 0.0


async def resend_and_learn(
    cfg: Config, engine: Engine, resent: Trace, new: Trace, learned: int
) -> None:
    """Re-send a trace of an older version, then a new one: the new one is learned (so the
    re-send was routed before it) and the re-send counted as a duplicate."""
    await produce(cfg, [resent, new])
    await wait_until_learned(cfg, {"ka": learned})
    with anyio.fail_after(30):
        while duplicates_of(engine) < 1:  # noqa: ASYNC110 - a counter the engine sets
            await anyio.sleep(0.1)


@pytest.mark.anyio
async def test_a_resent_trace_is_learned_once_after_an_eviction_a_restart_and_a_rebalance(
    config: Config, unique: str
) -> None:
    traces = [lesson("ka", f"t{i}") for i in range(12)]  # versions 1-4, three traces each
    new = [lesson("ka", f"n{i}") for i in range(3)]
    async with sim_server(SimSettings(seed=1)) as llm:
        cfg = engine_config(config, unique, llm.base_url, partitions=1, batch_size=3)
        cfg = msgspec.structs.replace(
            cfg, engine=msgspec.structs.replace(cfg.engine, key_idle_s=1.0)
        )
        # 1. eviction: the key's pipeline and chain leave memory; t0 (of v1) comes back.
        first = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.run)
            await first.started.wait()
            await produce(cfg, traces)
            before = await wait_until_learned(cfg, {"ka": 12})
            with anyio.fail_after(60):
                while first._intake.keys:  # noqa: ASYNC110 - evicted by the engine's sweep
                    await anyio.sleep(0.2)
            await resend_and_learn(cfg, first, traces[0], new[0], 13)
            first.stop()
        # 2. restart: a new engine of the same group; t1 (of v1) comes back.
        second = Engine(cfg)
        third = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(second.run)
            await second.started.wait()
            await resend_and_learn(cfg, second, traces[1], new[1], 14)
            # 3. rebalance: a second instance joins and the first leaves; the partition is
            # restored by the running one; t2 (of v1) comes back.
            tg.start_soon(third.run)
            await third.started.wait()
            second.stop()
            with anyio.fail_after(60):
                while not (0 in third._partitions and third._partitions[0].restored.is_set()):  # noqa: ASYNC110
                    await anyio.sleep(0.2)
            await resend_and_learn(cfg, third, traces[2], new[2], 15)
            third.stop()
    assert {"t0", "t1", "t2"} <= set(min(before, key=lambda u: u.version).stats.trace_ids)
    result = audit(await read_updates(cfg))
    assert result.problems == [] and max(result.learned.values()) == 1, result.learned
    assert result.final["ka"].stats.traces_learned == 15, "15 distinct traces, each once"
    assert [duplicates_of(e) for e in (first, second, third)] == [1, 1, 1]


def test_the_horizon_is_the_last_ids_learned_in_order_and_bounded() -> None:
    """What is kept with each version: the last ``horizon`` ids the chain's versions learned,
    oldest first, 8 bytes each; restored, it recognises every one of them (and a horizon
    written before the newest version is completed with that version's ids)."""
    from combee_stream.core.versions import (
        DIGEST_BYTES,
        KeyChain,
        trace_digest,
        unpack_digests,
    )
    from combee_stream.schemas import UpdateStats

    def version(n: int, ids: list[str]) -> PromptUpdate:
        base = seed_update("ka", "p", None)
        stats = UpdateStats(traces_learned=n, window_traces=len(ids), trace_ids=ids)
        book = msgspec.structs.replace(base.playbook, version=n)
        return msgspec.structs.replace(base, version=n, playbook=book, stats=stats)

    chain = KeyChain("ka", horizon=5)
    for n, ids in enumerate([["a", "b", "c"], ["d", "e"], ["f", "g"]], 1):
        chain.advance(version(n, ids))
    kept = chain.horizon
    assert len(kept) == 5 * DIGEST_BYTES
    assert list(unpack_digests(kept)) == [trace_digest(t) for t in "cdefg"]
    again = KeyChain("ka", horizon=5)
    restored = again.restore(version(4, ["h"]), kept, covers=3)  # v4 published without it
    assert restored == {trace_digest(t) for t in "defgh"}
    assert all(again.seen(t) for t in "defgh") and not again.seen("a")


# --------------------------------------------------------------------------- a lost topic


async def delete_topic(cfg: Config, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.kafka.bootstrap_servers)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def topic_names(cfg: Config) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.kafka.bootstrap_servers)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def wait_for_line(log: Path, text: str, count: int = 1, limit_s: float = 60) -> None:
    with anyio.fail_after(limit_s):
        while (await anyio.Path(log).read_text()).count(text) < count:  # noqa: ASYNC110
            await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_a_deleted_prompts_topic_halts_the_engine_within_seconds(
    config: Config, unique: str
) -> None:
    """Before: nothing said for the whole broker deadline, /readyz 200, then a halt blaming
    Kafka. Now: within two topic checks, not ready, then one error line naming the topic and
    the recovery, a halt with that reason, and nothing published anywhere meanwhile."""
    traces = [lesson("ka", f"t{i}") for i in range(3)]
    more = [lesson("ka", f"u{i}") for i in range(3)]
    halt_line = "engine halted: a topic was deleted"
    async with sim_server(SimSettings(seed=1)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=3)
        engine = Engine(cfg)
        halted: list[BaseException] = []
        seen: dict[str, float] = {}  # when it was first not ready, when the line was logged

        async def run() -> None:
            try:
                await engine.run()
            except TopicLostError as exc:
                halted.append(exc)

        async def watch(logs: list[dict[str, object]]) -> None:
            health = engine.metrics.health
            while not halted:
                now = anyio.current_time()
                if health.failing["lost_topic"] and not health.ready:
                    seen.setdefault("unready", now)
                if any(line["event"] == halt_line for line in logs):
                    seen.setdefault("reported", now)
                await anyio.sleep(0.02)

        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await engine.started.wait()
                await produce(cfg, traces)
                await wait_until_learned(cfg, {"ka": 3})
                history_before = len(await read_to_end(cfg.kafka, cfg.kafka.history_topic))
                await delete_topic(cfg, cfg.kafka.prompts_topic)
                deleted_at = anyio.current_time()
                tg.start_soon(watch, logs)
                await produce(cfg, more)  # a window that cannot be published anywhere
                with anyio.fail_after(60):
                    while not halted:  # noqa: ASYNC110 - the engine's own halt
                        await anyio.sleep(0.05)
    reported_s = seen["reported"] - deleted_at
    assert reported_s <= 10, f"reported {reported_s:.1f} s after the deletion"
    assert seen["unready"] <= seen["reported"], "/readyz failed first"
    [line] = [line for line in logs if line["event"] == halt_line]
    assert line["topic"] == cfg.kafka.prompts_topic and line["log_level"] == "error"
    [error] = halted
    assert error.topic == cfg.kafka.prompts_topic  # type: ignore[attr-defined]
    assert f"topic {cfg.kafka.prompts_topic!r} was deleted while the engine ran" in str(error)
    assert "kafka.group_id" in str(error) and "prompts set" in str(error)  # how to recover
    assert line["error"] == str(error)
    assert cfg.kafka.prompts_topic not in await topic_names(cfg), "not recreated"
    history_after = len(await read_to_end(cfg.kafka, cfg.kafka.history_topic))
    assert history_after == history_before, "no version went to the history either"


def curator_calls(llm: SimServer) -> int:
    return int(llm.stats()["roles"].get("curator", {}).get("completed", 0))


@pytest.mark.anyio
async def test_sigterm_ends_the_engine_within_its_grace_while_a_publish_waits_on_a_lost_topic(
    config: Config, unique: str, tmp_path: Path
) -> None:
    """The topic check is turned off here, so that nothing but the SIGTERM ends the wait: the
    window's record sits in a batch to a topic that is gone, which never completes, and the
    producer's stop would wait on it for ever. The flush, then the close of every Kafka
    client (all at once, bounded), fit in the grace."""
    traces = [lesson("ka", f"t{i}") for i in range(3)]
    more = [lesson("ka", f"u{i}") for i in range(3)]
    grace_s = 10.0
    async with sim_server(SimSettings(seed=1)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=3)
        log = tmp_path / "engine.log"
        proc = spawn_engine(
            cfg,
            log,
            {
                "COMBEE__ENGINE__SHUTDOWN_GRACE_S": str(grace_s),
                "COMBEE__ENGINE__TOPIC_CHECK_S": "3600",
            },
        )
        try:
            await wait_for_line(log, "partition restored", count=cfg.kafka.partitions)
            await produce(cfg, traces)
            await wait_for_line(log, "version published")
            curated = curator_calls(llm)
            await delete_topic(cfg, cfg.kafka.prompts_topic)
            await produce(cfg, more)
            # The window is curated: its publish follows, and the producer takes the record
            # (it still knows the topic's partitions) into a batch that never completes.
            with anyio.fail_after(60):
                while curator_calls(llm) == curated:  # noqa: ASYNC110 - another process
                    await anyio.sleep(0.05)
            os.killpg(proc.pid, signal.SIGTERM)
            signalled = anyio.current_time()
            with anyio.fail_after(120):
                while proc.poll() is None:  # noqa: ASYNC110 - another process
                    await anyio.sleep(0.05)
            took_s = anyio.current_time() - signalled
        finally:
            kill(proc)
    text = await anyio.Path(log).read_text()
    assert took_s <= grace_s, f"SIGTERM took {took_s:.1f} s: {text[-3000:]}"
    assert "signal received: shutting down" in text


def spawn_subscribe(cfg: Config, out: Path, err: Path) -> subprocess.Popen[bytes]:
    """``combee-stream subscribe`` (following) as a real process."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "combee_stream", "subscribe"],
            env=cli_env(cfg),
            stdout=stdout,
            stderr=stderr,
        )


def cli_env(cfg: Config) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMBEE__")}
    return {**env, **env_for(cfg)}


@pytest.mark.anyio
async def test_subscribers_say_what_is_missing_back_off_and_once_exits_non_zero(
    config: Config, unique: str, tmp_path: Path
) -> None:
    """Before: a running ``subscribe`` spun on metadata requests, silent, for ever, and
    ``--once`` advised creating the topic. Now the follower says which topic is gone and tries
    again with backoff, ``--once`` exits non-zero saying it was deleted, and an agent's
    ``PromptClient`` keeps serving its prompt and knows what is missing."""
    cfg = engine_config(config, unique, "http://127.0.0.1:9/v1")
    await ensure_topics(cfg.kafka)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        await publish_update(producer, cfg.kafka, seed_update("ka", "Be precise.", None))
    finally:
        await producer.stop()
    out, err = anyio.Path(tmp_path / "subscribe.out"), anyio.Path(tmp_path / "subscribe.err")
    follower = spawn_subscribe(cfg, Path(out), Path(err))
    try:
        async with PromptClient(cfg.kafka, "ka", label="latest") as client:
            with anyio.fail_after(60):
                while '"Be precise."' not in await out.read_text():  # noqa: ASYNC110 - a process's output
                    await anyio.sleep(0.1)
            assert client.current().text == "Be precise." and client.missing is None
            await delete_topic(cfg, cfg.kafka.prompts_topic)
            deleted_at = anyio.current_time()
            gone = f"topic {cfg.kafka.prompts_topic!r} no longer exists: it was deleted"
            with anyio.fail_after(30):
                while gone not in await err.read_text() or client.missing is None:  # noqa: ASYNC110 - a process's output
                    await anyio.sleep(0.1)
            reported_s = anyio.current_time() - deleted_at
            assert client.missing == cfg.kafka.prompts_topic
            assert client.current().text == "Be precise.", "it keeps serving what it had"
            assert follower.poll() is None, "the follower backs off and waits"
            with anyio.fail_after(60):
                while "trying again in" not in await err.read_text():  # noqa: ASYNC110 - a process's output
                    await anyio.sleep(0.1)
    finally:
        follower.kill()
        follower.wait(timeout=30)
    assert reported_s <= 10, f"reported {reported_s:.1f} s after the deletion"
    with anyio.fail_after(120):
        once = await anyio.run_process(
            [sys.executable, "-m", "combee_stream", "subscribe", "--once"],
            env=cli_env(cfg),
            check=False,
        )
    stderr_once = once.stderr.decode()
    ours = [line for line in stderr_once.splitlines() if line.startswith("combee-stream:")]
    assert once.returncode == 2 and len(ours) == 1, stderr_once[-2000:]
    assert f"topic {cfg.kafka.prompts_topic!r} does not exist" in ours[0]
    assert "it was deleted (then the engine's state is lost" in ours[0]
    assert "Traceback" not in stderr_once
