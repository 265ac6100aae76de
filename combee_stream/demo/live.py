"""The real-model demo (``combee-stream demo``): the agent works, the engine learns, live.

See :mod:`combee_stream.demo` for the steps. The view is a rich ``Live`` table refreshed as the
agent answers and versions arrive: per prompt version, the agent's runs and how many were right,
the batch size the controller chose for the window that made it, the bullets, and what the
publish gate did with it.

The replay gate is as the config says (off by default; ``COMBEE__GATE__REPLAY=true`` turns it
on). It is not forced on here as in ``demo --sim``: with it on (``DEMO_GATE``, numeric scorer), a
run of this demo on 2026-12-01 held out 6 of its 24 tasks, reached 5 held-out tasks by the end and
refused every window for want of ``min_samples``; a held-out test needs a longer stream than a
demo's. The lesson check (``gate.check_lessons``, :mod:`combee_stream.evaluation.lessons`) is on:
it needs no held-out tasks, and this is the agent it is made for. The base agent misses every
task of the demo's families, so a retried failure that comes right is the bullet's doing, not
chance; and what kept runs at 0 of 20 was a bullet that sounds right and fixes nothing ("use the
correct formula with decimal fractions", no formula), which then stood in for the lessons that
carried the formula. The traces of a run that ended 0 of 20 (seed 656269, 2026-12-06), learned
again offline with the same settings (batch 8, one memo of LLM replies for both): without the
check 0 of 20 again; with it 6 of 20 (+30 points, +8 to +52): it left out the vague CAPM bullet
(0 of 4 fixed) and an operating-income one (0 of 3), and kept "use the formula E(Ri) = Rf + βi *
(ERm - Rf) with the rates as decimal fractions" (2 of 4). Of the demo's own four runs with it,
two (that seed, and 905637) refused every bullet their curators wrote, mostly that CAPM rule
without its formula, and ended 0 of 20 with an empty playbook; two (188646, 699482) refused a
vague rule, kept the CAPM formula rule and ended 4 of 20 (+20). It serves nothing useless; it
cannot make the curator write a rule the agent follows, and this agent follows a worked example
far more often than a rule (docs/demo-runs.md). So worked examples are on
(``learning.worked_examples``): each new bullet ends with the calculation of a failed training
task. The demo's learning replayed offline on two runs' traces: the lesson check alone 2 and 4
of 20, with worked examples 11 and 15 of 20.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Final

import anyio
import msgspec
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from combee_stream.agent import PromptClient, RunRecorder
from combee_stream.config import Config
from combee_stream.demo.common import fresh_kafka, gate_note
from combee_stream.errors import UserError
from combee_stream.evaluation import Answerer, EvalResult, compare, evaluate
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.llm import LLMClient, RoleUsage
from combee_stream.schemas import PromptUpdate
from combee_stream.tasks import KEY, generate_tasks, task_feedback
from combee_stream.wiring import Engine

AGENT_CONCURRENCY = 2  # leaves the model's other slots to the reflector and curator
# The generated families the demo's agent works on: two where Qwen2.5-Coder-1.5B with the base
# prompt misses every task by one convention (a probe of 6 tasks each: operating income from
# amounts in millions answered in millions, 24 for 24000000; the CAPM return asked as a decimal
# answered in percent, 6.184 for 0.0618), and where the feedback names the miss ("off by a
# factor of 1,000,000"), so that a 1.5B reflector turns it into the rule. On the families it
# misses by a convention the feedback cannot name (the dividend discount model priced on the
# dividend just paid, payments needed not rounded up: 0 of 6 each) the same reflector, shown the
# worked reference solution, wrote no right lesson in 8 reflections (the dividend ones repeated
# the agent's own formula), although the rules written by hand took them to 11 of 12.
DEMO_FAMILIES: Final = ("operating_income", "capm_return")


class View:
    """What the live table shows."""

    def __init__(self, model: str, tasks: int) -> None:
        self.model = model
        self.tasks = tasks
        self.phase = "starting"
        self.started = anyio.current_time()
        self.runs: dict[int, list[bool]] = {}  # prompt version -> outcomes of runs with it
        self.versions: dict[int, PromptUpdate] = {}
        self.done = 0

    def render(self) -> Group:
        table = Table(title=f"key {KEY!r}: the agent ({self.model}) and its prompt versions")
        for column in (
            "version",
            "agent runs",
            "right",
            "accuracy",
            "window (batch size)",
            "bullets",
            "newest bullet",
            "publish gate",
        ):
            table.add_column(column, overflow="fold")
        for version in sorted(set(self.runs) | set(self.versions)):
            outcomes = self.runs.get(version, [])
            update = self.versions.get(version)
            bullets = [b for s in update.playbook.sections for b in s.bullets] if update else []
            newest = max(bullets, key=lambda b: b.id).content[:70] if bullets else ""
            table.add_row(
                "base" if version <= 0 else f"v{version}",
                str(len(outcomes)),
                str(sum(outcomes)),
                f"{sum(outcomes) / len(outcomes):.0%}" if outcomes else "-",
                f"{update.stats.window_traces} ({update.stats.batch_size})" if update else "-",
                str(len(bullets)),
                newest,
                gate_note(update).lstrip(",; ") if update else "",
            )
        elapsed = _minutes(anyio.current_time() - self.started)
        status = Panel(
            f"{self.phase}  -  {self.done}/{self.tasks} tasks answered  -  {elapsed} elapsed",
            title="now",
        )
        return Group(status, table)


async def run_live_demo(args: argparse.Namespace, config: Config) -> int:
    console = Console()
    say = console.print
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    families = [f for f in args.families.split(",") if f]
    try:  # generate_tasks names the unknown families and the known ones
        train = generate_tasks(args.tasks, seed=seed, families=families)
    except ValueError as exc:
        raise UserError(f"--families: {exc}") from None
    held_out = generate_tasks(args.held_out, seed=seed + 1, families=families)
    # A run is one draw of a small model's lessons: the seed lets it be drawn again.
    say(
        f"tasks: {len(train)} to learn from and {len(held_out)} held out "
        f"({', '.join(families) or 'all families'}), seed {seed} (--seed {seed} repeats them)"
    )
    async with AsyncExitStack() as stack:
        cfg = await fresh_kafka(config)
        cfg = await _with_model(stack, cfg, args)
        cfg = msgspec.structs.replace(
            cfg,
            # Windows of at least 6 traces, waited for up to 2 minutes: the agent sends one
            # about every 8 s, and with 30 s and 3 a run made 9 windows of one to five traces
            # whose reflect-and-curate rounds, on the model the agent shares, took 35 minutes;
            # with these, 4 windows and 12.5 minutes in all (seed 867212, 2026-12-04; with 60 s
            # and 4, 7 windows and 13.7 minutes).
            engine=msgspec.structs.replace(cfg.engine, metrics_port=0, max_wait_s=120.0),
            gate=msgspec.structs.replace(cfg.gate, check_lessons=True),
            # A small local model learns as bench quality measures it: the reflector reads
            # failures and the successes that cited bullets, and a rule its curator states once
            # per case is merged into one (by the embedding model served beside it).
            learning=msgspec.structs.replace(
                cfg.learning,
                batch_size="auto",
                min_batch_size=6,
                max_batch_size=12,
                reflect_successes="cited",
                merge_similar=0.8 if cfg.llm.embeddings.enabled else 0.0,
                # This agent follows a worked example where it ignores a rule; the demo's
                # tasks are generated, nothing private for an example to carry.
                worked_examples=True,
            ),
        )
        view = View(cfg.llm.agent.model, len(train))
        # The engine's client is the demo's to read after the run (where the time went); the
        # agent's is its own, as an agent's would be.
        engine_llm = await stack.enter_async_context(LLMClient(cfg.llm))
        engine = Engine(cfg, llm=engine_llm)
        llm = await stack.enter_async_context(LLMClient(cfg.llm))
        answerer = Answerer(llm)
        times: dict[str, float] = {"start": anyio.current_time()}
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            with Live(view.render(), console=console, refresh_per_second=2) as live:
                async with (
                    PromptClient(cfg.kafka, KEY) as prompts,
                    TraceProducer(cfg.kafka) as producer,
                    PromptSubscriber(cfg.kafka, keys={KEY}) as versions,
                ):

                    async def follow() -> None:
                        async for update in versions:
                            view.versions[update.version] = update
                            live.update(view.render())

                    async def work() -> None:
                        limiter = anyio.CapacityLimiter(AGENT_CONCURRENCY)

                        async def one(index: int) -> None:
                            task = train[index]
                            async with limiter:
                                prompt = prompts.current()
                                answer = await answerer.answer(prompt.text, task.question)
                            feedback = task_feedback(task, answer.output)
                            run = RunRecorder(prompt, task.question, trace_id=f"{seed}-{task.id}")
                            run.record(answer)
                            await run.send(producer, output=answer.output, feedback=feedback)
                            view.runs.setdefault(max(0, prompt.version), []).append(
                                bool(feedback.passed)
                            )
                            view.done += 1
                            live.update(view.render())

                        async with anyio.create_task_group() as agents:
                            for index in range(len(train)):
                                agents.start_soon(one, index)

                    view.phase = "the agent works; the engine learns from every run"
                    live.update(view.render())
                    before: EvalResult | None = None

                    async def base() -> None:
                        nonlocal before
                        before = await evaluate(answerer, "", held_out, label="base")
                        times["base"] = anyio.current_time()

                    async def learned() -> None:
                        with anyio.move_on_after(600):
                            while _learned(view) < len(train):  # noqa: ASYNC110 - view updated by follow()
                                await anyio.sleep(0.5)
                        times["learned"] = anyio.current_time()

                    async with anyio.create_task_group() as inner:
                        inner.start_soon(follow)
                        await work()
                        times["worked"] = anyio.current_time()
                        # The base arm needs no learned version: it runs beside the engine's
                        # learning of the last runs, whose steps (curators, combiner, lesson
                        # check, one after another) leave some of the model's slots idle.
                        view.phase = (
                            "the engine learns the last runs; the base prompt answers the "
                            f"{len(held_out)} held-out tasks"
                        )
                        live.update(view.render())
                        async with anyio.create_task_group() as tail:
                            tail.start_soon(base)
                            tail.start_soon(learned)
                        inner.cancel_scope.cancel()
                    newest = prompts.current()
                    view.phase = f"v{newest.version} answers the {len(held_out)} held-out tasks"
                    live.update(view.render())
                    after = await evaluate(
                        answerer, newest.text, held_out, label=f"v{newest.version}"
                    )
                    times["after"] = anyio.current_time()
            engine.stop()
    assert before is not None
    paired = compare(before, after)
    say(
        f"\nheld-out ({len(held_out)} tasks, the same agent): base prompt {before.accuracy:.0%} "
        f"(95% CI {before.ci95[0]:.0%}-{before.ci95[1]:.0%}), v{newest.version} "
        f"{after.accuracy:.0%} ({after.ci95[0]:.0%}-{after.ci95[1]:.0%}); gained {paired.only_b}, "
        f"lost {paired.only_a}: difference {paired.difference:+.0%} (paired 95% CI "
        f"{paired.ci95[0]:+.0%} to {paired.ci95[1]:+.0%}), exact McNemar p = {paired.mcnemar_p:.2g}"
    )
    say(_time_note(times, len(train), len(held_out)))
    say(_usage_note(engine_llm.usage(), llm.usage()))
    say(f"\nthe newest prompt (v{newest.version}):\n")
    say(newest.text.strip() or "(empty: no bullet was served)", markup=False)
    say("\nThe broker keeps running: `combee-stream kafka stop` stops it.")
    return 0


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def _time_note(times: dict[str, float], tasks: int, held_out: int) -> str:
    """Where the run's time went, from the engine's start (the model already served)."""
    at = {event: t - times["start"] for event, t in times.items()}
    return (
        f"\ntime: {_minutes(at['after'])} from the engine's start: the agent's "
        f"{tasks} runs ended at {_minutes(at['worked'])}, the engine had learned them at "
        f"{_minutes(at['learned'])} (the base prompt's {held_out} answers alongside, done at "
        f"{_minutes(at['base'])}), the learned prompt's {held_out} answers took "
        f"{_minutes(at['after'] - max(at['learned'], at['base']))}"
    )


def _usage_note(engine: Mapping[str, RoleUsage], demo: Mapping[str, RoleUsage]) -> str:
    """What each role asked of the model: the engine's (its lesson check answers as the agent)
    and the demo's agent, at work and in the before/after."""
    parts = []
    for who, usage in (("engine", engine), ("agent at work and before/after", demo)):
        sent = [
            f"{role} {u.calls - u.cached_calls} ({u.tokens_in / 1000:.1f}k in, "
            f"{u.tokens_out / 1000:.1f}k out)"
            for role, u in usage.items()
            if u.calls > u.cached_calls and role != "embeddings"
        ]
        parts.append(f"{who}: {', '.join(sent) or 'none'}")
    return "model requests (tokens): " + "; ".join(parts)


