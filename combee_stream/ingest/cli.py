"""CLI: ``ingest otel``, the ingest stage alone (``run --ingest otel`` runs it with the engine)."""

from __future__ import annotations

import argparse
import signal
from typing import Any

import anyio

from combee_stream.config import Config
from combee_stream.logs import get_logger

log = get_logger(__name__)


def register(sub: Any) -> None:
    ingest = sub.add_parser(
        "ingest", help="assemble agent telemetry into traces (OpenTelemetry spans from Kafka)"
    )
    kinds = ingest.add_subparsers(dest="ingest_kind", metavar="KIND", required=True)
    otel = kinds.add_parser(
        "otel",
        help="read OTLP spans (ingest.spans_topic), logs and feedback; write traces keyed by "
        "prompt key to kafka.traces_topic, exactly once",
    )
    otel.add_argument(
        "--instance",
        type=int,
        default=0,
        help="this process's number (each ingest process of one group needs its own; a "
        "restarted process keeps its number, which fences its predecessor)",
    )
    otel.set_defaults(handler=_otel)


async def _otel(args: argparse.Namespace, config: Config) -> int:
    from combee_stream.ingest.stage import IngestStage

    stage = IngestStage(config, instance=args.instance)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_on_signal, stage.stop)
        if config.ingest.metrics_port:
            tg.start_soon(_serve_metrics, stage, config)

        async def run() -> None:
            await stage.run()
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        await stage.started.wait()
        s = config.ingest
        log.info("ingest started", spans=s.spans_topic, encoding=s.encoding, instance=args.instance)
    return 0


async def _serve_metrics(stage: Any, config: Config) -> None:
    from combee_stream.http import serve_asgi

    host, port = config.engine.metrics_host, config.ingest.metrics_port
    async with serve_asgi(stage.metrics.asgi_app(), host, port) as server:
        log.info("metrics endpoint", url=f"{server.root_url}/metrics")
        await anyio.sleep_forever()


async def _stop_on_signal(stop: Any) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop()
            return


__all__ = ["register"]
