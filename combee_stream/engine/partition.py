"""What the engine knows about one assigned traces partition."""

from __future__ import annotations

import anyio
from msgspec import Struct

from combee_stream.kafka.offsets import PartitionOffsets


class KeyIndex(Struct, frozen=True):
    """Where a key's newest version is on the prompts topic, and what routing needs of it
    before it is read: a few numbers per key, whatever its playbook weighs."""

    offset: int  # of the key's newest update in this partition of the prompts topic
    version: int
    watermark: int  # highest offset of the key's traces learned, in this traces partition
    # Of the key's dedup record in this partition of the dedup topic (-1: none), and the
    # version it was written with.
    horizon_offset: int = -1
    horizon_version: int = -1


class PartitionState:
    """An owned partition. ``generation`` changes on every assignment, so work started under
    an older ownership can tell it must not publish."""

    def __init__(self, partition: int, generation: int) -> None:
        self.partition = partition
        self.generation = generation
        self.offsets = PartitionOffsets()
        self.owned = True
        self.restored = anyio.Event()
        # Every key of this partition with a version: where the version is (read again when the
        # key becomes active, so an idle key costs a few numbers, not its playbook).
        self.index: dict[str, KeyIndex] = {}
        # Held while publishing and while revoking: a revoked partition never publishes again.
        self.lock = anyio.Lock()
        self.committed = -1  # the last offset this owner committed
        self.backpressured = False  # paused because too many of its traces are buffered
        self.workers: list[anyio.CancelScope] = []  # the key pipelines, cancelled on revoke


# The engine's owned partitions by number; shared by the engine, its intake and its publisher.
Partitions = dict[int, PartitionState]

__all__ = ["KeyIndex", "PartitionState", "Partitions"]
