"""Memory against keys seen: an engine fed many distinct keys over time, most soon idle.

Waves of new keys (one trace each, one window each) go to one engine with a short
``engine.key_idle_s``; after each wave is published and its keys have had time to go idle, the
suite samples the process's RSS, the number of live key pipelines, the restore index (a few
numbers per key, by design), and the number of series ``/metrics`` exposes. Per-key state
that grows without bound shows as RSS or series climbing with keys seen; what is meant to
grow (the index) is counted apart. The LLM is the simulator served over HTTP in this process
(its own bookkeeping is cleared every second), so RSS is of the engine, its Kafka clients
and the simulator together: compare the slope, not the level.
"""

from __future__ import annotations

import anyio
import msgspec

from combee_stream.bench.harness import (
    engine_config,
    fresh_topics,
    metric_total,
    produce_bulk,
    rss_mb,
    running_engine,
    with_broker,
)
from combee_stream.bench.report import SIMULATED, Target, document, table
from combee_stream.config import Config
from combee_stream.kafka.topics import ensure_topics
from combee_stream.schemas import Feedback, Trace
from combee_stream.sim import LatencyModel, SimSettings, sim_server
from combee_stream.sim.markers import marker_line


class KeysSettings(msgspec.Struct, frozen=True, kw_only=True):
    keys: int = 10_000
    waves: int = 10
    key_idle_s: float = 2.0
    key_metric_series: int = 100
    partitions: int = 3
    concurrency: int = 64
    seed: int = 0


def keys_settings(*, quick: bool, seed: int = 0) -> KeysSettings:
    return KeysSettings(keys=300, waves=3, seed=seed) if quick else KeysSettings(seed=seed)


class KeysSample(msgspec.Struct, frozen=True, kw_only=True):
    keys_seen: int
    versions_published: int
    live_pipelines: int
    index_entries: int
    metric_series: int
    rss_mb: float


class KeysReport(msgspec.Struct, kw_only=True):
    suite: str = "keys"
    simulated: bool = True
    settings: KeysSettings
    samples: list[KeysSample]
    rss_mb_per_1000_keys: float  # slope from the first sample to the last
    targets: list[Target]
    notes: list[str]


def _trace(key: str) -> Trace:
    return Trace(
        key=key,
        trace_id=f"{key}-t0",
        task="A task.",
        feedback=Feedback(passed=False, text=marker_line(f"{key}-l0", f"first rule of {key}")),
    )


async def run_keys(config: Config, settings: KeysSettings) -> KeysReport:
    config = await with_broker(config)
    samples: list[KeysSample] = []
    per_wave = settings.keys // settings.waves
    async with sim_server(SimSettings(seed=settings.seed, latency=LatencyModel(base_s=0.0))) as llm:
        cfg = fresh_topics(config, "keys", settings.partitions)
        cfg = engine_config(
            cfg, llm.base_url, concurrency=settings.concurrency, batch_size=1, max_wait_s=0.2
        )
        cfg = msgspec.structs.replace(
            cfg,
            engine=msgspec.structs.replace(
                cfg.engine,
                key_idle_s=settings.key_idle_s,
                key_metric_series=settings.key_metric_series,
            ),
        )
        await ensure_topics(cfg.kafka)
        async with running_engine(cfg) as (engine, _):
            for wave in range(settings.waves):
                keys = [f"key-{wave * per_wave + i:06d}" for i in range(per_wave)]
                await produce_bulk(cfg.kafka, [_trace(k) for k in keys])
                seen = (wave + 1) * per_wave
                while metric_total(engine.metrics.publish_lag, "_count") < seen:  # noqa: ASYNC110
                    await anyio.sleep(0.2)
                # Idle past key_idle_s (and the sweep's period), with the poll loop turning.
                with anyio.fail_after(60 + settings.key_idle_s * 5):
                    while engine._intake.keys:
                        await produce_bulk(cfg.kafka, [])
                        await anyio.sleep(0.5)
                series = sum(len(family.samples) for family in engine.metrics.registry.collect())
                samples.append(
                    KeysSample(
                        keys_seen=seen,
                        versions_published=int(metric_total(engine.metrics.publish_lag, "_count")),
                        live_pipelines=len(engine._intake.keys),
                        index_entries=sum(len(p.index) for p in engine._partitions.values()),
                        metric_series=series,
                        rss_mb=rss_mb(),
                    )
                )
    first, last = samples[0], samples[-1]
    span = max(1, last.keys_seen - first.keys_seen)
    slope = (last.rss_mb - first.rss_mb) / span * 1000
    targets = [
        Target(
            name="metric series",
            target="bounded (engine.key_metric_series), not growing with keys seen",
            measured=f"{first.metric_series} -> {last.metric_series}",
            met=last.metric_series == first.metric_series,
        ),
        Target(
            name="idle pipelines",
            target="0 once keys are idle for engine.key_idle_s",
            measured=str(max(s.live_pipelines for s in samples)),
            met=all(s.live_pipelines == 0 for s in samples),
        ),
    ]
    notes = [
        "index entries: one KeyIndex (offset, version, watermark) per key with a version; "
        "they are what an idle key costs, and they grow with keys seen by design.",
        "RSS: VmRSS of the one process holding the engine, its Kafka clients and the "
        "in-process simulator; the slope is per 1,000 new keys, first sample to last.",
    ]
    return KeysReport(
        settings=settings, samples=samples, rss_mb_per_1000_keys=slope, targets=targets,
        notes=notes,
    )  # fmt: skip


def markdown(report: KeysReport) -> str:
    s = report.settings
    rows = [
        [x.keys_seen, x.versions_published, x.live_pipelines, x.index_entries, x.metric_series,
         x.rss_mb]
        for x in report.samples
    ]  # fmt: skip
    body = table(
        ["keys seen", "versions", "live pipelines", "index entries", "metric series", "RSS MiB"],
        rows,
    )
    preamble = [
        f"{s.keys:,} distinct keys in {s.waves} waves, one trace (one version) each; "
        f"engine.key_idle_s = {s.key_idle_s:g}, engine.key_metric_series = "
        f"{s.key_metric_series}, {s.partitions} partitions.",
        "Sampled after each wave was published and its keys were evicted.",
        f"RSS growth: {report.rss_mb_per_1000_keys:.2f} MiB per 1,000 keys seen.",
    ]
    return document(
        "Memory against keys seen", preamble, body, report.targets, report.notes, llm=SIMULATED
    )


__all__ = ["KeysReport", "KeysSample", "KeysSettings", "keys_settings", "markdown", "run_keys"]
