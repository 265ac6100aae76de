"""What the engine knows about one assigned traces partition and the keys that live in it."""

from __future__ import annotations

import anyio

from combee_stream.core.controller import OnlineController
from combee_stream.core.playbook import new_playbook
from combee_stream.engine.offsets import PartitionOffsets
from combee_stream.schemas import Playbook, PromptUpdate


class KeyState:
    """The newest published state of one key, restored from the compacted prompts topic."""

    def __init__(self, key: str, partition: int, controller: OnlineController) -> None:
        self.key = key
        self.partition = partition
        self.controller = controller
        self.update: PromptUpdate | None = None
        self.playbook: Playbook = new_playbook(key)
        self.watermark = -1  # highest offset of this key's traces already learned
        self.traces_learned = 0

    def restore(self, update: PromptUpdate) -> None:
        self.update = update
        self.playbook = update.playbook
        self.watermark = update.watermark.get(self.partition, -1)
        self.traces_learned = update.stats.traces_learned

    @property
    def version(self) -> int:
        return self.update.version if self.update is not None else -1


class PartitionState:
    """An owned partition. ``generation`` changes on every assignment, so work started under
    an older ownership can tell it must not publish."""

    def __init__(self, partition: int, generation: int) -> None:
        self.partition = partition
        self.generation = generation
        self.offsets = PartitionOffsets()
        self.owned = True
        self.restored = anyio.Event()
        self.restored_updates: dict[str, PromptUpdate] = {}
        # Held while publishing and while revoking: a revoked partition never publishes again.
        self.lock = anyio.Lock()
        self.committed = -1  # the last offset this owner committed
        self.workers: list[anyio.CancelScope] = []  # cancelled on revoke
