"""Which input offsets may be committed: the low watermark of unfinished work per partition.

An offset is *pending* from the moment a consumer (the engine, the ingest stage) reads it
until its fate is durable: learned and covered by a published PromptUpdate, parked in the DLQ,
or skipped as already learned. The committable position of a partition is the smallest pending
offset (everything before it is done), or one past the highest offset read when nothing is
pending. Committing only that never commits a trace whose update has not been published.
"""

from __future__ import annotations

import heapq


class PartitionOffsets:
    """Pending offsets of one partition, with O(log n) completion in any order."""

    def __init__(self, start: int | None = None) -> None:
        self._next = start  # one past the highest offset read; None before the first read
        self._pending: set[int] = set()
        self._heap: list[int] = []

    def read(self, offset: int) -> None:
        self._pending.add(offset)
        heapq.heappush(self._heap, offset)
        self._next = offset + 1 if self._next is None else max(self._next, offset + 1)

    def done(self, offset: int) -> None:
        self._pending.discard(offset)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def committable(self) -> int | None:
        """The offset to commit (every offset below it is done); None before the first read."""
        while self._heap and self._heap[0] not in self._pending:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else self._next


__all__ = ["PartitionOffsets"]
