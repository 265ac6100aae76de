"""``bench scaling``: the paper's central comparison, side by side in one run.

The same N synthetic traces (one key; every lesson carried by two traces) are learned by
``sequential`` (windows of one trace), ``naive`` (one curator call per window) and ``combee``
(augmented shuffle + parallel curators + union) at batch sizes 5..80, and by ``combee`` with the
online batch-size controller. The simulated curator's overload model is on: given more distinct
new lessons than its capacity C, it keeps only max(1, C*C/n) of them.

Time: by default on a virtual clock (:mod:`combee_stream.bench.vclock`): the simulator's
latencies are accounted exactly, in model seconds, without sleeping, and the harness's CPU
counts at real speed. ``time_scale=F`` instead sleeps 1/F of every latency for real and
multiplies the measured wall time by F (the harness's CPU time is then multiplied by F too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import anyio
from msgspec import Struct

from combee_stream.bench.report import Target, describe_latency, document, table
from combee_stream.config import Config, LearningConfig
from combee_stream.core.controller import batch_policy
from combee_stream.core.pipeline import KeyPipeline, MemorySink, closed_inbox
from combee_stream.core.playbook import playbook_tokens
from combee_stream.core.scan import ScanParams, plan
from combee_stream.core.versions import KeyChain
from combee_stream.llm import LLMClient
from combee_stream.offline.run import offline_settings
from combee_stream.schemas import Playbook, Source, Trace
from combee_stream.sim import (
    IN_PROCESS_BASE_URL,
    LatencyModel,
    SimSettings,
    generate_traces,
    score,
    sim_app,
    sim_http_client,
    simulated_llm,
)
from combee_stream.wiring import build_learner

# A hosted chat model: 0.5 s to first token, 10k prompt tokens/s, 50 output tokens/s, ±10%.
DEFAULT_LATENCY = LatencyModel(
    base_s=0.5, per_input_token_s=0.0001, per_output_token_s=0.02, jitter=0.1
)
BATCH_SIZES: tuple[int, ...] = (5, 10, 20, 40, 80)
TARGET_BATCH = 40
KEY = "sim-k0"


class ScalingSettings(Struct, kw_only=True):
    traces: int
    lessons: int  # distinct lessons (one key); each carried by traces/lessons traces
    batch_sizes: list[int]
    overload_capacity: int  # C of the simulated curator
    duplication: int  # Combee's p
    concurrency: int  # LLM calls in flight (>= the largest window: the Map is fully parallel)
    clock: str  # "virtual" or "scaled"
    time_scale: float | None  # F when clock == "scaled"
    seed: int
    extra_fan_in: int  # 0 = no extra row; else one combee row at batch 40 with this fan_in


class ScalingRow(Struct, kw_only=True):
    strategy: str
    batch_size: int | str  # "auto" for the controller row
    fan_in: int = 0  # 0 = k = floor(sqrt(n)) groups
    windows: int
    window_sizes: list[int]  # only for the controller row
    wall_s: float  # model seconds
    speedup_vs_sequential: float
    mean_window_s: float
    llm_calls: int
    tokens_in: int
    tokens_out: int
    tokens_vs_sequential: float
    max_curator_items: int
    rounds: int
    lessons_retained: float  # fraction of distinct lessons in the final playbook
    lessons_total: int
    playbook_bullets: int
    playbook_tokens: int
    cpu_s: float  # real CPU seconds of this process during the row


class ScalingReport(Struct, kw_only=True):
    suite: str = "scaling"
    simulated: bool = True
    latency_model: LatencyModel
    settings: ScalingSettings
    results: list[ScalingRow]
    targets: list[Target]
    notes: list[str]


def scaling_settings(
    *,
    quick: bool = False,
    traces: int | None = None,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    time_scale: float | None = None,
    seed: int = 0,
    overload_capacity: int = 16,
    extra_fan_in: int = 8,
) -> ScalingSettings:
    n = traces if traces is not None else (120 if quick else 400)
    return ScalingSettings(
        traces=n,
        lessons=max(1, n // 2),
        batch_sizes=list(batch_sizes),
        overload_capacity=overload_capacity,
        duplication=2,
        concurrency=max(256, *batch_sizes),
        clock="virtual" if time_scale is None else "scaled",
        time_scale=time_scale,
        seed=seed,
        extra_fan_in=extra_fan_in,
    )


class _Run(Struct, kw_only=True):
    playbook: Playbook
    window_sizes: list[int]
    wall_s: float
    cpu_s: float
    window_delays: list[float]
    llm_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    max_curator_items: int = 0
    rounds: int = 0


async def _learn(
    settings: ScalingSettings,
    latency: LatencyModel,
    traces: Sequence[Trace],
    strategy: str,
    batch_size: int | None,  # None = the online controller
    fan_in: int,
) -> _Run:
    """Learn ``traces`` (one key) with the offline pipeline, on a fresh simulator and client."""
    scale = settings.time_scale or 1.0
    app = sim_app(
        SimSettings(
            seed=settings.seed,
            overload=settings.overload_capacity,
            latency=latency,
            time_scale=scale,
        )
    )
    config = Config(
        # Model seconds on the virtual clock: nothing times out here.
        llm=simulated_llm(
            IN_PROCESS_BASE_URL, concurrency=settings.concurrency, timeout_s=3600.0, max_attempts=2
        ),
        learning=LearningConfig(
            strategy=strategy,  # type: ignore[arg-type]
            batch_size=batch_size if batch_size is not None else "auto",
            duplication=settings.duplication,
            fan_in=fan_in,
            seed=settings.seed,
        ),
    )
    items = [(t, Source(trace_id=t.trace_id)) for t in traces]
    sink = MemorySink()
    async with sim_http_client(app) as http:
        llm = LLMClient(config.llm, http_client=http, env={})
        try:
            pipeline = KeyPipeline(
                KeyChain(KEY),
                build_learner(config, llm),
                batch_policy(config.learning, key=KEY),
                sink,
                closed_inbox(items),
                offline_settings(config),
            )
            started, cpu = anyio.current_time(), time.process_time()
            await pipeline.run()
            wall, cpu = anyio.current_time() - started, time.process_time() - cpu
        finally:
            await llm.aclose()
    if sink.parked:
        raise RuntimeError(f"{len(sink.parked)} trace(s) could not be learned: no faults set")
    results = [w.result for w in sink.windows if w.result is not None]
    return _Run(
        playbook=sink.updates[-1].playbook,
        window_sizes=[len(w.items) for w in sink.windows],
        wall_s=wall * scale,
        cpu_s=cpu,
        window_delays=[u.stats.delay_s * scale for u in sink.updates],
        llm_calls=sum(r.stats.llm_calls for r in results),
        tokens_in=sum(r.stats.tokens_in for r in results),
        tokens_out=sum(r.stats.tokens_out for r in results),
        max_curator_items=max(r.stats.max_curator_items for r in results),
        rounds=sum(r.stats.rounds for r in results),
    )


async def run_scaling(
    settings: ScalingSettings, latency: LatencyModel = DEFAULT_LATENCY
) -> ScalingReport:
    """Every row on the same traces. Run it on a :class:`VirtualClockLoop` unless
    ``settings.time_scale`` is set."""
    traces = generate_traces(settings.traces, 1, settings.lessons, seed=settings.seed)
    runs: list[tuple[str, int | None, int]] = [("sequential", 1, 0)]
    for fixed in settings.batch_sizes:
        runs += [("naive", fixed, 0), ("combee", fixed, 0)]
    runs.append(("combee", None, 0))
    if settings.extra_fan_in and TARGET_BATCH in settings.batch_sizes:
        runs.append(("combee", TARGET_BATCH, settings.extra_fan_in))

    rows: list[ScalingRow] = []
    baseline: _Run | None = None
    for strategy, size, fan_in in runs:
        run = await _learn(settings, latency, traces, strategy, size, fan_in)
        baseline = baseline or run
        found = score(traces, {KEY: run.playbook})
        tokens = run.tokens_in + run.tokens_out
        rows.append(
            ScalingRow(
                strategy=strategy,
                batch_size=size if size is not None else "auto",
                fan_in=fan_in,
                windows=len(run.window_sizes),
                window_sizes=run.window_sizes if size is None else [],
                wall_s=run.wall_s,
                speedup_vs_sequential=baseline.wall_s / run.wall_s,
                mean_window_s=sum(run.window_delays) / max(1, len(run.window_delays)),
                llm_calls=run.llm_calls,
                tokens_in=run.tokens_in,
                tokens_out=run.tokens_out,
                tokens_vs_sequential=tokens / (baseline.tokens_in + baseline.tokens_out),
                max_curator_items=run.max_curator_items,
                rounds=run.rounds,
                lessons_retained=found.lessons_retained / max(1, found.lessons_total),
                lessons_total=found.lessons_total,
                playbook_bullets=sum(len(s.bullets) for s in run.playbook.sections),
                playbook_tokens=playbook_tokens(run.playbook),
                cpu_s=run.cpu_s,
            )
        )
    return ScalingReport(
        latency_model=latency,
        settings=settings,
        results=rows,
        targets=_targets(settings, rows),
        notes=_notes(settings, rows),
    )


def find(
    rows: Sequence[ScalingRow], strategy: str, batch: int | str, fan_in: int = 0
) -> ScalingRow:
    for row in rows:
        if (row.strategy, row.batch_size, row.fan_in) == (strategy, batch, fan_in):
            return row
    raise KeyError((strategy, batch, fan_in))


def max_items_bound(n: int, p: int) -> int:
    """The issue's bound on the largest curator input: p * ceil(sqrt(n)) + 1 reflections."""
    return p * math.ceil(math.sqrt(n)) + 1