def _learned(view: View) -> int:
    """Traces the published versions consumed: learned, or held out by the gate."""
    return sum(u.stats.window_traces + len(u.stats.held_out) for u in view.versions.values())


async def _with_model(stack: AsyncExitStack, cfg: Config, args: argparse.Namespace) -> Config:
    """The config's agent endpoint if it has one; else a local model, started here."""
    from combee_stream.localllm import local_model
    from combee_stream.localllm.server import local_llm_config

    configured = cfg.llm.agent.base_url or os.environ.get("OPENAI_BASE_URL")
    if configured and args.model is None:
        return cfg
    # The 1.5B model by default (local_llm.model): the 0.5B one answers none of the generated
    # tasks right with any prompt (0 of 60 in a bench quality run), so it has nothing to learn.
    local = msgspec.structs.replace(cfg.local_llm, model=args.model or cfg.local_llm.model)

    def tell(message: str) -> None:
        print(f"   {message}", flush=True)

    print(
        f"no LLM endpoint configured: serving {local.model} here with llama.cpp "
        "(the first run builds llama-server, about 5-10 min, and fetches the model)",
        flush=True,
    )
    server = await stack.enter_async_context(local_model(local, say=tell))
    return msgspec.structs.replace(cfg, llm=local_llm_config(server, cfg.llm))


__all__ = ["DEMO_FAMILIES", "run_live_demo"]
