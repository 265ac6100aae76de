"""``bench saturation``: is the engine limited by the LLM endpoint, and nothing else?

An endpoint that serves at most C calls at once, each taking L seconds, completes at most C/L
calls per second. A trace costs one reflector call plus its share of its window's curator calls
(k/b: k = floor(sqrt(b)) level-1 groups per window of b, no combiner call with the union
combine), so no engine can learn more than ``C / (L * calls_per_trace)`` traces per second.
This suite puts a backlog on a fresh traces topic, runs the full engine (Kafka in, reflect,
shuffle + tree, publish, commit) against the simulator with a constant latency L (no token
terms, no jitter, so L is exact) and concurrency C, and reports the achieved rate over that
bound (``saturation_ratio``), using the calls per trace it actually made.

The simulator runs in its own process (its CPU is not the engine's). Time is compressed per
configuration by min(F, RATE_CAP * L / C), so the real call rate stays at or below RATE_CAP
calls/s, which the engine process sustains on this 2-core machine with room to spare; the
reported rates are in model seconds.
"""

from __future__ import annotations

import math
import time

from msgspec import Struct

from combee_stream.bench.harness import (
    delete_topics,
    engine_config,
    fresh_topics,
    produce_bulk,
    running_engine,
    sim_process,
    watch_engine,
    with_broker,
)
from combee_stream.bench.report import Target, document, table
from combee_stream.config import Config
from combee_stream.kafka.topics import ensure_topics
from combee_stream.sim import LatencyModel, SimSettings, generate_traces

DEFAULT_TIME_SCALE = 20.0
RATE_CAP = 20.0  # real LLM calls per second


class SaturationSettings(Struct, kw_only=True):
    latencies_s: list[float]
    concurrencies: list[int]
    traces_per_slot: int  # traces per unit of C (runs last ~traces_per_slot * 1.2 * L)
    batch_size: int
    keys: int
    partitions: int
    time_scale: float  # F: the most time is compressed
    rate_cap: float
    seed: int


class SaturationRow(Struct, kw_only=True):
    latency_s: float
    concurrency: int
    traces: int
    batch_size: int
    time_scale: float  # the compression this configuration ran at
    llm_calls: int
    calls_per_trace: float
    bound_traces_per_s: float  # C / (L * calls_per_trace)
    achieved_traces_per_s: float  # first trace read -> last version published
    saturation_ratio: float
    wall_s: float  # model seconds, first read -> last publish
    ideal_wall_s: float  # traces * calls_per_trace * L / C: the endpoint busy all along
    lost_latencies: float  # (wall_s - ideal_wall_s) / L: the run's idle time, in calls
    cpu_ms_per_trace: float  # real CPU of the engine process (the simulator excluded)


class SaturationReport(Struct, kw_only=True):
    suite: str = "saturation"
    simulated: bool = True
    latency_model: list[LatencyModel]
    settings: SaturationSettings
    results: list[SaturationRow]
    targets: list[Target]
    notes: list[str]


def saturation_settings(
    *, quick: bool = False, time_scale: float | None = None, seed: int = 0
) -> SaturationSettings:
    return SaturationSettings(
        latencies_s=[1.0, 4.0],
        concurrencies=[4, 16],
        traces_per_slot=20 if quick else 50,
        batch_size=20,
        keys=4,
        partitions=3,
        time_scale=time_scale or DEFAULT_TIME_SCALE,
        rate_cap=RATE_CAP,
        seed=seed,
    )


def bound(concurrency: int, latency_s: float, calls_per_trace: float) -> float:
    return concurrency / (latency_s * calls_per_trace)


def ideal_calls_per_trace(batch_size: int) -> float:
    groups = 1 if batch_size < 4 else math.isqrt(batch_size)
    return 1 + groups / batch_size


async def _one(
    config: Config, s: SaturationSettings, latency_s: float, concurrency: int
) -> SaturationRow:
    scale = min(s.time_scale, s.rate_cap * latency_s / concurrency)
    total = s.traces_per_slot * concurrency
    cfg = fresh_topics(config, "saturation", s.partitions)
    traces = generate_traces(total, s.keys, 5, seed=s.seed)
    await ensure_topics(cfg.kafka)
    try:
        await produce_bulk(cfg.kafka, traces)
        sim = SimSettings(seed=s.seed, latency=LatencyModel(base_s=latency_s), time_scale=scale)
        async with sim_process(sim) as url:
            ecfg = engine_config(
                cfg,
                url,
                concurrency=concurrency,
                batch_size=s.batch_size,
                max_wait_s=latency_s / scale,  # only the last, partial windows wait for it
            )
            cpu = time.process_time()
            async with running_engine(ecfg) as (engine, client):
                limit = 120 + 10 * total * latency_s / concurrency / scale
                progress = await watch_engine(engine.metrics, total, limit)
            cpu = time.process_time() - cpu
            usage = client.usage()
    finally:
        await delete_topics(cfg.kafka)
    calls = sum(u.calls for u in usage.values())
    per_trace = calls / total
    span = (progress.done - progress.first_read) * scale
    achieved = total / span
    ideal = total * per_trace * latency_s / concurrency
    limit_rate = bound(concurrency, latency_s, per_trace)
    return SaturationRow(
        latency_s=latency_s,
        concurrency=concurrency,
        traces=total,
        batch_size=s.batch_size,
        time_scale=scale,
        llm_calls=calls,
        calls_per_trace=per_trace,
        bound_traces_per_s=limit_rate,
        achieved_traces_per_s=achieved,
        saturation_ratio=achieved / limit_rate,
        wall_s=span,
        ideal_wall_s=ideal,
        lost_latencies=(span - ideal) / latency_s,
        cpu_ms_per_trace=1000 * cpu / total,
    )