def _targets(settings: ScalingSettings, rows: Sequence[ScalingRow]) -> list[Target]:
    if TARGET_BATCH not in settings.batch_sizes:
        return []
    b = TARGET_BATCH
    naive, combee = (
        find(rows, "naive", b),
        find(rows, "combee", b),
    )
    bound = max_items_bound(b, settings.duplication)
    return [
        Target(
            name=f"combee speedup at batch {b}",
            target=">= 17x sequential",
            measured=f"{combee.speedup_vs_sequential:.1f}x",
            met=combee.speedup_vs_sequential >= 17,
        ),
        Target(
            name=f"combee time vs naive at batch {b}",
            target="<= 1.5x naive",
            measured=f"{combee.wall_s / naive.wall_s:.2f}x",
            met=combee.wall_s <= 1.5 * naive.wall_s,
        ),
        Target(
            name=f"largest curator input at batch {b}",
            target=f"<= p*ceil(sqrt(n))+1 = {bound} (naive: n = {b})",
            measured=f"combee {combee.max_curator_items}, naive {naive.max_curator_items}",
            met=combee.max_curator_items <= bound,
        ),
        Target(
            name=f"lessons retained at batch {b}",
            target=">= 0.9, naive clearly lower",
            measured=f"combee {combee.lessons_retained:.2f}, naive {naive.lessons_retained:.2f}",
            met=combee.lessons_retained >= 0.9
            and naive.lessons_retained <= combee.lessons_retained - 0.1,
        ),
        Target(
            name=f"total tokens at batch {b}",
            target="<= 1.2x sequential",
            measured=f"{combee.tokens_vs_sequential:.2f}x",
            met=combee.tokens_vs_sequential <= 1.2,
        ),
    ]


