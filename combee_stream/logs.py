"""One structlog setup for the whole package: JSON lines off a TTY, readable on a TTY."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any, Final, Literal, TextIO

import structlog


def configure_logging(
    level: str = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    *,
    to: TextIO | None = None,
) -> None:
    """Configure structlog and the stdlib root logger (aiokafka logs through it). ``to``: a
    file that takes every line instead of stderr (JSON), e.g. a demo that prints its own
    lines and names the file the engine's logs went to."""
    as_json = to is not None or fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
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
    repeats = Repeats()
    structlog.configure(
        processors=[
            *shared,
            RepeatProcessor(repeats),  # after the context: the key is part of a line's kind
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=_stderr_logger if to is None else structlog.PrintLoggerFactory(to),
        cache_logger_on_first_use=False,
    )
    handler: logging.StreamHandler = (  # type: ignore[type-arg]
        _StderrHandler() if to is None else logging.StreamHandler(to)
    )
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    handler.addFilter(RepeatFilter(repeats))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    # aiokafka logs every rebalance and connection, the HTTP clients every LLM request, and
    # uvicorn every served one: keep them to warnings.
    for noisy in ("aiokafka", "httpx", "httpx2", "uvicorn"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


class Repeats:
    """Let one line of a kind through per ``every_s`` seconds: a client library retrying
    against a lost topic or a dead broker logs the same error hundreds of times a second, and
    the engine's own retry loops ("publish failed, retrying", "poll failed, retrying") one per
    attempt. The first line of a run of repeats passes; the next one that passes says how many
    were held. One memory for both kinds of line (stdlib records and structlog events)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[tuple[str, ...], tuple[float, int]] = {}

    def admit(self, kind: tuple[str, ...], now: float) -> int | None:
        """None: hold this line; else how many like it were held since the last one passed."""
        seen = self._last.get(kind)
        if seen is not None and now - seen[0] < self.every_s:
            self._last[kind] = (seen[0], seen[1] + 1)
            return None
        self._last[kind] = (now, 0)
        if len(self._last) > 1000:  # a bounded memory of kinds
            self._last.pop(next(iter(self._last)))
        return seen[1] if seen is not None else 0

    def summary(self, held: int) -> str:
        return f" (and {held} more like it in the last {self.every_s:g} s)"


class RepeatFilter(logging.Filter):
    """:class:`Repeats` for aiokafka's warnings and errors (stdlib logging)."""

    def __init__(self, repeats: Repeats | None = None) -> None:
        super().__init__()
        self.repeats = repeats or Repeats()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith("aiokafka"):
            return True
        held = self.repeats.admit(
            (record.name, str(record.levelno), str(record.msg)), record.created
        )
        if held is None:
            return False
        if held:
            record.msg = f"{record.msg}{self.repeats.summary(held)}"
        return True


class RepeatProcessor:
    """:class:`Repeats` for the engine's own warnings and errors (a structlog processor): a
    line is of a kind by its event, level and the fields that say where (key, partition, op),
    not by its attempt number or error text, which change on every retry."""

    WHERE: Final = ("op", "partition", "key", "topic")

    def __init__(self, repeats: Repeats, clock: Callable[[], float] = time.time) -> None:
        self.repeats = repeats
        self._clock = clock

    def __call__(
        self, logger: Any, method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if method not in ("warning", "error", "critical", "exception"):
            return event
        kind = (method, str(event.get("event")), *(str(event.get(k)) for k in self.WHERE))
        held = self.repeats.admit(kind, self._clock())
        if held is None:
            raise structlog.DropEvent
        if held:
            event["event"] = f"{event.get('event')}{self.repeats.summary(held)}"
        return event


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
