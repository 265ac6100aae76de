"""A virtual clock for benchmarks that run entirely in process (no sockets).

``VirtualClockLoop`` is an asyncio event loop whose ``time()`` is the real monotonic clock plus
every sleep it skipped: when nothing is runnable and the loop would block until its next timer,
it jumps there instead of waiting. Simulated LLM latencies (timers in the simulator) therefore
cost no real time but are fully accounted, while CPU work still advances the clock at real
speed. The result is the wall time the run would take against an endpoint with exactly that
latency model, without the distortion of compressing real sleeps (which multiplies the harness's
own CPU time by the compression factor).

Only safe when every wait is a timer or in-process work: a wait on a socket would be skipped
as well. Work handed to a thread (``run_in_executor``, e.g. the openai client's first-call
platform probe) is tracked and waited for in real time.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")


class _SkippingSelector:
    """Wraps the loop's selector: a wait with nothing ready becomes a jump of the clock."""

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualClockLoop) -> None:
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0 or self._loop.threads_in_flight:
            return self._inner.select(timeout)
        events = self._inner.select(0)
        if not events:
            self._loop.skipped_s += timeout
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``anyio.run(fn, backend_options={"loop_factory": VirtualClockLoop})``."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped_s = 0.0
        self.threads_in_flight = 0
        self._selector: Any = _SkippingSelector(self._selector, self)

    def time(self) -> float:
        return super().time() + self.skipped_s

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.threads_in_flight += 1

        def finished(_: asyncio.Future[T]) -> None:
            self.threads_in_flight -= 1

        future.add_done_callback(finished)
        return future


def is_virtual() -> bool:
    """Whether the running loop is a :class:`VirtualClockLoop`."""
    return isinstance(asyncio.get_running_loop(), VirtualClockLoop)


__all__ = ["VirtualClockLoop", "is_virtual"]
