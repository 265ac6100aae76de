"""One key's learning loop, the same for every driver: reflect, window, reduce, commit, publish.

```
inbox --> reflect (pipelined: the moment a trace arrives, on the key's newest playbook)
      --> window (closes at the batch policy's size, at max wait, or when the inbox closes)
      --> reduce (shuffle + merge tree on the newest playbook at close; up to
          max_windows_in_flight windows of the key in flight)
      --> commit + gate, strictly in window order (a delta computed on an older snapshot is
          rebased onto the newest version first)
      --> KeyChain.next_update --> Sink.publish --> KeyChain.advance --> BatchPolicy.observe
```

The pipeline never touches Kafka or files: a driver gives it an inbox of :class:`Pending` traces
and a :class:`Sink`. The engine's sink publishes to the prompts topic (only while it owns the
partition) and parks failures in the DLQ; offline ``learn``'s sink appends to ``history.jsonl``.
``pipelined=False`` with one window in flight is the paper's synchronous loop (each window
reflected at its close on the newest version): what offline learning runs, and the engine's
benchmark baseline.

Failures: a trace whose reflection fails ``attempts`` times (each already retried by the LLM
client) is parked with stage ``reflect``; a window whose curation fails ``attempts`` times parks
its traces with stage ``curate``. Nothing is dropped and the key moves on.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from combee_stream.core.controller import BatchPolicy
from combee_stream.core.learner import Learner
from combee_stream.core.prompts import ReflectionRecord
from combee_stream.core.results import FailedTrace, Proposal, WindowError, WindowResult, WindowStats
from combee_stream.core.versions import (
    KeyChain,
    Restored,
    UpdateTooLarge,
    WindowInfo,
    revert_onto,
    trace_digest,
)
from combee_stream.logs import get_logger
from combee_stream.schemas import HeldOutTask, Playbook, PromptUpdate, Source, Trace

log = get_logger(__name__)


class Pending(msgspec.Struct):
    trace: Trace
    source: Source
    read_at: float  # anyio.current_time() when the driver read it


class PipelineSettings(msgspec.Struct, frozen=True, kw_only=True):
    pipelined: bool = True  # reflect on arrival and overlap windows
    max_windows_in_flight: int = 2  # ignored (1) when not pipelined
    max_wait_s: float = math.inf  # a window closes at its size or after this long
    attempts: int = 3  # per trace reflection and per window curation
    grow_with_backlog: bool = True  # let the batch policy grow windows while traces queue


class Window:
    """One window of a key, from its first trace to its version."""

    def __init__(self, number: int, opened_at: float) -> None:
        self.number = number
        self.opened_at = opened_at
        self.items: list[Pending] = []
        self.held: dict[Source, HeldOutTask] = {}  # items kept out of learning (replay gate)
        self.reflected: list[ReflectionRecord] = []
        self.failed: list[FailedTrace] = []
        self.outstanding = 0
        self.reflections_done = anyio.Event()
        self.closed = False
        self.closed_at = 0.0
        self.batch_size = 0  # what the batch policy chose when it closed
        self.stats = WindowStats(strategy="")
        self.result: WindowResult | None = None  # once committed

    def reflection_finished(self) -> None:
        self.outstanding -= 1
        if self.closed and self.outstanding == 0:
            self.reflections_done.set()

    def close(self, batch_size: int) -> None:
        self.closed = True
        self.closed_at = anyio.current_time()
        self.batch_size = batch_size
        if self.outstanding == 0:
            self.reflections_done.set()


class Sink(Protocol):
    """Where a key's versions and failures go (the driver)."""

    async def publish(self, chain: KeyChain, update: PromptUpdate, window: Window) -> bool:
        """Make ``update`` durable; False when the driver may no longer publish for this key
        (the engine lost the partition). Raising stops the pipeline."""
        ...

    async def park(
        self, chain: KeyChain, failed: Sequence[tuple[FailedTrace, Trace]], stage: str
    ) -> None:
        """Record traces that could not be learned (their fate is then final)."""
        ...


