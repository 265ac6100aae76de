"""The publish gate: the last word on a candidate playbook before it becomes a version.

The learner's commit step (:meth:`combee_stream.core.learner.Learner.commit`) consults the gate
for every window whose delta applied within the token budget, in every driver. A gate that
refuses a candidate does not lose its traces: the window still yields a version, with the
parent's bullets and the traces' provenance (so they are never learned again), and the refusal
in ``UpdateStats.rejection`` as a :class:`~combee_stream.schemas.GateRejection`.

A gate is any object with an async ``review``; the default, :class:`AcceptAll`, keeps the
behaviour of a pipeline without one; :class:`combee_stream.evaluation.replay.ReplayGate` tests the
candidate on held-out tasks. :func:`combee_stream.wiring.build_gate` builds the configured one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
from msgspec import Struct

from combee_stream.schemas import Delta, GateReport, HeldOutTask, Holdout, Playbook, Reflection


class Candidate(Struct, frozen=True, kw_only=True):
    """What a gate reviews: the playbook a window would publish, and what it came from."""

    key: str
    parent: Playbook  # the newest version, the candidate's base
    playbook: Playbook  # parent + the window's delta, within the token budget
    delta: Delta  # what was applied (tags, operations, provenance)
    reflections: list[Reflection]
    holdout: Holdout | None = None  # the key's held-out tasks (the replay gate's test set)
    # Normalised ADD content -> the trace ids of the curator groups that proposed it, and the
    # window's tasks whose traces may have failed, with their reference answers (the lesson
    # check's test set: a new bullet is retried on the failures it was learned from).
    add_traces: dict[str, list[str]] = {}
    retries: list[HeldOutTask] = []


class Verdict(Struct, frozen=True):
    accepted: bool
    reason: str = ""
    report: GateReport | None = None  # what was measured, for the version's stats
    holdout: Holdout | None = None  # the held-out tasks afterwards (regressions added)
    # The candidate's new bullets to blame (the agent relied on them and failed). The learner
    # tries the candidate once more without them.
    blame: list[str] = []
    # The gate cannot judge yet (too few held-out tasks): neither published nor refused, the
    # candidate's operations wait in the key's ``Holdout.pending`` for the next window's review.
    deferred: bool = False


class PublishGate(Protocol):
    """Decides whether a candidate may be published as the key's next version."""

    name: str

    async def review(self, candidate: Candidate) -> Verdict: ...


class AcceptAll:
    """The default gate: every candidate within its budget is published."""

    name = "accept_all"

    async def review(self, candidate: Candidate) -> Verdict:
        return Verdict(accepted=True)


class GateChain:
    """Gates reviewed in turn, each only if the one before accepted without blame: the first
    refusal or deferral is the verdict, otherwise the last gate's. A gate before the last that
    accepts with blame stops the chain with a refusal carrying that blame: the learner's
    blame-prune then reviews the candidate without those bullets through the whole chain, and
    if that fails too, the refusal stands (an acceptance would publish a candidate the later
    gates never saw)."""

    def __init__(self, gates: Sequence[PublishGate]) -> None:
        if not gates:
            raise ValueError("a gate chain needs at least one gate")
        self._gates = list(gates)
        self.name = "+".join(g.name for g in gates)

    async def review(self, candidate: Candidate) -> Verdict:
        verdict = Verdict(accepted=True)
        for gate in self._gates:
            verdict = await gate.review(candidate)
            if not verdict.accepted or verdict.deferred:
                return verdict
            if verdict.blame and gate is not self._gates[-1]:
                return msgspec.structs.replace(verdict, accepted=False)
        return verdict


__all__ = ["AcceptAll", "Candidate", "GateChain", "PublishGate", "Verdict"]