async def run_saturation(config: Config, settings: SaturationSettings) -> SaturationReport:
    config = await with_broker(config)
    rows = [
        await _one(config, settings, latency_s, concurrency)
        for latency_s in settings.latencies_s
        for concurrency in settings.concurrencies
    ]
    worst = min(rows, key=lambda r: r.saturation_ratio)
    targets = [
        Target(
            name="saturation_ratio (every configuration)",
            target=">= 0.9",
            measured=", ".join(
                f"L={r.latency_s:g}s C={r.concurrency}: {r.saturation_ratio:.2f}" for r in rows
            ),
            met=worst.saturation_ratio >= 0.9,
        )
    ]
    b = settings.batch_size
    notes = [
        "Bound: an endpoint serving at most C calls at once, each taking L seconds, completes "
        "C/L calls/s; a trace costs 1 reflector call + k/b curator calls (k = floor(sqrt(b)) "
        f"groups per window of b; b = {b}: {ideal_calls_per_trace(b):.2f} calls/trace), so "
        "throughput <= C / (L x calls_per_trace). calls_per_trace is the measured one (partial "
        "last windows add a little).",
        "achieved: traces / (last version published - first trace read), the whole run "
        "included. lost L = (wall - ideal wall) / L: the endpoint's idle time in call "
        "latencies. A run cannot avoid about 2 L of it: the last windows are partial, so they "
        "close only after engine.max_wait_s (set to L here) and then need one curator round, "
        "while the endpoint has nothing else to do; bigger runs amortise it (quick runs show "
        "lower ratios for that reason).",
        f"Backlog of traces_per_slot x C traces ({settings.traces_per_slot} x C) over "
        f"{settings.keys} keys and {settings.partitions} partitions, fixed batch size {b}, "
        "pipelined engine, at-least-once mode; the simulator runs in its own process.",
        f"Time compression per configuration: min({settings.time_scale:g}, "
        f"{settings.rate_cap:g} x L / C), so the real call rate stays <= {settings.rate_cap:g}/s; "
        "cpu_ms_per_trace is the engine process's real CPU per trace (Kafka, HTTP client, "
        "learner).",
    ]
    return SaturationReport(
        latency_model=[LatencyModel(base_s=latency) for latency in settings.latencies_s],
        settings=settings,
        results=rows,
        targets=targets,
        notes=notes,
    )


def markdown(report: SaturationReport) -> str:
    s = report.settings
    body = table(
        [
            "L (s)",
            "C",
            "traces",
            "calls/trace",
            "bound (traces/s)",
            "achieved (traces/s)",
            "saturation_ratio",
            "lost L",
            "time scale",
            "engine CPU ms/trace",
        ],
        [
            [
                r.latency_s,
                r.concurrency,
                r.traces,
                f"{r.calls_per_trace:.3f}",
                r.bound_traces_per_s,
                r.achieved_traces_per_s,
                f"{r.saturation_ratio:.2f}",
                f"{r.lost_latencies:.1f}",
                r.time_scale,
                r.cpu_ms_per_trace,
            ]
            for r in report.results
        ],
    )
    preamble = [
        "Latency model: constant L per call (0 s/token, no jitter), L = "
        + " and ".join(f"{m.base_s:g} s" for m in report.latency_model)
        + f"; LLM concurrency C = {' and '.join(str(c) for c in s.concurrencies)}.",
        "Bound = C / (L x calls_per_trace) traces per model second.",
    ]
    return document(
        "Saturation: engine throughput vs the LLM endpoint's bound",
        preamble,
        body,
        report.targets,
        report.notes,
    )


__all__ = [
    "DEFAULT_TIME_SCALE",
    "RATE_CAP",
    "SaturationReport",
    "SaturationRow",
    "SaturationSettings",
    "bound",
    "ideal_calls_per_trace",
    "markdown",
    "run_saturation",
    "saturation_settings",
]