class MemorySink:
    """Keeps every version, its window and every parked trace in memory (benchmarks, tests)."""

    def __init__(self) -> None:
        self.updates: list[PromptUpdate] = []
        self.windows: list[Window] = []
        self.parked: list[tuple[FailedTrace, str]] = []

    async def publish(self, chain: KeyChain, update: PromptUpdate, window: Window) -> bool:
        self.updates.append(update)
        self.windows.append(window)
        return True

    async def park(
        self, chain: KeyChain, failed: Sequence[tuple[FailedTrace, Trace]], stage: str
    ) -> None:
        self.parked.extend((failure, stage) for failure, _ in failed)


def closed_inbox(items: Sequence[tuple[Trace, Source]]) -> MemoryObjectReceiveStream[Pending]:
    """An inbox already holding ``items`` and closed: a pipeline over it learns them all and
    finishes, its last window closing at the end of the input (the offline drivers)."""
    now = anyio.current_time()
    send, recv = anyio.create_memory_object_stream[Pending](max(1, len(items)))
    for trace, source in items:
        send.send_nowait(Pending(trace, source, now))
    send.close()
    return recv


class KeyPipeline:
    def __init__(
        self,
        chain: KeyChain,
        learner: Learner,
        policy: BatchPolicy,
        sink: Sink,
        inbox: MemoryObjectReceiveStream[Pending],
        settings: PipelineSettings,
        *,
        loader: Callable[[], Awaitable[Restored | None]] | None = None,
        duplicate: Callable[[Pending], None] | None = None,
    ) -> None:
        self.chain = chain
        # Reads the key's newest version (and dedup horizon) back (the engine keeps only where
        # they are); run() waits for it before the first reflection, so nothing is learned on
        # an empty playbook.
        self._loader = loader
        # The driver skips a trace id its chain has seen; the traces it handed over while the
        # version was being read were checked without that version's ids: run() checks those
        # again once it is read and hands a re-sent one back here (learned already).
        self._duplicate = duplicate
        self._unchecked = 0
        self._restored_ids: frozenset[int] = frozenset()  # digests (versions.trace_digest)
        self._window_open = False
        self._windows_in_flight = 0
        self.last_active = anyio.current_time()
        self.policy = policy
        self._learner = learner
        self._sink = sink
        self._inbox = inbox
        self._cfg = settings
        in_flight = settings.max_windows_in_flight if settings.pipelined else 1
        self._in_flight = anyio.Semaphore(in_flight)
        self._previous_done = anyio.Event()
        self._previous_done.set()
        self._windows = 0
        self._stopped = False  # the sink refused a version: publish nothing more
        self._revert: tuple[int, Playbook] | None = None  # the next window starts from this
        self.finished = anyio.Event()

    async def run(self) -> None:
        """Until the inbox is closed and every window is published (or the sink refuses)."""
        # Every log line of this key's pipeline (its child tasks copy the context) names it.
        with structlog.contextvars.bound_contextvars(key=self.chain.key):
            try:
                if self._loader is not None:
                    restored = await self._loader()
                    if restored is not None:
                        ids = self.chain.restore(restored.update, restored.horizon, restored.covers)
                        # No await since the read: exactly these were routed before it.
                        self._unchecked = self._inbox.statistics().current_buffer_used
                        self._restored_ids = frozenset(ids)
                async with anyio.create_task_group() as tg:
                    await self._assemble(tg)
            finally:
                self.finished.set()

    def revert_to(self, version: int, playbook: Playbook) -> None:
        """Commit the next window onto ``playbook`` (of ``version``) instead of the newest (the
        live canary refused the line since that version, or production was rolled back to it)."""
        self._revert = (version, playbook)

    def idle_for(self) -> float:
        """Seconds since the key last had work (0 while a window is open or in flight)."""
        if self._window_open or self._windows_in_flight:
            return 0.0
        if self._inbox.statistics().current_buffer_used:
            return 0.0
        return anyio.current_time() - self.last_active

    # ------------------------------------------------------------------ windows

    def _size(self, window: Window | None) -> int:
        if not self._cfg.grow_with_backlog:
            return self.policy.current()
        queued = self._inbox.statistics().current_buffer_used
        return self.policy.backlog(queued + (len(window.items) if window is not None else 0))

    async def _assemble(self, tg: TaskGroup) -> None:
        window: Window | None = None
        closing = False
        # Synchronous mode takes the in-flight slot before the next window opens, so its size
        # is chosen after the previous window was published (and observed by the policy).
        holding = False
        while not closing:
            if window is None and not self._cfg.pipelined and not holding:
                await self._in_flight.acquire()
                holding = True
            deadline = window.opened_at + self._cfg.max_wait_s if window else math.inf
            item: Pending | None = None
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                try:
                    item = await self._inbox.receive()
                except anyio.EndOfStream:
                    closing = True
            if item is not None and self._unchecked:
                self._unchecked -= 1
                known = trace_digest(item.trace.trace_id) in self._restored_ids
                if known and self._duplicate is not None:
                    self._duplicate(item)
                    item = None
                if not self._unchecked:
                    self._restored_ids = frozenset()
            if item is not None:
                self.last_active = anyio.current_time()
                if window is None:
                    self._window_open = True
                    self._windows += 1
                    window = Window(self._windows, anyio.current_time())
                    window.stats = self._learner.new_stats()
                window.items.append(item)
                window.stats.traces += 1
                if (task := self._learner.held_out(item.trace)) is not None:
                    window.held[item.source] = task
                elif self._cfg.pipelined:
                    window.outstanding += 1
                    tg.start_soon(self._reflect, window, item)
            size = self._size(window)
            full = window is not None and len(window.items) >= size
            expired = window is not None and anyio.current_time() >= deadline
            if window is not None and (full or expired or closing):
                if not holding:
                    await self._in_flight.acquire()
                holding = False
                if not self._cfg.pipelined:  # synchronous: the Map starts at close
                    learned = [i for i in window.items if i.source not in window.held]
                    window.outstanding = len(learned)
                    for queued in learned:
                        tg.start_soon(self._reflect, window, queued)
                window.close(size)
                self._window_open = False
                self._windows_in_flight += 1
                done = anyio.Event()
                tg.start_soon(self._finish, window, self._previous_done, done)
                self._previous_done = done
                window = None
        if holding:
            self._in_flight.release()

    async def _reflect(self, window: Window, item: Pending) -> None:
        """Reflect against the key's newest playbook; park the trace after ``attempts``."""
        # This task's own context copy: its log lines (LLM retries included) name the trace.
        structlog.contextvars.bind_contextvars(
            window=window.number, trace_id=item.trace.trace_id, offset=item.source.offset
        )
        try:
            failure: FailedTrace | None = None
            for _ in range(self._cfg.attempts):
                outcome = await self._learner.reflect(
                    self.chain.playbook, item.trace, item.source, window.stats
                )
                if isinstance(outcome, FailedTrace):
                    failure = outcome
                    continue
                window.reflected.append(outcome)
                return
            assert failure is not None
            window.failed.append(failure)
        finally:
            window.reflection_finished()

    async def _finish(self, window: Window, previous: anyio.Event, done: anyio.Event) -> None:
        """Reduce ``window``, then commit and publish it once ``previous`` is out."""
        structlog.contextvars.bind_contextvars(window=window.number)
        try:
            await window.reflections_done.wait()
            if window.failed:
                await self._park(window, window.failed, "reflect")
            proposal = await self._reduce(window) if window.reflected or window.held else None
            await previous.wait()  # commit and publish in window order
            if proposal is not None:
                await self._publish(window, proposal)
        finally:
            self._windows_in_flight -= 1
            self.last_active = anyio.current_time()
            done.set()
            self._in_flight.release()

    async def _reduce(self, window: Window) -> Proposal | None:
        """The window's delta, or None (its traces parked) when curation keeps failing."""
        # The curators read one frozen snapshot: the newest playbook at close. Retries reuse
        # it, so the same requests are replayed from the completion memo, not paid again.
        snapshot = self.chain.playbook
        # The same line in every driver (a stream has no total), so a window's requests, and
        # what they cost, do not depend on where the traces came from.
        first = self.chain.traces_learned + 1
        progress = f"traces {first}-{first + len(window.items) - 1} for key {self.chain.key}"
        error = ""
        for attempt in range(1, self._cfg.attempts + 1):
            try:
                return await self._learner.reduce(
                    snapshot, window.reflected, [], window.stats, progress=progress
                )
            except WindowError as exc:
                error = exc.reason
                log.warning("window failed", window=window.number, attempt=attempt, reason=error)
        failed = [
            FailedTrace(source=r.reflection.source, reason=f"curation failed: {error}")
            for r in window.reflected
        ]
        await self._park(window, failed, "curate")
        return None

    async def _publish(self, window: Window, proposal: Proposal) -> None:
        if self._stopped:
            return
        holdout = self.chain.holdout
        if window.held and self._learner.holdout is not None:
            holdout = self._learner.holdout.add(holdout, window.held.values())
        onto, revert = self.chain.playbook, self._revert
        if revert is not None:
            onto = revert_onto(onto, revert[1])
        # Rebased onto the newest version when an earlier window was published meanwhile.
        # Commit calls an LLM too (semantic dedup's embeddings, consolidation, the replay
        # gate), so it gets the same attempts as curation and then parks, rather than raising
        # out of the pipeline and taking every other key's window down with it.
        result: WindowResult | None = None
        error = ""
        size_of = self._learner.update_size
        for attempt in range(1, self._cfg.attempts + 1):
            try:
                result = await self._learner.commit(
                    proposal,
                    onto,
                    holdout=holdout,
                    held_out=sorted(window.held),
                    measure=None
                    if size_of is None
                    else lambda r: self.chain.measure(r, self._info(window, revert), size_of),
                )
                break
            except WindowError as exc:
                error = exc.reason
                log.warning("commit failed", window=window.number, attempt=attempt, reason=error)
        if result is None:
            sources = [r.reflection.source for r in window.reflected] + sorted(window.held)
            failed = [FailedTrace(source=s, reason=f"commit failed: {error}") for s in sources]
            await self._park(window, failed, "curate")
            return
        info = self._info(window, revert)
        update = self.chain.next_update(result, info)
        limit, smallest, published = self._learner.max_update_bytes, False, None
        while update is not None and published is None:
            window.result = result
            # Exact now; the learner measured with slack.
            size = size_of(update) if size_of is not None else 0
            if limit is None or size <= limit:
                try:
                    published = await self._sink.publish(self.chain, update, window)
                    continue
                except UpdateTooLarge as exc:  # the topic's limit is below kafka.max_message_bytes
                    size = exc.size
            if smallest:
                # Not even the window's smallest version fits: its traces are parked
                # (replayable once the limit is raised) and the key goes on.
                reason = f"version too large: {size} bytes"
                failed = [FailedTrace(source=s, reason=reason) for s in result.consumed]
                await self._park(window, failed, "size")
                return
            result, smallest = self._learner.size_rejected(result, onto, size), True
            update = self.chain.next_update(result, info)
        if update is None:
            return
        if not published:
            self._stopped = True
            log.info("window abandoned: the sink no longer takes versions", window=window.number)
            return
        self.chain.advance(update)
        if self._revert is revert:
            self._revert = None
        self.policy.observe(len(window.items), max(1e-6, info.delay_s))

    @staticmethod
    def _info(window: Window, revert: tuple[int, Playbook] | None) -> WindowInfo:
        return WindowInfo(
            batch_size=window.batch_size,
            delay_s=anyio.current_time() - window.closed_at,
            reverted_to=revert[0] if revert is not None else None,
        )

    async def _park(self, window: Window, failed: Sequence[FailedTrace], stage: str) -> None:
        traces = {item.source: item.trace for item in window.items}
        await self._sink.park(self.chain, [(f, traces[f.source]) for f in failed], stage)


__all__ = [
    "KeyPipeline",
    "MemorySink",
    "Pending",
    "PipelineSettings",
    "Sink",
    "Window",
    "closed_inbox",
]
