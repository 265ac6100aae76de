"""``bench gate``: what the replay gate buys and costs over a stream with poisoned traces.

One stream, learned twice in one run, once without a gate and once with the replay gate: a key's
traces arrive at a fixed rate through the key pipeline (the loop the engine runs, in process),
against the simulator over HTTP with a constant latency per call. The traces are failed runs of
simulated tasks, each with its ground truth and the lesson the task needs; a share of them,
after the first fifth of the stream, carry a wrong rule for their lesson instead (poison: a
bullet carrying it makes every task of that lesson fail). Every published version is then
scored on a fixed evaluation set of other tasks of the same lessons, by the simulated agent
(through a second, latency-free simulator: the measurement costs the run nothing).

Reported per run:

- **worse than the best earlier**: the share of the time since the first version during which
  the version served (the newest: production follows latest without a gate, and a refused
  candidate never becomes a version's content) scores below the best version served before it;
- accuracy of the final version and the time-weighted mean accuracy;
- **cost**: LLM calls by role (the gate's are the ``agent`` calls), and the ratio of all calls to
  the ungated run's;
- **latency**: trace-to-production (read to the publication of a version whose content includes
  the window's lessons) at p50 / p95, and the window's close-to-publish delay, against the
  bound of the gate's review (one round of agent calls, ``ceil(n / gate.concurrency)`` x L).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Awaitable, Callable
from typing import Final

import anyio
import msgspec
from msgspec import Struct, field

from combee_stream.bench.report import SIMULATED, Target, document, percentile, table
from combee_stream.config import Config, GateConfig, LearningConfig
from combee_stream.core.controller import batch_policy
from combee_stream.core.pipeline import KeyPipeline, MemorySink, Pending, PipelineSettings, Window
from combee_stream.core.versions import KeyChain
from combee_stream.evaluation.answerer import Answerer
from combee_stream.evaluation.run import evaluate
from combee_stream.llm import LLMClient
from combee_stream.schemas import PromptUpdate, Source, Trace
from combee_stream.sim import LatencyModel, SimSettings, sim_server, simulated_llm
from combee_stream.sim.tasks import sim_tasks, task_traces
from combee_stream.wiring import build_learner

KEY: Final = "sim-k0"
# The key of the held-out choice: fixed, so that every run of the benchmark holds out the same
# traces (a deployment's comes from its environment, gate.holdout_secret_env).
BENCH_HOLDOUT_SECRET: Final = "combee-stream bench gate held-out key"


class GateBenchSettings(Struct, frozen=True, kw_only=True):
    lessons: int = 24
    traces: int = 480
    poison_share: float = 0.15  # of the traces after the first fifth
    rate_per_s: float = 40.0
    batch_size: int = 12
    latency_s: float = 0.05  # per simulated LLM call
    eval_tasks: int = 48
    gate: GateConfig = field(
        default_factory=lambda: GateConfig(replay=True, holdout_fraction=0.2, min_samples=20)
    )
    seed: int = 0


def gate_settings(*, quick: bool, seed: int) -> GateBenchSettings:
    if quick:
        return GateBenchSettings(
            lessons=12, traces=180, eval_tasks=24, rate_per_s=60.0, seed=seed,
            gate=GateConfig(replay=True, holdout_fraction=0.25, min_samples=16),
        )  # fmt: skip
    return GateBenchSettings(seed=seed)


class GateRun(Struct, kw_only=True):
    gate: str  # "none" or "replay"
    versions: int
    refused: int
    deferred: int  # versions published while too few tasks were held out (lessons waiting)
    final_accuracy: float
    best_accuracy: float
    mean_accuracy: float  # time-weighted over the run, from the first version
    worse_share: float  # of that time, served a version worse than the best earlier one
    poisoned_versions: int  # versions whose prompt carries a poison bullet
    # Versions that score below the version they extend by more than the gate's margin on the
    # evaluation set: what the gate promises not to publish.
    regressions: int
    llm_calls: dict[str, int]
    trace_to_production_p50_s: float
    trace_to_production_p95_s: float
    window_delay_mean_s: float
    traces_refused: int  # learned-and-rejected (their window was refused)
    wall_s: float


class GateReport(Struct, kw_only=True):
    suite: str = "gate"
    simulated: bool = True
    settings: GateBenchSettings
    runs: list[GateRun]
    calls_ratio: float  # all LLM calls, gated / ungated
    review_bound_s: float  # one round of agent calls for a full test set
    targets: list[Target] = []
    notes: list[str] = []


def stream(s: GateBenchSettings) -> tuple[list[Trace], set[str]]:
    tasks = sim_tasks(s.traces, 1, s.lessons, seed=0)
    rng = random.Random(s.seed)
    late = [t.id for t in tasks[s.traces // 5 :]]
    poisoned = set(rng.sample(late, round(s.poison_share * len(late))))
    return task_traces(tasks, poisoned=poisoned), poisoned


async def run_gate(config: Config, s: GateBenchSettings) -> GateReport:
    traces, _ = stream(s)
    eval_set = sim_tasks(s.eval_tasks, 1, s.lessons, seed=0, start=100_000)
    scores: dict[str, float] = {}
    runs = []
    latency = LatencyModel(base_s=s.latency_s)
    async with (
        sim_server(SimSettings(seed=0, latency=latency)) as learning_sim,
        sim_server(SimSettings(seed=0)) as measuring_sim,
    ):
        judge = LLMClient(simulated_llm(measuring_sim.base_url, config.llm), env={})
        try:
            answerer = Answerer(judge)

            async def accuracy(prompt: str) -> float:
                if prompt not in scores:
                    result = await evaluate(answerer, prompt, eval_set, label="v", concurrency=16)
                    scores[prompt] = result.accuracy
                return scores[prompt]

            for gate in (GateConfig(), s.gate):
                runs.append(await _run(config, s, gate, traces, learning_sim.base_url, accuracy))
        finally:
            await judge.aclose()
    plain, gated = runs
    total = [sum(r.llm_calls.values()) for r in runs]
    bound = math.ceil(s.gate.reservoir_size / s.gate.concurrency) * s.latency_s
    report = GateReport(
        settings=s,
        runs=runs,
        calls_ratio=total[1] / max(1, total[0]),
        review_bound_s=bound,
    )
    report.targets = [
        Target(
            name="no version worse than the one it extends (beyond the margin)",
            target="0 with the gate",
            measured=f"{gated.regressions} (without the gate: {plain.regressions})",
            met=gated.regressions == 0,
        ),
        Target(
            name="time served worse than the best earlier version",
            target="lower with the gate",
            measured=f"{gated.worse_share:.1%} vs {plain.worse_share:.1%} without",
            met=gated.worse_share < plain.worse_share,
        ),
    ]
    report.notes = [
        "Accuracy is the simulated agent's on the evaluation tasks: right if and only if the "
        "prompt carries the task's lesson and no poison for it. It measures which lessons a "
        "version carries, not what a real model would make of them.",
        "With the gate, held-out traces are not learned, and while fewer than gate.min_samples "
        "tasks are held out the gate defers: a window's lessons wait for the next review (its "
        "traces reach production with the first version that passes, which the latency "
        "figures count).",
        "What the replay gate cannot see: a poison bullet for a lesson the key has not learned "
        "yet breaks no task the current version answers (both fail it), so it is published; "
        "it then keeps the right lesson from helping when it comes (the versions with poison "
        "in the gated run are these). Live traces that cite such a bullet and fail tag it "
        "harmful, and consolidation drops it; this stream has no live traces.",
    ]
    return report


class TimedSink(MemorySink):
    """Keeps every version and when it was published."""

    def __init__(self) -> None:
        super().__init__()
        self.published_at: list[float] = []

    async def publish(self, chain: KeyChain, update: PromptUpdate, window: Window) -> bool:
        self.published_at.append(anyio.current_time())
        return await super().publish(chain, update, window)


async def _run(
    config: Config,
    s: GateBenchSettings,
    gate: GateConfig,
    traces: list[Trace],
    base_url: str,
    accuracy: Callable[[str], Awaitable[float]],
) -> GateRun:
    cfg = Config(
        llm=simulated_llm(base_url, config.llm),
        learning=LearningConfig(seed=0),
        gate=msgspec.structs.replace(gate, scorer="exact"),
    )
    llm = LLMClient(cfg.llm, env={})
    sink = TimedSink()
    published_at = sink.published_at
    try:
        learner = build_learner(cfg, llm, env={gate.holdout_secret_env: BENCH_HOLDOUT_SECRET})
        send, recv = anyio.create_memory_object_stream[Pending](len(traces))
        pipeline = KeyPipeline(
            KeyChain(KEY), learner, batch_policy(cfg.learning, key=KEY, batch_size=s.batch_size),
            sink, recv,
            PipelineSettings(max_wait_s=2.0),
        )  # fmt: skip
        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipeline.run)
            for i, trace in enumerate(traces):
                send.send_nowait(Pending(trace, Source(trace.trace_id, 0, i), anyio.current_time()))
                await anyio.sleep(1 / s.rate_per_s)
            send.close()
        ended = anyio.current_time()
        usage = {role: u.calls - u.cached_calls for role, u in llm.usage().items()}
    finally:
        await llm.aclose()
    values = [await accuracy(u.prompt) for u in sink.updates]
    times = [*published_at, ended]
    worse = weighted = best = 0.0
    for i, value in enumerate(values):
        span = times[i + 1] - times[i]
        weighted += value * span
        if i and value < best:
            worse += span
        best = max(best, value)
    served = ended - published_at[0] if published_at else 0.0
    to_production: list[float] = []
    refused = versions_refused = deferred = 0
    waiting: list[float] = []  # read times of deferred windows' traces: their lessons wait
    for update, window, at in zip(sink.updates, sink.windows, published_at, strict=True):
        learned = set(update.stats.trace_ids)
        read = [item.read_at for item in window.items if item.source.trace_id in learned]
        if update.stats.rejection is not None and update.stats.rejection.kind == "gate":
            refused += len(learned) + len(waiting)
            versions_refused += 1
            waiting = []  # the pending operations were in the refused candidate
            continue
        if update.stats.deferred:
            # Too few held-out tasks: the window's reviewed operations wait for the next
            # review, so its traces reach production with the next version that passes.
            deferred += 1
            waiting += read
            continue
        to_production += [at - r for r in [*waiting, *read]]
        waiting = []
    delays = [u.stats.delay_s for u in sink.updates]
    return GateRun(
        gate="replay" if gate.replay else "none",
        versions=len(sink.updates),
        refused=versions_refused,
        deferred=deferred,
        final_accuracy=values[-1] if values else 0.0,
        best_accuracy=max(values, default=0.0),
        mean_accuracy=weighted / served if served else 0.0,
        worse_share=worse / served if served else 0.0,
        poisoned_versions=sum(1 for u in sink.updates if "poison." in u.prompt),
        regressions=sum(1 for a, b in itertools.pairwise(values) if b < a - s.gate.margin),
        llm_calls=dict(sorted(usage.items())),
        trace_to_production_p50_s=percentile(to_production, 0.5),
        trace_to_production_p95_s=percentile(to_production, 0.95),
        window_delay_mean_s=sum(delays) / len(delays) if delays else 0.0,
        traces_refused=refused,
        wall_s=ended - started,
    )


def markdown(report: GateReport) -> str:
    s = report.settings
    rows = [
        [
            r.gate, r.versions, r.refused, r.deferred, r.regressions, r.poisoned_versions,
            f"{r.worse_share:.1%}",
            r.final_accuracy, r.mean_accuracy, r.best_accuracy,
            " ".join(f"{k}={v}" for k, v in r.llm_calls.items()),
            r.trace_to_production_p50_s, r.trace_to_production_p95_s, r.window_delay_mean_s,
            r.traces_refused,
        ]
        for r in report.runs
    ]  # fmt: skip
    body = table(
        [
            "gate", "versions", "refused", "deferred", "regressions", "versions with poison",
            "time worse than best earlier",
            "final acc.", "mean acc.", "best acc.", "LLM calls (paid)", "trace→production p50 s",
            "p95 s", "window delay mean s", "traces refused",
        ],
        rows,
    )  # fmt: skip
    preamble = [
        f"{s.traces} traces of one key over {s.lessons} lessons at {s.rate_per_s:g}/s, "
        f"{s.poison_share:.0%} of those after the first fifth poisoned; windows of "
        f"{s.batch_size}; simulated latency {s.latency_s:g} s per call.",
        f"Gate: replay, holdout {s.gate.holdout_fraction:g}, reservoir {s.gate.reservoir_size}, "
        f"min {s.gate.min_samples} tasks, margin {s.gate.margin:g} at {s.gate.confidence:g}.",
        f"LLM calls, gated / ungated: {report.calls_ratio:.2f}. Bound of one review "
        f"(ceil({s.gate.reservoir_size} / {s.gate.concurrency}) x {s.latency_s:g} s): "
        f"{report.review_bound_s:.2f} s.",
        f"Evaluation: {s.eval_tasks} other tasks of the same lessons, simulated agent.",
    ]
    return document("Publish gate under poisoned traces", preamble, body, report.targets,
                    report.notes, llm=SIMULATED)  # fmt: skip


__all__ = ["GateBenchSettings", "GateReport", "GateRun", "gate_settings", "markdown", "run_gate"]
