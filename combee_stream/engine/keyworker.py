"""One key's pipeline: reflect on arrival, window, reduce, then apply and publish in order.

```
inbox --> reflect (starts the moment a trace arrives, on the key's newest playbook)
      --> window (closes at the controller's size, at max wait, or on flush)
      --> reduce (shuffle + merge tree on the newest playbook at close; several windows may be
          in flight, up to engine.max_windows_in_flight)
      --> apply + publish, strictly in window order (a delta computed on an older snapshot is
          rebased onto the newest playbook first)
```

The worker never commits offsets and never touches Kafka itself: it hands each finished window
to ``Sink.publish`` (which publishes only while the partition is still owned) and failed traces
to ``Sink.park``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from combee_stream.config import EngineConfig
from combee_stream.core.learner import (
    FailedTrace,
    Learner,
    Proposal,
    WindowError,
    WindowResult,
    WindowStats,
)
from combee_stream.core.prompts import ReflectionRecord
from combee_stream.engine.partition import KeyState
from combee_stream.logs import get_logger
from combee_stream.schemas import Source, Trace

log = get_logger(__name__)


class Pending(msgspec.Struct):
    trace: Trace
    source: Source
    read_at: float  # anyio.current_time() when the record was read


class Window:
    def __init__(self, number: int, opened_at: float) -> None:
        self.number = number
        self.opened_at = opened_at
        self.items: list[Pending] = []
        self.reflected: list[ReflectionRecord] = []
        self.failed: list[FailedTrace] = []
        self.outstanding = 0
        self.reflections_done = anyio.Event()
        self.closed = False
        self.closed_at = 0.0
        self.stats = WindowStats(strategy="")

    def reflection_finished(self) -> None:
        self.outstanding -= 1
        if self.closed and self.outstanding == 0:
            self.reflections_done.set()

    def close(self) -> None:
        self.closed = True
        self.closed_at = anyio.current_time()
        if self.outstanding == 0:
            self.reflections_done.set()


class Sink(Protocol):
    """Where a key worker's results go (the engine)."""

    async def publish(self, state: KeyState, window: Window, result: WindowResult) -> bool:
        """Publish a learned window; False when the partition is no longer owned."""
        ...

    async def park(
        self, state: KeyState, failed: Sequence[tuple[FailedTrace, Trace]], stage: str
    ) -> None:
        """Send traces that could not be learned to the DLQ and mark them done."""
        ...


class KeyWorker:
    def __init__(
        self,
        state: KeyState,
        learner: Learner,
        sink: Sink,
        inbox: MemoryObjectReceiveStream[Pending],
        engine: EngineConfig,
    ) -> None:
        self.state = state
        self._learner = learner
        self._sink = sink
        self._inbox = inbox
        self._cfg = engine
        self._in_flight = anyio.Semaphore(engine.max_windows_in_flight if engine.pipelined else 1)
        self._previous_published = anyio.Event()
        self._previous_published.set()
        self._windows = 0
        self.finished = anyio.Event()

    async def run(self) -> None:
        # Every log line of this key's pipeline (its child tasks copy the context) names it.
        with structlog.contextvars.bound_contextvars(key=self.state.key):
            try:
                async with anyio.create_task_group() as tg:
                    await self._assemble(tg)
            finally:
                self.finished.set()

    async def _assemble(self, tg: TaskGroup) -> None:
        window: Window | None = None
        closing = False
        while not closing:
            deadline = (
                window.opened_at + self._cfg.max_wait_s if window is not None else float("inf")
            )
            item: Pending | None = None
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                try:
                    item = await self._inbox.receive()
                except anyio.EndOfStream:
                    closing = True
            if item is not None:
                if window is None:
                    self._windows += 1
                    window = Window(self._windows, anyio.current_time())
                    window.stats = self._learner.new_stats()
                window.items.append(item)
                window.stats.traces += 1
                if self._cfg.pipelined:
                    window.outstanding += 1
                    tg.start_soon(self._reflect, window, item)
            size = self.state.controller.backlog(self._pending(window))
            full = window is not None and len(window.items) >= size
            expired = window is not None and anyio.current_time() >= deadline
            if window is not None and (full or expired or closing):
                await self._in_flight.acquire()
                if not self._cfg.pipelined:  # synchronous: the Map starts at close
                    window.outstanding = len(window.items)
                    for queued in window.items:
                        tg.start_soon(self._reflect, window, queued)
                window.close()
                published = anyio.Event()
                tg.start_soon(self._finish, window, self._previous_published, published)
                self._previous_published = published
                window = None

    @staticmethod
    def _with_traces(
        window: Window, failed: Sequence[FailedTrace]
    ) -> list[tuple[FailedTrace, Trace]]:
        traces = {item.source: item.trace for item in window.items}
        return [(f, traces[f.source]) for f in failed]

    def _pending(self, window: Window | None) -> int:
        queued = self._inbox.statistics().current_buffer_used
        return queued + (len(window.items) if window is not None else 0)

    async def _reflect(self, window: Window, item: Pending) -> None:
        """Reflect against the key's newest playbook; after ``max_trace_attempts`` failed
        calls (each already retried by the LLM client) the trace is parked, not dropped."""
        # This task's own context copy: its log lines (LLM retries included) name the trace.
        structlog.contextvars.bind_contextvars(
            window=window.number, trace_id=item.trace.trace_id, offset=item.source.offset
        )
        try:
            for _ in range(self._cfg.max_trace_attempts):
                outcome = await self._learner.reflect(
                    self.state.playbook, item.trace, item.source, window.stats
                )
                if isinstance(outcome, FailedTrace):
                    failure = outcome
                    continue
                window.reflected.append(outcome)
                return
            window.failed.append(failure)
        finally:
            window.reflection_finished()

    async def _finish(self, window: Window, previous: anyio.Event, done: anyio.Event) -> None:
        """Reduce ``window``, then publish it once ``previous`` (the window before) is out."""
        structlog.contextvars.bind_contextvars(window=window.number)
        try:
            await window.reflections_done.wait()
            if window.failed:
                await self._sink.park(
                    self.state, self._with_traces(window, window.failed), "reflect"
                )
            if window.reflected:
                await self._reduce_and_publish(window, previous)
            else:
                await previous.wait()
        finally:
            done.set()
            self._in_flight.release()

    async def _reduce_and_publish(self, window: Window, previous: anyio.Event) -> None:
        proposal: Proposal | None = None
        error = ""
        # The curators read one frozen snapshot: the newest playbook at close. Retries reuse
        # it, so the same requests are replayed from the completion memo, not paid again.
        snapshot = self.state.playbook
        for attempt in range(1, self._cfg.max_trace_attempts + 1):
            try:
                proposal = await self._learner.reduce(snapshot, window.reflected, [], window.stats)
                break
            except WindowError as exc:
                error = exc.reason
                log.warning(
                    "window failed",
                    key=self.state.key,
                    window=window.number,
                    attempt=attempt,
                    reason=error,
                )
        await previous.wait()  # apply and publish in window order
        if proposal is None:
            failed = [
                FailedTrace(source=r.reflection.source, reason=f"curation failed: {error}")
                for r in window.reflected
            ]
            await self._sink.park(self.state, self._with_traces(window, failed), "curate")
            return
        # Rebased onto the newest version when an earlier window was published meanwhile.
        result = await self._learner.commit(proposal, self.state.playbook)
        await self._sink.publish(self.state, window, result)
