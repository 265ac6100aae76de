"""CLI: ``run``, the streaming engine (with ``--ingest otel``, the ingest stage beside it)."""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from combee_stream.config import Config


def register(sub: Any) -> None:
    run = sub.add_parser("run", help="run the streaming engine (traces in, prompt versions out)")
    run.add_argument(
        "--ingest",
        choices=["otel"],
        default=None,
        help="also run the ingest stage in this process (OpenTelemetry spans in, traces out)",
    )
    run.set_defaults(handler=_run)


async def _run(args: argparse.Namespace, config: Config) -> int:
    from combee_stream.wiring import Engine

    engine = Engine(config, handle_signals=True)
    if args.ingest is None:
        await engine.run()
        return 0
    from combee_stream.ingest import IngestMetrics, IngestStage

    stage = IngestStage(config, metrics=IngestMetrics(engine.metrics.registry))
    async with anyio.create_task_group() as tg:

        async def ingest() -> None:
            # Once the engine passed its start checks (LLM endpoints, topics): a setting to fix
            # then stops the process before the stage has touched Kafka, not in its midst.
            await engine.started.wait()
            await stage.run()
            engine.stop()  # the stage halted (its error ends the run): stop learning too

        tg.start_soon(ingest)
        await engine.run()
        stage.stop()
    return 0


__all__ = ["register"]
