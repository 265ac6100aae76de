"""One measurement of ``bench overhead`` in a process of its own, so that its peak RSS and CPU
time are its own: ``python -m combee_stream.bench.worker '<WorkerJob JSON>'`` prints one
``WorkerResult`` JSON line.

- ``bare``: an aiokafka consumer that reads the topic from the start and decodes every record
  into a Trace: the floor any Kafka consumer in Python pays.
- ``engine``: the full engine (windows, reflect, shuffle + tree, publish, commit) with the
  simulator in process at zero latency, so only the engine's own work is measured.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Literal

import anyio
import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from combee_stream.bench.harness import metric_total, running_engine
from combee_stream.config import Config
from combee_stream.kafka.client import client_kwargs, partitions_of
from combee_stream.logs import configure_logging
from combee_stream.schemas import Trace, decode
from combee_stream.sim import SimApp, SimSettings, sim_app, sim_http_client


class WorkerJob(msgspec.Struct, kw_only=True):
    reader: Literal["bare", "engine"]
    config: Config
    count: int
    limit_s: float = 1800.0


class WorkerResult(msgspec.Struct, kw_only=True):
    reader: str
    count: int
    wall_s: float  # first record read -> last one decoded / learned and published
    traces_per_s: float
    cpu_s: float  # process CPU (user + system) over the same span
    baseline_rss_mb: float  # peak RSS before reading (interpreter, imports, clients)
    peak_rss_mb: float
    memo_entries: int = 0  # completions the engine's LLM client keeps in memory


def _peak_rss_mb() -> float:
    """Peak RSS of this process's own address space (VmHWM). Not ru_maxrss: Linux carries the
    parent's RSS at fork into the child's ru_maxrss across exec."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: best effort


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def bare(job: WorkerJob) -> WorkerResult:
    kafka = job.config.kafka
    consumer = AIOKafkaConsumer(
        **client_kwargs(kafka), group_id=None, enable_auto_commit=False, max_poll_records=500
    )
    await consumer.start()
    try:
        topic = kafka.traces_topic
        tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        baseline = _peak_rss_mb()
        seen = 0
        # The clock starts before the first fetch: the consumer prefetches in the background.
        started, cpu = anyio.current_time(), _cpu()
        with anyio.fail_after(job.limit_s):
            while seen < job.count:
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for record in records:
                        decode(record.value, Trace)
                        seen += 1
        wall = anyio.current_time() - started
        return WorkerResult(
            reader="bare",
            count=seen,
            wall_s=wall,
            traces_per_s=seen / wall,
            cpu_s=_cpu() - cpu,
            baseline_rss_mb=baseline,
            peak_rss_mb=_peak_rss_mb(),
        )
    finally:
        await consumer.stop()


async def _forget_requests(app: SimApp, every_s: float = 1.0) -> None:
    """The simulator remembers every request it served (stats, attempt counts): not the
    engine's memory, so it is cleared regularly (harmless without faults or jitter)."""
    while True:
        await anyio.sleep(every_s)
        app.reset()


async def engine(job: WorkerJob) -> WorkerResult:
    # job.config points every role at IN_PROCESS_BASE_URL (bench.harness.engine_config).
    app = sim_app(SimSettings(seed=job.config.learning.seed))
    config = job.config
    async with sim_http_client(app) as http, anyio.create_task_group() as tg:
        tg.start_soon(_forget_requests, app)
        async with running_engine(config, http_client=http) as (runner, client):
            baseline = _peak_rss_mb()
            started = cpu = 0.0
            with anyio.fail_after(job.limit_s):
                while metric_total(runner.metrics.trace_to_publish, "_count") < job.count:
                    if not started and metric_total(runner.metrics.traces_in, "_total"):
                        started, cpu = anyio.current_time(), _cpu()
                    await anyio.sleep(0.02)
            wall = anyio.current_time() - started
            cpu = _cpu() - cpu
            memo_entries = len(client.memo)
        tg.cancel_scope.cancel()  # the engine is closed: stop _forget_requests
    return WorkerResult(
        reader="engine",
        count=job.count,
        wall_s=wall,
        traces_per_s=job.count / wall,
        cpu_s=cpu,
        baseline_rss_mb=baseline,
        peak_rss_mb=_peak_rss_mb(),
        memo_entries=memo_entries,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    job = msgspec.json.decode(args[0], type=WorkerJob)
    configure_logging("warning", "json")
    run = bare if job.reader == "bare" else engine
    started = time.monotonic()
    result = anyio.run(run, job)
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    sys.stderr.write(f"worker {job.reader} done in {time.monotonic() - started:.1f}s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["WorkerJob", "WorkerResult", "bare", "engine", "main"]