def _notes(settings: ScalingSettings, rows: Sequence[ScalingRow]) -> list[str]:
    notes = [
        "wall_s: model seconds from the first window to the last version, one window at a "
        "time (the offline loop of `combee-stream learn`); speedup = sequential wall_s / wall_s.",
        "rounds: sequential LLM rounds (Map + level-1 curators; the union combine costs no LLM "
        "round); llm_calls and tokens count every call (no memo hits in these runs).",
        "max_curator_items: reflections (copies included) in the largest curator call.",
    ]
    if TARGET_BATCH in settings.batch_sizes:
        b = TARGET_BATCH
        seq, combee = find(rows, "sequential", 1), find(rows, "combee", b)
        naive = find(rows, "naive", b)
        notes.append(
            f"Where the time goes: a sequential window (1 trace) takes {seq.mean_window_s:.2f} s, "
            f"a combee window of {b} takes {combee.mean_window_s:.2f} s and a naive one "
            f"{naive.mean_window_s:.2f} s, so the speedup is about {b} x "
            f"{seq.mean_window_s:.2f} / {combee.mean_window_s:.2f}. A level-1 curator of combee "
            f"sees up to {combee.max_curator_items} reflections and writes one ADD per new lesson "
            "in them: its reply, not the reflection round, sets the window time under this "
            "decode-bound latency model (naive's overloaded curator writes fewer ADDs, which is "
            "why it is faster and loses lessons)."
        )
        if settings.extra_fan_in:
            extra = find(rows, "combee", b, settings.extra_fan_in)
            notes.append(
                f"The extra row `combee` with fan_in {settings.extra_fan_in} (learning.fan_in) "
                f"caps every curator call at {settings.extra_fan_in} reflections (more, smaller "
                f"parallel groups): {extra.speedup_vs_sequential:.1f}x, retention "
                f"{extra.lessons_retained:.2f}."
            )
    auto = find(rows, "combee", "auto")
    notes.append(
        f"The controller row explores the grid 5, 10, 20, 40, 80 (one window each), then settles; "
        f"its windows were: {' '.join(str(s) for s in auto.window_sizes)}."
    )
    if settings.clock == "virtual":
        notes.append(
            "Clock: virtual (simulated latencies accounted exactly, without sleeping; the "
            "harness's CPU time counts at real speed, see cpu_s)."
        )
    else:
        notes.append(
            f"Clock: real sleeps compressed {settings.time_scale:g}x, wall times multiplied back; "
            f"the harness's CPU time (cpu_s) is multiplied by {settings.time_scale:g} as well, "
            "which inflates rows with many calls."
        )
    return notes


