"""``combee-stream`` command line.

Each area registers its own subcommands (``register(subparsers)``) and sets ``handler`` on its
parsers: ``handler(args, config) -> int``, sync or async. This file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Sequence

import anyio

from combee_stream.config import load_config
from combee_stream.errors import CombeeError, ConfigError, EngineHalted, UserError
from combee_stream.logs import configure_logging

# Modules that contribute subcommands, in help order.
_COMMAND_MODULES = (
    "combee_stream.kafka.broker",
    "combee_stream.kafka.commands",
    "combee_stream.schema_cli",
    "combee_stream.sim.cli",
    "combee_stream.localllm.cli",
    "combee_stream.prompts_cli",
    "combee_stream.learn_cli",
    "combee_stream.run_cli",
    "combee_stream.ingest.cli",
    "combee_stream.evaluation.cli",
    "combee_stream.bench.cli",
    "combee_stream.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="combee-stream",
        description="Learn agent playbooks from traces with Combee, over Kafka or files.",
    )
    parser.add_argument(
        "--config",
        "-c",
        default=None,
        help="TOML config file (default: built-in defaults; COMBEE__* env vars override)",
    )
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"combee-stream: config error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level or config.log.level, config.log.format)
    handler = args.handler
    try:
        try:
            if inspect.iscoroutinefunction(handler):
                result = anyio.run(handler, args, config)
            else:
                result = handler(args, config)
        except BaseExceptionGroup as group:
            leaf = _one_error(group)
            if leaf is None:
                raise  # a bug among them: its traceback is what a report needs
            raise leaf from None
    except KeyboardInterrupt:
        return 130
    except (ConfigError, UserError) as exc:
        print(f"combee-stream: {exc}", file=sys.stderr)
        return 2
    except EngineHalted as exc:
        print(f"combee-stream: engine halted: {exc}", file=sys.stderr)
        return 1
    except CombeeError as exc:
        print(f"combee-stream: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return int(result or 0)


def _one_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """What a task group's error means to the user when every error in it is ours (a UserError
    from the engine's start checks under ``run --ingest otel``, say): the most actionable one,
    shown as one line like any other. None when anything else is in it."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)
        else:
            leaves.append(error)
    if not all(isinstance(e, CombeeError | KeyboardInterrupt) for e in leaves):
        return None
    for kind in (KeyboardInterrupt, UserError, EngineHalted):
        for error in leaves:
            if isinstance(error, kind):
                return error
    return leaves[0] if leaves else None


__all__ = ["build_parser", "main"]
