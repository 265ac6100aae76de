"""Progress of a long phase (``bench quality`` runs for an hour on 2 cores, ``learn`` over a
big file for minutes): items done, rate, ETA and, when the caller counts them, the endpoint's
output tokens per second. A rich bar on a terminal; in a
log (a ``nohup`` run) one plain line every tenth of the phase or every minute, whichever comes
first, so a background run says where it is.

A phase whose items each take many model calls (a learn window: reflections, curators, the
gate's replays; 10-25 minutes each on 2 CPU cores) reports its calls and tokens as they happen
(:meth:`PhaseProgress.activity`, polled every :attr:`PhaseProgress.refresh_s`), so its line
moves between two items instead of saying "0/60" for a quarter of an hour."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
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
        self,
        phase: str,
        total: int,
        *,
        done: int = 0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.phase, self.total, self.done = phase, total, done
        self._stream = stream or sys.stderr
        self._clock = clock
        self._tokens = 0
        self._calls = 0
        self._started = clock()
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

    @property
    def refresh_s(self) -> float:
        """How often a caller's :meth:`activity` is worth polling: a bar redraws at once, a
        log gets a line a minute."""
        return 2.0 if self._bar is not None else _LINE_EVERY_S

    def advance(self, n: int = 1, *, tokens_out: int = 0) -> None:
        self.done += n
        self._tokens += tokens_out
        self._show(n)

    def activity(self, *, calls: int, tokens_out: int) -> None:
        """The model calls sent and output tokens received so far in this phase (totals, not
        increments; a caller that reports them here passes no ``tokens_out`` to advance)."""
        self._calls, self._tokens = calls, tokens_out
        self._show(0)

    def _show(self, advanced: int) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=advanced, rate=self._rate())
        else:
            self._line()

    def _rate(self) -> str:
        elapsed = max(self._clock() - self._started, 1e-9)
        items = (self.done - self._resumed) / elapsed * 60
        calls = f", {self._calls} model calls" if self._calls else ""
        tokens = f", {self._tokens / elapsed:.1f} tok/s out" if self._tokens else ""
        return f"{items:.1f}/min{calls}{tokens}"

    def _line(self, *, force: bool = False) -> None:
        now = self._clock()
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
