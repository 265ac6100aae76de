"""Held-out tasks of a key: which traces the replay gate keeps out of learning, and the bounded
sample of them it tests candidates on.

Traces are untrusted: whoever writes to the traces topic chooses trace ids, tasks and ground
truths. Nothing here may let a producer choose what the gate tests on.

- **Which traces.** Only a trace whose feedback has a ground truth can be scored again, and its
  task and ground truth must be short (``gate.max_task_chars``): the sample travels with every
  version. Among those, a trace is held out when a keyed hash of its trace id (HMAC-SHA256
  with the deployment's secret, ``gate.holdout_secret_env``) falls below
  ``gate.holdout_fraction``: a pure function of the id and the secret, so every instance,
  restart and replay holds out the same traces, and a re-sent trace is held out again, never
  learned; and without the secret an id is held out, and ranked, like any other, so ids mined
  against a public hash are worth nothing.
- **Why a secret from the environment** (not one generated and kept with the key's state):
  the key's state is the prompts topic, which every agent reads, and a secret stored there is
  no secret. The environment is where the deployment's other secrets (API keys, SASL) live.
- **Which are kept.** A bottom-k sample by that hash (the ``gate.reservoir_size`` lowest): a
  uniform sample of everything held out so far, bounded. Two bounds against a flood: at most
  ``gate.holdout_per_window`` tasks of one window join (a burst lands in few windows), and a
  trace id already in the sample keeps its first task (a re-send cannot rewrite it). Ranks are
  recomputed with the current secret each time, so a rotated secret re-ranks the sample.
- **Regressions.** A task that a refused candidate broke (right under the version it extended,
  wrong under it) is kept apart, newest first, up to ``gate.regression_size``, even after the
  reservoir evicts it: later candidates must still get it right.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from combee_stream.config import GateConfig
from combee_stream.schemas import HeldOutTask, Holdout, Trace

_SPACE: Final = 2**64


def rank(trace_id: str, secret: str) -> int:
    """The trace id's position in [0, 2**64): uniform, the same everywhere the secret is, and
    unpredictable without it."""
    digest = hmac.new(secret.encode(), f"holdout:{trace_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big")


def covers(config: GateConfig, key: str) -> bool:
    """Whether the replay gate applies to ``key``."""
    return config.replay and gated(config, key)


def gated(config: GateConfig, key: str) -> bool:
    """Whether ``key`` is one of ``gate.keys`` (the keys every gate applies to)."""
    return any(fnmatch.fnmatchcase(key, p) for p in config.keys)


def with_regressions(holdout: Holdout, broke: Sequence[str], size: int) -> Holdout:
    """``holdout`` with the tasks ``broke`` names first among its regressions (``size`` kept)."""
    by_id = {t.trace_id: t for t in [*holdout.tasks, *holdout.regressions]}
    new = [by_id[i] for i in broke if i in by_id]
    ids = {t.trace_id for t in new}
    regressions = [*new, *(t for t in holdout.regressions if t.trace_id not in ids)]
    return msgspec.structs.replace(holdout, regressions=regressions[:size])


class HoldoutPolicy:
    """Decides, per trace, whether the replay gate keeps it out of learning."""

    def __init__(self, config: GateConfig, secret: str) -> None:
        if not secret:
            raise ValueError("the held-out selection needs a secret")
        self._config = config
        self._secret = secret
        self._below = int(config.holdout_fraction * _SPACE)

    def applies(self, key: str) -> bool:
        return covers(self._config, key)

    def rank(self, trace_id: str) -> int:
        return rank(trace_id, self._secret)

    def held_out(self, trace: Trace) -> HeldOutTask | None:
        """The held-out task ``trace`` becomes, or None when it is to be learned."""
        truth = trace.feedback.ground_truth
        limit = self._config.max_task_chars
        if not truth or len(truth) > limit or len(trace.task) > limit:
            return None
        if not self.applies(trace.key):
            return None
        position = self.rank(trace.trace_id)
        if position >= self._below:
            return None
        return HeldOutTask(trace_id=trace.trace_id, task=trace.task, answer=truth, rank=position)

    def add(self, holdout: Holdout | None, window: Iterable[HeldOutTask]) -> Holdout:
        """``holdout`` with the held-out tasks of one window in its sample: at most
        ``gate.holdout_per_window`` of them (their lowest ranks), none replacing a task of the
        same trace id, then the ``gate.reservoir_size`` lowest ranks of all kept."""
        current = holdout or Holdout()
        merged = {t.trace_id: self._ranked(t) for t in current.tasks}
        fresh = {t.trace_id: self._ranked(t) for t in window if t.trace_id not in merged}
        admitted = sorted(fresh.values(), key=lambda t: t.rank)[: self._config.holdout_per_window]
        merged.update((t.trace_id, t) for t in admitted)
        kept = sorted(merged.values(), key=lambda t: t.rank)[: self._config.reservoir_size]
        return msgspec.structs.replace(current, tasks=kept)

    def regress(self, holdout: Holdout, broke: Sequence[str]) -> Holdout:
        """``holdout`` with the tasks ``broke`` names first among its regressions."""
        return with_regressions(holdout, broke, self._config.regression_size)

    def _ranked(self, task: HeldOutTask) -> HeldOutTask:
        # Ranked with the secret held now: a sample kept under a rotated one is re-ranked.
        position = self.rank(task.trace_id)
        if position == task.rank:
            return task
        return msgspec.structs.replace(task, rank=position)


def review_tasks(holdout: Holdout | None) -> list[HeldOutTask]:
    """What a candidate is tested on: the sample and the regressions, each task once."""
    if holdout is None:
        return []
    return list({t.trace_id: t for t in [*holdout.regressions, *holdout.tasks]}.values())


__all__ = ["HoldoutPolicy", "covers", "rank", "review_tasks", "with_regressions"]
