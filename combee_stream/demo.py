"""``combee-stream demo``: the whole loop on this machine, with a simulated LLM.

Starts the local broker, creates the topics, seeds a prompt, starts the simulated LLM and the
engine, sends synthetic traces (and one bad record), and prints what an agent would see: the
bad record's DLQ reason and every new prompt version as it is published.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer

from combee_stream.config import Config
from combee_stream.engine import Engine
from combee_stream.kafka.broker import start_broker
from combee_stream.kafka.client import client_kwargs
from combee_stream.kafka.dlq import H_ERROR
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.kafka.topics import ensure_topics
from combee_stream.prompts_cli import seed_prompt
from combee_stream.sim import LatencyModel, SimSettings, generate_traces, sim_server, simulated_llm


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "demo", help="run the whole loop locally: broker, simulated LLM, engine, traces, prompts"
    )
    parser.add_argument("--traces", type=int, default=60, help="synthetic traces to send")
    parser.add_argument("--keys", type=int, default=2)
    parser.add_argument("--lessons", type=int, default=12, help="distinct lessons per key")
    parser.set_defaults(handler=_demo)


def say(text: str) -> None:
    print(text, flush=True)


async def _demo(args: argparse.Namespace, config: Config) -> int:
    say("1. starting the local Kafka broker (first run downloads the jars with Maven)")
    bootstrap = await anyio.to_thread.run_sync(start_broker, config.broker)
    kafka = msgspec.structs.replace(config.kafka, bootstrap_servers=bootstrap)
    say(f"   broker ready at {bootstrap}")
    say("2. creating topics")
    for topic, state in (await ensure_topics(kafka)).items():
        say(f"   {topic}: {state}")

    traces = generate_traces(args.traces, args.keys, args.lessons, seed=7)
    keys = sorted({t.key for t in traces})
    # A fresh group per run, so every run learns its own traces from the start of the topic.
    run_id = f"demo-{anyio.current_time():.0f}"
    kafka = msgspec.structs.replace(kafka, group_id=run_id)
    cfg = msgspec.structs.replace(config, kafka=kafka)

    settings = SimSettings(seed=7, latency=LatencyModel(base_s=0.3, per_output_token_s=0.002))
    async with sim_server(settings) as llm:
        say(f"3. simulated LLM (not a real model) at {llm.base_url}")
        cfg = msgspec.structs.replace(
            cfg,
            llm=simulated_llm(llm.base_url, cfg.llm),
            engine=msgspec.structs.replace(cfg.engine, metrics_port=0),
        )
        say(f"4. seeding a prompt for {keys[0]}")
        try:
            await seed_prompt(cfg, keys[0], "You are a careful back-office agent.")
        except Exception as exc:  # already seeded by an earlier demo run
            say(f"   (kept the existing prompt: {exc})")

        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            async with PromptSubscriber(kafka, keys=set(keys)) as prompts:
                for update in prompts.snapshot().values():
                    say(f"   subscriber sees {update.key} v{update.version} (seed)")
                say(f"5. sending {len(traces)} traces over {len(keys)} keys, and one bad record")
                async with TraceProducer(kafka) as producer:
                    await producer.send_raw(keys[0], b'{"key": "' + keys[0].encode() + b'"}')
                    for trace in traces:
                        await producer.send(trace)
                await _show_dead_letter(kafka)
                say("6. prompt versions as the engine publishes them:")
                learned = {k: 0 for k in keys}
                want = {k: sum(t.key == k for t in traces) for k in keys}
                with anyio.move_on_after(180):
                    async for update in prompts:
                        learned[update.key] = update.stats.traces_learned
                        bullets = sum(len(s.bullets) for s in update.playbook.sections)
                        say(
                            f"   {update.key} v{update.version}: +{update.stats.window_traces} "
                            f"traces (total {update.stats.traces_learned}), {bullets} bullets"
                        )
                        if all(learned[k] >= want[k] for k in keys):
                            break
            engine.stop()
        newest = prompts.latest(keys[0])
        if newest is not None:
            say(f"7. the newest prompt of {newest.key} (v{newest.version}):\n")
            say(newest.prompt)
    say("\nThe broker keeps running: `combee-stream kafka stop` stops it.")
    return 0


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
