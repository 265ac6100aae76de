"""What the engine knows about one assigned traces partition."""

from __future__ import annotations

import anyio

from combee_stream.engine.offsets import PartitionOffsets
from combee_stream.schemas import PromptUpdate


class PartitionState:
    """An owned partition. ``generation`` changes on every assignment, so work started under
    an older ownership can tell it must not publish."""

    def __init__(self, partition: int, generation: int) -> None:
        self.partition = partition
        self.generation = generation
        self.offsets = PartitionOffsets()
        self.owned = True
        self.restored = anyio.Event()
        # The newest version of every key of this partition, read from the prompts topic
        # before the partition's first trace is read.
        self.restored_updates: dict[str, PromptUpdate] = {}
        # Held while publishing and while revoking: a revoked partition never publishes again.
        self.lock = anyio.Lock()
        self.committed = -1  # the last offset this owner committed
        self.backpressured = False  # paused because too many of its traces are buffered
        self.workers: list[anyio.CancelScope] = []  # the key pipelines, cancelled on revoke


# The engine's owned partitions by number; shared by the engine, its intake and its publisher.
Partitions = dict[int, PartitionState]

__all__ = ["PartitionState", "Partitions"]
