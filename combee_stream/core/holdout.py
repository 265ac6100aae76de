"""Held-out tasks of a key: which traces the replay gate keeps out of learning, and the bounded
sample of them it tests candidates on.

Decisions (the issue leaves them open):

- **Which traces.** Only a trace whose feedback has a ground truth can be scored again, and its
  task and ground truth must be short (``gate.max_task_chars``): the sample travels with every
  version. Among those, a trace is held out when the hash of its trace id falls below
  ``gate.holdout_fraction``: a pure function of the id, so every instance, restart and replay
  holds out the same traces, and a re-sent trace is held out again, never learned.
- **Which are kept.** A bottom-k sample by that hash (the ``gate.reservoir_size`` lowest): a
  uniform sample of everything held out so far, the same whatever the arrival order, bounded.
- **Regressions.** A task that a refused candidate broke (right under the version it extended,
  wrong under it) is kept apart, newest first, up to ``gate.regression_size``, even after the
  reservoir evicts it: later candidates must still get it right.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterable, Sequence
from typing import Final

from combee_stream.config import GateConfig
from combee_stream.schemas import HeldOutTask, Holdout, Trace

_SPACE: Final = 2**64


def rank(trace_id: str) -> int:
    """The trace id's position in [0, 2**64): uniform, and the same everywhere."""
    return int.from_bytes(hashlib.sha256(f"holdout:{trace_id}".encode()).digest()[:8], "big")


class HoldoutPolicy:
    """Decides, per trace, whether the replay gate keeps it out of learning."""

    def __init__(self, config: GateConfig) -> None:
        self._config = config
        self._below = int(config.holdout_fraction * _SPACE)

    def applies(self, key: str) -> bool:
        return self._config.replay and any(fnmatch.fnmatchcase(key, p) for p in self._config.keys)

    def held_out(self, trace: Trace) -> HeldOutTask | None:
        """The held-out task ``trace`` becomes, or None when it is to be learned."""
        truth = trace.feedback.ground_truth
        limit = self._config.max_task_chars
        if not truth or len(truth) > limit or len(trace.task) > limit:
            return None
        if not self.applies(trace.key):
            return None
        position = rank(trace.trace_id)
        if position >= self._below:
            return None
        return HeldOutTask(trace_id=trace.trace_id, task=trace.task, answer=truth, rank=position)

    def add(self, holdout: Holdout | None, tasks: Iterable[HeldOutTask]) -> Holdout:
        """``holdout`` with ``tasks`` in its sample (the lowest ranks kept)."""
        current = holdout or Holdout()
        merged = {t.trace_id: t for t in [*current.tasks, *tasks]}
        kept = sorted(merged.values(), key=lambda t: t.rank)[: self._config.reservoir_size]
        return Holdout(tasks=kept, regressions=current.regressions)

    def regress(self, holdout: Holdout, broke: Sequence[str]) -> Holdout:
        """``holdout`` with the tasks ``broke`` names first among its regressions."""
        by_id = {t.trace_id: t for t in [*holdout.tasks, *holdout.regressions]}
        new = [by_id[i] for i in broke if i in by_id]
        ids = {t.trace_id for t in new}
        regressions = [*new, *(t for t in holdout.regressions if t.trace_id not in ids)]
        return Holdout(tasks=holdout.tasks, regressions=regressions[: self._config.regression_size])


def review_tasks(holdout: Holdout | None) -> list[HeldOutTask]:
    """What a candidate is tested on: the sample and the regressions, each task once."""
    if holdout is None:
        return []
    return list({t.trace_id: t for t in [*holdout.regressions, *holdout.tasks]}.values())


__all__ = ["HoldoutPolicy", "rank", "review_tasks"]
