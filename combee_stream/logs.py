"""One structlog setup for the whole package: JSON lines off a TTY, readable on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import structlog


def configure_logging(
    level: str = "info", fmt: Literal["auto", "json", "console"] = "auto"
) -> None:
    """Configure structlog and the stdlib root logger (aiokafka logs through it) once."""
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    # aiokafka logs every rebalance and connection, the HTTP clients every LLM request, and
    # uvicorn every served one: keep them to warnings.
    for noisy in ("aiokafka", "httpx", "httpx2", "uvicorn"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _stderr_logger(*args: Any) -> structlog.PrintLogger:
    # Resolve sys.stderr when logging, not when configuring: test runners and embedding
    # applications swap it, and a logger holding the old one writes to a closed file.
    return structlog.PrintLogger(file=sys.stderr)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that always writes to the current ``sys.stderr``."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]


__all__ = ["configure_logging", "get_logger"]
