"""What a window yields: the stats of its work, its proposal (the merged delta, before it is
committed) and its result (the new version's playbook and what was applied or refused), the
traces that could not be learned, and the error of a window that could not be reduced."""

from __future__ import annotations

from collections.abc import Callable

from msgspec import Struct

from combee_stream.core.playbook import ApplyResult, SkippedOp
from combee_stream.errors import CombeeError
from combee_stream.schemas import (
    Consolidation,
    Delta,
    GateReport,
    HeldOutTask,
    Holdout,
    Playbook,
    PromptUpdate,
    Reflection,
    Rejection,
    Source,
)

# The bytes a version takes where the driver publishes it (what ``max_update_bytes`` bounds).
UpdateSize = Callable[[PromptUpdate], int]


class WindowError(CombeeError):
    """The window could not be reduced (a curator / combiner / embedding call failed for good).
    Nothing was applied; retrying replays the finished calls from the completion memo."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"window of key {key!r} failed: {reason}")
        self.key = key
        self.reason = reason


class FailedTrace(Struct, frozen=True):
    source: Source
    reason: str


class WindowStats(Struct):
    """What one window cost. ``llm_calls`` counts complete() calls (memo hits included, see
    ``cached_calls``; failed calls included); tokens are what was paid (0 for memo hits)."""

    strategy: str
    traces: int = 0
    reflected: int = 0
    failed: int = 0
    groups: int = 0
    duplication: int = 1
    llm_calls: int = 0
    cached_calls: int = 0
    reflector_calls: int = 0
    curator_calls: int = 0
    combiner_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    max_curator_items: int = 0
    max_combiner_items: int = 0
    rounds: int = 0  # sequential LLM rounds: map + level 1 + LLM combine levels
    uncited_tags: int = 0  # reflector tags of bullets the trace did not cite (dropped)
    covered_lessons: int = 0  # reflections not shown to curators: a bullet states their lesson
    stale_by: int = 0  # versions between the snapshot and the playbook it was committed to
    delay_s: float = 0.0
    consolidator_calls: int = 0  # consolidation passes (one per section), on the curator's endpoint
    example_calls: int = 0  # worked examples asked for (learning.worked_examples), same endpoint
    examples: int = 0  # new bullets given a worked example
    wrong_examples: int = 0  # examples still wrong for their task when re-asked (rule alone)
    consolidation: Consolidation | None = None


class LeftOut(Struct, frozen=True):
    """A new bullet of the window that the gate's review left out of the version: its text is
    in no version, so this is where a report finds it."""

    bullet_id: str
    content: str
    # The gate whose blame left it out ("lessons": it fixed none of its failures or nothing
    # beside the bullets kept; "replay": cited on held-out tasks answered wrong), or
    # "<gate> (split)": this window's or the earlier windows' part of a refused candidate.
    by: str


class Proposal(Struct):
    """A window's merged delta (tags, operations, provenance) computed on one snapshot."""

    key: str
    snapshot_version: int
    delta: Delta
    failed: list[FailedTrace]
    reflections: list[Reflection]
    stats: WindowStats
    # The window's tasks, each with its reference answer's numbers (core.hygiene.instance):
    # what the bullet review checks restatements against.
    tasks: list[str] = []
    quoted: list[str] = []  # spans the window's traces quoted (no bullet may reproduce them)
    # Normalised ADD content -> the tasks of the curator groups that proposed it (its sources).
    add_tasks: dict[str, list[str]] = {}
    skipped: list[SkippedOp] = []  # operations the reduce refused (REMOVEs of a minority)
    # Normalised ADD content -> the trace ids of the curator groups that proposed it, and the
    # window's tasks that may have failed, with their reference answers: what a lesson check
    # (evaluation/lessons.py) retries a new bullet on.
    add_traces: dict[str, list[str]] = {}
    retries: list[HeldOutTask] = []


class WindowResult(Struct):
    playbook: Playbook  # the new version (the input itself when nothing was learned)
    delta: Delta  # what was applied (after a fallback: the tags-only / provenance-only delta)
    proposed: Delta  # the merged delta of the window, before any fallback
    applied: ApplyResult
    failed: list[FailedTrace]
    reflections: list[Reflection]
    stats: WindowStats
    rejection: Rejection | None = None  # why ``proposed`` was not applied (budget, gate)
    held_out: list[Source] = []  # the window's traces kept out of learning (the replay gate)
    holdout: Holdout | None = None  # the key's held-out tasks as of this version
    report: GateReport | None = None  # what the replay gate measured
    left_out: list[LeftOut] = []  # new bullets the gate's review left out of this version

    @property
    def learned(self) -> list[Source]:
        """Traces this version learned from (empty when every reflection failed)."""
        return self.delta.sources if self.applied.applied else []

    @property
    def consumed(self) -> list[Source]:
        """Traces this version is done with: learned, or held out."""
        return [*self.learned, *self.held_out]


__all__ = [
    "FailedTrace",
    "LeftOut",
    "Proposal",
    "UpdateSize",
    "WindowError",
    "WindowResult",
    "WindowStats",
]
