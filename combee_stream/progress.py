"""Progress of a long phase (``bench quality`` runs for an hour on 2 cores, ``learn`` over a
big file for minutes): items done, rate, ETA and, when the caller counts them, the endpoint's
output tokens per second. A rich bar on a terminal; in a
log (a ``nohup`` run) one plain line every tenth of the phase or every minute, whichever comes
first, so a background run says where it is."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Self, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

_LINE_EVERY_S = 60.0


class PhaseProgress:
    """``with PhaseProgress("eval base", 100) as p: ... p.advance(tokens_out=42)``."""

    def __init__(
        self, phase: str, total: int, *, done: int = 0, stream: TextIO | None = None
    ) -> None:
        self.phase, self.total, self.done = phase, total, done
        self._stream = stream or sys.stderr
        self._tokens = 0
        self._started = time.monotonic()
        self._resumed = done
        self._last_line = 0.0
        self._last_tenth = -1
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Self:
        if self._stream.isatty():
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(file=self._stream),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                self.phase, total=self.total, completed=self.done, rate=""
            )
        else:
            self._line(force=True)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        else:
            self._line(force=True)

    def advance(self, n: int = 1, *, tokens_out: int = 0) -> None:
        self.done += n
        self._tokens += tokens_out
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=n, rate=self._rate())
        else:
            self._line()

    def _rate(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        items = (self.done - self._resumed) / elapsed * 60
        tokens = f", {self._tokens / elapsed:.1f} tok/s out" if self._tokens else ""
        return f"{items:.1f}/min{tokens}"

    def _line(self, *, force: bool = False) -> None:
        now = time.monotonic()
        tenth = 10 * self.done // self.total if self.total else 10
        if not force and tenth == self._last_tenth and now - self._last_line < _LINE_EVERY_S:
            return
        self._last_tenth, self._last_line = tenth, now
        elapsed = now - self._started
        new = self.done - self._resumed
        left = (self.total - self.done) * elapsed / new if new else float("nan")
        eta = f"ETA {left / 60:.0f} min" if new else "ETA ?"
        print(
            f"{self.phase}: {self.done}/{self.total} ({self._rate()}; "
            f"{elapsed / 60:.1f} min, {eta})",
            file=self._stream,
            flush=True,
        )


__all__ = ["PhaseProgress"]
