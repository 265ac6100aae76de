"""``combee-stream demo``: the whole loop on this machine, with a REAL model and no API key.

1. the local Kafka broker and fresh topics (every run learns from scratch);
2. an LLM: the config's agent endpoint if one is set, else a local model served here by
   llama.cpp (``llm serve``; the first run builds it: say so, show progress);
3. the engine, with the batch-size controller (and, in ``--sim``, the replay gate: ``DEMO_GATE``);
4. the example agent at work on generated finance problems: every task is answered with the
   current prompt of key ``finance`` and sent back as a trace with the environment's feedback;
5. live in the terminal (rich): accuracy of the agent per prompt version, the batch size the
   controller chose, the playbook growing;
6. at the end, before/after on held-out tasks: the base prompt against the newest one, paired.

``demo --sim`` is the quick demo against the project's simulated LLM (no model to build).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer

from combee_stream.config import Config, GateConfig
from combee_stream.engine import Engine
from combee_stream.kafka.broker import start_broker
from combee_stream.kafka.client import client_kwargs
from combee_stream.kafka.dlq import H_ERROR
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.kafka.topics import ensure_topics
from combee_stream.logs import configure_logging
from combee_stream.prompts_cli import seed_prompt
from combee_stream.schemas import PromptUpdate
from combee_stream.sim import LatencyModel, SimSettings, sim_server, simulated_llm
from combee_stream.sim.tasks import INJECTION, sim_tasks, task_traces


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "demo",
        help="the whole loop locally: broker, a real local model (or --sim), engine, an agent",
    )
    parser.add_argument("--sim", action="store_true", help="the quick simulated-LLM demo")
    parser.add_argument("--tasks", type=int, default=24, help="tasks the agent works on")
    # 30: with fewer, the paired interval of a real gain spans zero (12 gave +-28 points).
    parser.add_argument("--held-out", type=int, default=30, help="tasks of the before/after")
    parser.add_argument("--model", default=None, help="local model (default: local_llm.model)")
    parser.add_argument("--seed", type=int, default=None, help="task seed (default: random)")
    # the simulated demo
    parser.add_argument("--traces", type=int, default=120, help="--sim: synthetic traces to send")
    parser.add_argument("--keys", type=int, default=2, help="--sim: keys")
    # Six lessons a key: the gate's held-out tasks (about 18 a key) then cover every lesson, so
    # a wrong rule for any case meets a task it breaks. With 12, one case in five had no
    # held-out task and its poison passed the gate (what a replay gate can and cannot see).
    parser.add_argument("--lessons", type=int, default=6, help="--sim: distinct lessons per key")
    parser.set_defaults(handler=_demo)


def say(text: str) -> None:
    print(text, flush=True)


async def _demo(args: argparse.Namespace, config: Config) -> int:
    with engine_logs(config):
        if args.sim:
            return await _sim_demo(args, config)
        from combee_stream.live_demo import run_live_demo

        return await run_live_demo(args, config)


@contextlib.contextmanager
def engine_logs(config: Config) -> Iterator[Path]:
    """The engine's (and the clients') log lines into a file the demo names, not between its
    own lines; the process's logging is put back afterwards."""
    folder = Path(config.broker.state_dir).parent
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "demo.log"
    with path.open("w") as out:
        configure_logging(config.log.level, to=out)
        say(f"(engine logs: {path})")
        try:
            yield path
        finally:
            configure_logging(config.log.level, config.log.format)


async def _fresh_kafka(config: Config) -> Config:
    say("starting the local Kafka broker (the first run downloads its jars with Maven)")
    bootstrap = await anyio.to_thread.run_sync(start_broker, config.broker)
    run = f"demo.{uuid.uuid4().hex[:8]}"
    kafka = msgspec.structs.replace(
        config.kafka,
        bootstrap_servers=bootstrap,
        traces_topic=f"{run}.traces",
        prompts_topic=f"{run}.prompts",
        history_topic=f"{run}.history",
        dlq_topic=f"{run}.dlq",
        group_id=run,
    )
    say(f"   broker ready at {bootstrap}; topics {run}.*")
    await ensure_topics(kafka)
    return msgspec.structs.replace(config, kafka=kafka)


# The demo's publish gate: small held-out samples (a demo stream is short), a wide margin.
DEMO_GATE = GateConfig(replay=True, holdout_fraction=0.3, min_samples=6, margin=0.2, scorer="exact")
# The key of its held-out choice, unless the environment has one: the demo's topics are its own
# and new, and a fixed key gives the same output on every run. A deployment sets its own.
DEMO_HOLDOUT_SECRET = "combee-stream demo, not a deployment's key"


