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
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    # aiokafka logs every rebalance and connection, the HTTP clients every LLM request, and
    # uvicorn every served one: keep them to warnings.
    for noisy in ("aiokafka", "httpx", "httpx2", "uvicorn"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


class RepeatFilter(logging.Filter):
    """Let one line of a kind through per ``every_s`` seconds: a client library retrying
    against a lost topic or a dead broker logs the same error hundreds of times a second. The
    first line of a run of repeats passes; the next one that passes says how many were held."""

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith("aiokafka"):
            return True
        what = (record.name, record.levelno, str(record.msg))
        now = record.created
        seen = self._last.get(what)
        if seen is not None and now - seen[0] < self.every_s:
            self._last[what] = (seen[0], seen[1] + 1)
            return False
        held = seen[1] if seen is not None else 0
        self._last[what] = (now, 0)
        if len(self._last) > 1000:  # a bounded memory of kinds
            self._last.pop(next(iter(self._last)))
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {self.every_s:g} s)"
        return True


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