def markdown(report: ScalingReport) -> str:
    s = report.settings
    headers = [
        "strategy",
        "batch",
        "wall_s",
        "speedup",
        "llm_calls",
        "tokens_in",
        "tokens_out",
        "tokens vs seq",
        "max_curator_items",
        "rounds",
        "lessons_retained",
    ]
    body = table(
        headers,
        [
            [
                r.strategy + (f" (fan_in {r.fan_in})" if r.fan_in else ""),
                r.batch_size,
                r.wall_s,
                f"{r.speedup_vs_sequential:.1f}x",
                r.llm_calls,
                r.tokens_in,
                r.tokens_out,
                f"{r.tokens_vs_sequential:.2f}x",
                r.max_curator_items,
                r.rounds,
                f"{r.lessons_retained:.2f}",
            ]
            for r in report.results
        ],
    )
    clock = "virtual" if s.clock == "virtual" else f"real sleeps / {s.time_scale:g}"
    preamble = [
        f"Latency model: {describe_latency(report.latency_model)} (clock: {clock}).",
        f"{s.traces} traces, one key, {s.lessons} distinct lessons (each in "
        f"{s.traces // s.lessons} traces); curator overload model on, capacity C = "
        f"{s.overload_capacity}; p = {s.duplication}; union combine; LLM concurrency "
        f"{s.concurrency}; seed {s.seed}.",
    ]
    return document(
        "Scaling: sequential vs naive vs combee", preamble, body, report.targets, report.notes
    )


def expected_calls(strategy: str, windows: Sequence[int], duplication: int, fan_in: int) -> int:
    """LLM calls a run must make, from the strategies' definitions (for tests and sanity)."""
    params = ScanParams(duplication=duplication, fan_in=fan_in, single_group=strategy != "combee")
    return sum(n + plan(n, params).groups for n in windows)


def expected_max_items(strategy: str, windows: Sequence[int], duplication: int, fan_in: int) -> int:
    params = ScanParams(duplication=duplication, fan_in=fan_in, single_group=strategy != "combee")
    largest = 0
    for n in windows:
        p = plan(n, params)
        largest = max(largest, math.ceil(n * p.duplication / p.groups))
    return largest


__all__ = [
    "BATCH_SIZES",
    "DEFAULT_LATENCY",
    "ScalingReport",
    "ScalingRow",
    "ScalingSettings",
    "expected_calls",
    "expected_max_items",
    "find",
    "markdown",
    "max_items_bound",
    "run_scaling",
    "scaling_settings",
]