async def _sim_demo(args: argparse.Namespace, config: Config) -> int:
    say("1. the simulated-LLM demo (no real model: every number below is simulated)")
    cfg = await _fresh_kafka(config)
    kafka = cfg.kafka
    # Failed runs of simulated tasks with their ground truth. A tenth of the later ones are
    # hostile: half carry a wrong rule (poison) that the publish gate must keep out of the
    # prompts, half an instruction injected into the feedback (a link to send customer data
    # to) that the default content policy must refuse.
    tasks = sim_tasks(args.traces, args.keys, args.lessons, seed=7)
    late = tasks[len(tasks) // 2 :]
    hostile = [t.id for t in late[:: max(1, len(late) // 6)]]
    traces = task_traces(tasks, seed=7, poisoned=set(hostile[::2]), injected=set(hostile[1::2]))
    keys = sorted({t.key for t in traces})
    settings = SimSettings(seed=7, latency=LatencyModel(base_s=0.3, per_output_token_s=0.002))
    async with AsyncExitStack() as stack:
        llm = await stack.enter_async_context(sim_server(settings))
        say(f"2. simulated LLM (not a real model) at {llm.base_url}")
        cfg = msgspec.structs.replace(
            cfg,
            llm=simulated_llm(llm.base_url, cfg.llm),
            engine=msgspec.structs.replace(cfg.engine, metrics_port=0),
            gate=DEMO_GATE,
        )
        say(
            f"   publish gate on: {DEMO_GATE.holdout_fraction:.0%} of the traces held out, each "
            "candidate answered on them beside the version it extends"
        )
        say(f"3. seeding a prompt for {keys[0]}")
        await seed_prompt(cfg, keys[0], "You are a careful back-office agent.")
        engine = Engine(cfg, env={DEMO_GATE.holdout_secret_env: DEMO_HOLDOUT_SECRET, **os.environ})
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            async with PromptSubscriber(kafka, keys=set(keys)) as prompts:
                for update in prompts.snapshot().values():
                    say(f"   subscriber sees {update.key} v{update.version} (seed)")
                say(f"4. sending {len(traces)} traces over {len(keys)} keys, and one bad record")
                async with TraceProducer(kafka) as producer:
                    await producer.send_raw(keys[0], b'{"key": "' + keys[0].encode() + b'"}')
                    for trace in traces:
                        await producer.send(trace)
                await _show_dead_letter(kafka)
                say("5. prompt versions as the engine publishes them:")
                learned = dict.fromkeys(keys, 0)
                refused = pruned = 0
                want = {k: sum(t.key == k for t in traces) for k in keys}
                with anyio.move_on_after(180):
                    async for update in prompts:
                        refused += update.stats.skipped.get("policy", 0)
                        if update.stats.gate is not None:
                            pruned += len(update.stats.gate.pruned)
                        learned[update.key] += update.stats.window_traces + len(
                            update.stats.held_out
                        )
                        bullets = sum(len(s.bullets) for s in update.playbook.sections)
                        say(
                            f"   {update.key} v{update.version}: +{update.stats.window_traces} "
                            f"traces (total {update.stats.traces_learned}), {bullets} bullets"
                            f"{gate_note(update)}"
                        )
                        if all(learned[k] >= want[k] for k in keys):
                            break
            engine.stop()
        say(
            f"   the content policy refused {refused} proposed bullet(s) carrying an injection; "
            f"the gate left out {pruned} new bullet(s) cited on held-out tasks they broke"
        )
        newest = prompts.latest(keys[0])
        if newest is not None:
            say(f"6. the prompt agents of {newest.key} are served (v{newest.version}):\n")
            say(newest.prompt)
            served = [
                line
                for line in newest.prompt.splitlines()
                if "poison." in line or "inject." in line or INJECTION in line
            ]
            say(
                f"\nhostile bullets in the served prompt: {len(served)}"
                + ("" if not served else " (the gate's held-out tasks missed their cases)")
            )
    say("\nThe broker keeps running: `combee-stream kafka stop` stops it.")
    return 0


def gate_note(update: PromptUpdate) -> str:
    """What the publish gate did with a version, in a few words (for the demos)."""
    stats = update.stats
    held = f", {len(stats.held_out)} held out" if stats.held_out else ""
    if stats.rejection is not None:
        return f"{held}; refused: {getattr(stats.rejection, 'reason', stats.rejection.kind)}"
    if stats.gate is not None:
        g = stats.gate
        left = (
            f", left out {len(g.pruned)} new bullet(s) cited on wrong answers" if g.pruned else ""
        )
        return f"{held}; gate passed ({g.current:.0%} -> {g.candidate:.0%} on {g.n} tasks{left})"
    return held


async def _show_dead_letter(kafka: Any) -> None:
    consumer = AIOKafkaConsumer(
        kafka.dlq_topic,
        **client_kwargs(kafka),
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        with anyio.move_on_after(30):
            while True:
                batches = await consumer.getmany(timeout_ms=500)
                for records in batches.values():
                    record = records[-1]
                    reason = dict(record.headers)[H_ERROR].decode()
                    say(f"   DLQ: offset {record.offset}: {reason}")
                    return
    finally:
        await consumer.stop()
    print("   (no DLQ record seen in 30 s)", file=sys.stderr)


__all__ = ["register"]
