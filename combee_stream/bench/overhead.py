"""``bench overhead``: what the engine costs on top of reading Kafka, and whether its memory
stays bounded under a backlog.

For each backlog size, a fresh topic is filled with that many traces, then read from the start
twice, each time by a process of its own (:mod:`combee_stream.bench.worker`): a bare aiokafka
consumer that decodes every record, and the full engine with the simulator in process at zero
latency (so the LLM costs nothing but its client and server code). Reported: traces/s of both and
their ratio, CPU ms per trace, and the peak RSS of each process. The engine's intake is bounded
(``engine.queue_size`` traces buffered, then partitions pause), so its peak memory should not
grow with the backlog; two backlog sizes show whether it does.
"""

from __future__ import annotations

import sys

import anyio
import msgspec
from msgspec import Struct

from combee_stream.bench.harness import (
    delete_topics,
    engine_config,
    fresh_topics,
    produce_bulk,
    with_broker,
)
from combee_stream.bench.report import Target, document, table
from combee_stream.bench.worker import WorkerJob, WorkerResult
from combee_stream.config import Config
from combee_stream.errors import UserError
from combee_stream.kafka.topics import ensure_topics
from combee_stream.sim import IN_PROCESS_BASE_URL, LatencyModel, generate_traces


class OverheadSettings(Struct, kw_only=True):
    backlogs: list[int]
    keys: int
    lessons_per_key: int
    batch_size: int
    concurrency: int
    queue_size: int
    partitions: int
    seed: int


class OverheadRow(Struct, kw_only=True):
    backlog: int
    reader: str  # "bare consumer" | "engine"
    traces_per_s: float  # real seconds
    cpu_ms_per_trace: float
    peak_rss_mb: float
    baseline_rss_mb: float
    memo_entries: int


class OverheadReport(Struct, kw_only=True):
    suite: str = "overhead"
    simulated: bool = True
    latency_model: LatencyModel
    settings: OverheadSettings
    results: list[OverheadRow]
    engine_vs_bare: dict[str, float]  # backlog -> engine traces/s / bare traces/s
    targets: list[Target]
    notes: list[str]


def overhead_settings(*, quick: bool = False, seed: int = 0) -> OverheadSettings:
    return OverheadSettings(
        backlogs=[2_000, 8_000] if quick else [25_000, 100_000],
        keys=8,
        lessons_per_key=20,
        batch_size=40,
        concurrency=16,
        queue_size=1000,
        partitions=3,
        seed=seed,
    )


async def _worker(job: WorkerJob) -> WorkerResult:
    command = [
        sys.executable,
        "-m",
        "combee_stream.bench.worker",
        msgspec.json.encode(job).decode(),
    ]
    result = await anyio.run_process(command, check=False)
    if result.returncode != 0:
        raise UserError(
            f"overhead worker ({job.reader}) failed with exit {result.returncode}:\n"
            + result.stderr.decode(errors="replace")[-2000:]
        )
    return msgspec.json.decode(result.stdout.strip().splitlines()[-1], type=WorkerResult)


def _row(backlog: int, r: WorkerResult) -> OverheadRow:
    return OverheadRow(
        backlog=backlog,
        reader="engine" if r.reader == "engine" else "bare consumer",
        traces_per_s=r.traces_per_s,
        cpu_ms_per_trace=1000 * r.cpu_s / max(1, r.count),
        peak_rss_mb=r.peak_rss_mb,
        baseline_rss_mb=r.baseline_rss_mb,
        memo_entries=r.memo_entries,
    )


