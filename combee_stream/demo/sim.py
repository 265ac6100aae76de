"""``demo --sim``: the quick demo against the project's simulated LLM (no model to build), the
publish gate on (``DEMO_GATE``) and a tenth of the later traces hostile."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import AsyncExitStack
from typing import Any

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer

from combee_stream.config import Config, GateConfig
from combee_stream.demo.common import fresh_kafka, gate_note, say
from combee_stream.kafka.client import client_kwargs
from combee_stream.kafka.dlq import H_ERROR
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.prompts_cli import seed_prompt
from combee_stream.sim import LatencyModel, SimSettings, sim_server, simulated_llm
from combee_stream.sim.tasks import INJECTION, sim_tasks, task_traces
from combee_stream.wiring import Engine

# The demo's publish gate: small held-out samples (a demo stream is short), a wide margin.
DEMO_GATE = GateConfig(replay=True, holdout_fraction=0.3, min_samples=6, margin=0.2, scorer="exact")
# The key of its held-out choice, unless the environment has one: the demo's topics are its own
# and new, and a fixed key gives the same output on every run. A deployment sets its own.
DEMO_HOLDOUT_SECRET = "combee-stream demo, not a deployment's key"


async def run_sim_demo(args: argparse.Namespace, config: Config) -> int:
    say("1. the simulated-LLM demo (no real model: every number below is simulated)")
    cfg = await fresh_kafka(config)
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
                        gate = update.stats.gate
                        if gate is not None and not gate.split:  # a split's are not blamed
                            pruned += len(gate.pruned)
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
            f"the gate left out {pruned} new bullet(s) blamed for held-out tasks they got wrong"
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


__all__ = ["DEMO_GATE", "DEMO_HOLDOUT_SECRET", "run_sim_demo"]
