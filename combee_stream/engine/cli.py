"""CLI: ``run``, the streaming engine."""

from __future__ import annotations

import argparse
from typing import Any

from combee_stream.config import Config


def register(sub: Any) -> None:
    run = sub.add_parser("run", help="run the streaming engine (traces in, prompt versions out)")
    run.set_defaults(handler=_run)


async def _run(args: argparse.Namespace, config: Config) -> int:
    from combee_stream.engine.engine import Engine

    await Engine(config, handle_signals=True).run()
    return 0


__all__ = ["register"]