async def run_overhead(config: Config, settings: OverheadSettings) -> OverheadReport:
    config = await with_broker(config)
    rows: list[OverheadRow] = []
    for backlog in settings.backlogs:
        cfg = fresh_topics(config, "overhead", settings.partitions)
        # The simulator runs inside the engine's worker process, at zero latency.
        cfg = engine_config(
            cfg,
            IN_PROCESS_BASE_URL,
            concurrency=settings.concurrency,
            batch_size=settings.batch_size,
            max_wait_s=cfg.engine.max_wait_s,
            queue_size=settings.queue_size,
            seed=settings.seed,
        )
        await ensure_topics(cfg.kafka)
        try:
            traces = generate_traces(
                backlog, settings.keys, settings.lessons_per_key, seed=settings.seed
            )
            await produce_bulk(cfg.kafka, traces)
            del traces
            for reader in ("bare", "engine"):
                job = WorkerJob(reader=reader, config=cfg, count=backlog)
                rows.append(_row(backlog, await _worker(job)))
        finally:
            await delete_topics(cfg.kafka)
    ratios = {}
    for backlog in settings.backlogs:
        bare = next(r for r in rows if r.backlog == backlog and r.reader == "bare consumer")
        eng = next(r for r in rows if r.backlog == backlog and r.reader == "engine")
        ratios[str(backlog)] = eng.traces_per_s / bare.traces_per_s
    engines = sorted((r for r in rows if r.reader == "engine"), key=lambda r: r.backlog)
    small, big = engines[0], engines[-1]
    growth = big.peak_rss_mb - small.peak_rss_mb
    per_10k = growth / max(1, big.backlog - small.backlog) * 10_000
    targets = [
        Target(
            name="engine peak memory flat in the backlog",
            target=f"peak RSS at {big.backlog:,} ~ at {small.backlog:,} (within 10%)",
            measured=f"{small.peak_rss_mb:.0f} -> {big.peak_rss_mb:.0f} MiB "
            f"({growth:+.0f} MiB, {per_10k:+.1f} MiB per 10k traces)",
            met=growth <= 0.1 * small.peak_rss_mb,
        )
    ]
    notes = [
        f"{settings.keys} keys, {settings.lessons_per_key} lessons per key, fixed batch size "
        f"{settings.batch_size}, LLM concurrency {settings.concurrency}, engine.queue_size "
        f"{settings.queue_size}; {settings.partitions} partition(s); at-least-once mode.",
        "traces/s in real seconds: bare, from the seek to the start of the topic to the last "
        "record decoded; engine, from its first record read to the last trace learned and "
        "published. CPU = user + system time of the reading process over the same span (for "
        "the engine it includes the in-process simulator's code). Peak RSS = VmHWM of the "
        "reading process.",
        "memo entries: completions the engine's LLM client keeps in memory (bounded by "
        "llm.memo_max_entries). The in-process simulator's own per-request bookkeeping is "
        "cleared every second: it is not the engine's memory.",
    ]
    return OverheadReport(
        latency_model=LatencyModel(),
        settings=settings,
        results=rows,
        engine_vs_bare=ratios,
        targets=targets,
        notes=notes,
    )


def markdown(report: OverheadReport) -> str:
    body = table(
        [
            "backlog",
            "reader",
            "traces/s",
            "CPU ms/trace",
            "peak RSS (MiB)",
            "RSS before reading (MiB)",
            "memo entries",
        ],
        [
            [
                r.backlog,
                r.reader,
                r.traces_per_s,
                r.cpu_ms_per_trace,
                r.peak_rss_mb,
                r.baseline_rss_mb,
                r.memo_entries,
            ]
            for r in report.results
        ],
    )
    ratio = table(
        ["backlog", "engine / bare consumer (traces/s)"],
        [[int(k), f"{v:.3f}"] for k, v in report.engine_vs_bare.items()],
    )
    preamble = [
        "Latency model: zero (simulator in process): only code is measured.",
        "Each reader runs in its own process; times are real seconds.",
    ]
    return document(
        "Overhead: the engine vs a bare Kafka consumer",
        preamble,
        body + "\n\n" + ratio,
        report.targets,
        report.notes,
    )


__all__ = [
    "OverheadReport",
    "OverheadRow",
    "OverheadSettings",
    "markdown",
    "overhead_settings",
    "run_overhead",
]
