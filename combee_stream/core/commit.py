"""Committing a window: its proposal applied onto the key's newest playbook, a ladder of named
steps (:class:`Commit`), each of which may narrow what the version carries:

1. **nothing to apply** — a window of held-out traces only still yields a version (for their
   offsets); one whose every reflection failed learns nothing;
2. **rebase** — a delta computed on an older snapshot, onto the newest version
   (:func:`~combee_stream.core.delta.rebase`); the operations earlier windows left waiting
   for the gate (``Holdout.pending``) join it, and the whole is one candidate;
3. **budget** — the review (:mod:`~combee_stream.core.hygiene`) and the delta applied within
   the token budget;
4. **consolidation** — near the budget (tokens, or the version's bytes near
   ``max_update_bytes``): the window's result consolidated; if that does not fit, the playbook
   alone, and the window applied onto it. One version either way; the gate reviews it whole.
   Also (``learning.merge_similar``) when a new bullet gives the advice another of its section
   gives, by embeddings: those bullets merged, so a rule stated once per case becomes one;
5. **size** — a candidate over ``max_update_bytes`` is not reviewed (it cannot be published):
   it falls back;
6. **gate** — the publish gate reviews the candidate; **blame-prune**: when it blames new
   bullets (the agent relied on them on held-out tasks and failed), once more without them,
   kept when the rest passes; **split**: a refused candidate that carries earlier windows'
   waiting lessons and this window's is reviewed as its two parts, the earlier windows' first,
   and the first part that passes is kept; a refusal keeps nothing of the candidate; a gate
   that cannot judge yet (too few held-out tasks) **defers**, also on the blame-prune's second
   look (a chain's lesson check blamed, its replay gate cannot judge): what is left waits in
   ``Holdout.pending`` for the next window, and this version carries the window's tags and
   provenance;
7. **fall back** — tags + provenance, then provenance only (a gate refusal: provenance only);
8. **re-review** — a consolidation kept under a budget or size rejection is a change of the
   prompt of its own: reviewed like any;
9. **final size** — whatever the steps made is measured again; over the bound, the window
   becomes its smallest version (:func:`size_rejected`).

The learner (:meth:`combee_stream.core.learner.Learner.commit`) runs it with its review, its
consolidation, its gate and its size bound.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Protocol

import anyio
import msgspec

from combee_stream.config import LearningConfig
from combee_stream.core.delta import canonical_operations, empty, merge, rebase
from combee_stream.core.gate import Candidate, PublishGate, Verdict
from combee_stream.core.playbook import (
    ApplyResult,
    SkippedOp,
    apply,
    copy_playbook,
    find_bullet,
    normalize,
    playbook_tokens,
)
from combee_stream.core.results import LeftOut, Proposal, WindowResult, WindowStats
from combee_stream.logs import get_logger
from combee_stream.schemas import (
    AddOp,
    BudgetRejection,
    Consolidation,
    Delta,
    GateRejection,
    GateReport,
    Holdout,
    Operation,
    Playbook,
    Rejection,
    RemoveOp,
    SizeRejection,
    Source,
    UpdateOp,
)

log = get_logger(__name__)


class Review(Protocol):
    """The learner's review and apply of a delta (``budget`` -1: the token budget; None: none)."""

    async def __call__(
        self,
        snapshot: Playbook,
        delta: Delta,
        tasks: Sequence[str],
        *,
        budget: int | None = -1,
        own_tasks: Mapping[str, Sequence[str]] | None = None,
        refused: Sequence[SkippedOp] = (),
        quoted: Sequence[str] = (),
    ) -> ApplyResult: ...


Consolidate = Callable[[Playbook, WindowStats], Awaitable[tuple[Playbook, Consolidation | None]]]
# (candidate, the ids it added, stats) -> the candidate with its similar bullets merged, or None.
MergeSimilar = Callable[
    [Playbook, set[str], WindowStats], Awaitable[tuple[Playbook, Consolidation | None]]
]


class Commit:
    """One proposal committed onto ``onto``: :meth:`run` climbs the ladder. ``holdout``: the
    key's held-out tasks with the window's ``held_out`` traces already in them. ``measure``: the
    bytes of the version a result makes, bounded by ``max_update_bytes``; without it nothing
    bounds the size."""

    def __init__(
        self,
        proposal: Proposal,
        onto: Playbook,
        *,
        learning: LearningConfig,
        gate: PublishGate,
        review: Review,
        consolidate: Consolidate,
        max_update_bytes: int | None,
        holdout: Holdout | None = None,
        held_out: Sequence[Source] = (),
        measure: Callable[[WindowResult], int] | None = None,
        merge_similar: MergeSimilar | None = None,
    ) -> None:
        if onto.key != proposal.key:
            raise ValueError(f"proposal for key {proposal.key!r} committed to {onto.key!r}")
        if onto.version < proposal.snapshot_version:
            raise ValueError(
                f"proposal computed on version {proposal.snapshot_version} committed to the "
                f"older version {onto.version}"
            )
        self._proposal = proposal
        self._onto = onto
        self._config = learning
        self._gate = gate
        self._review = review
        self._consolidate = consolidate
        self._max_update_bytes = max_update_bytes
        self._holdout = holdout
        self._held_out = list(held_out)
        self._measure = measure
        self._merge_similar = merge_similar
        self._limit = max_update_bytes if measure is not None else None
        self._stats = msgspec.structs.replace(
            proposal.stats, stale_by=onto.version - proposal.snapshot_version
        )
        self._delta = proposal.delta
        self._add_tasks = dict(proposal.add_tasks)
        # What the ladder has made so far.
        self._base = onto  # what a fallback is applied onto (a consolidated playbook, maybe)
        self._consolidation: Consolidation | None = None
        self._rejection: Rejection | None = None
        self._report: GateReport | None = None
        self._fallbacks: list[Delta] = []
        self._waiting: set[str] = set()  # normalized ADDs earlier windows left with the gate
        self._left_out: list[LeftOut] = []  # new bullets the gate's review left out

    async def run(self) -> WindowResult:
        started = anyio.current_time()
        nothing = self._nothing_to_apply()
        if nothing is not None:
            return nothing
        self._rebase()
        self._take_pending()
        result = await self._within_budget(self._onto)
        result = await self._consolidated_near_budget(result)
        result = await self._merged_similar(result)
        applied_delta = self._delta
        self._rejection = result.rejected
        if not result.applied:
            self._fallbacks = [self._keep_only(True), self._keep_only(False)]
        elif not self._fits_size(result):
            self._fallbacks = [self._keep_only(True), self._keep_only(False)]
        else:
            result = await self._gated(result)
        result, applied_delta = self._fallen_back(result, applied_delta)
        result, applied_delta = await self._consolidation_reviewed(result, applied_delta)
        self._stats.consolidation = self._consolidation
        self._stats.delay_s += anyio.current_time() - started
        return self._size_bounded(self._built(result, applied_delta))

    # ---------------------------------------------------------------- the steps

    def _nothing_to_apply(self) -> WindowResult | None:
        """A window of held-out traces only: a version for their offsets; a window whose every
        reflection failed: nothing learned, nothing applied. None otherwise."""
        onto, delta, proposal = self._onto, self._delta, self._proposal
        if not delta.sources and self._held_out:
            bumped = apply(onto, empty(onto.key, onto.version), token_budget=None)
            return WindowResult(
                bumped.playbook, empty(onto.key, onto.version), delta, bumped, proposal.failed,
                proposal.reflections, self._stats, held_out=self._held_out,
                holdout=self._holdout,
            )  # fmt: skip
        if not delta.sources:
            unchanged = ApplyResult(playbook=onto, applied=False, tokens=playbook_tokens(onto))
            return WindowResult(
                onto, delta, delta, unchanged, proposal.failed, proposal.reflections, self._stats
            )
        return None

    def _rebase(self) -> None:
        if self._onto.version != self._delta.base_version:
            self._delta = rebase(self._delta, self._onto)

    def _take_pending(self) -> None:
        """The operations earlier windows left waiting for the gate (``Holdout.pending``) join
        this window's delta: one candidate, reviewed whole. Whatever becomes of it (published,
        refused, deferred again) is the pending operations' fate too."""
        holdout = self._holdout
        if holdout is None or not holdout.pending:
            return
        waiting = rebase(
            Delta(key=self._onto.key, operations=holdout.pending, base_version=self._onto.version),
            self._onto,
        )
        self._delta = merge(waiting, self._delta)
        self._holdout = msgspec.structs.replace(holdout, pending=[])
        # Reviewed against their own window's tasks already: not against this one's.
        for op in waiting.operations:
            if isinstance(op, AddOp):
                self._add_tasks.setdefault(normalize(op.content), [])
                self._waiting.add(normalize(op.content))

    async def _within_budget(self, base: Playbook, budget: int | None = -1) -> ApplyResult:
        """The review, then the delta applied onto ``base`` within ``budget`` (the token
        budget by default; None: no limit)."""
        proposal = self._proposal
        return await self._review(
            base, self._delta, proposal.tasks, budget=budget, own_tasks=self._add_tasks,
            refused=proposal.skipped, quoted=proposal.quoted,
        )  # fmt: skip

    async def _consolidated_near_budget(self, result: ApplyResult) -> ApplyResult:
        """Near the budget (tokens or bytes): the window's result consolidated (its own
        near-duplicates and the playbook's); if even that does not fit, the playbook alone is,
        and the window applied onto it."""
        onto = self._onto
        if not self._near_budget(result, self._size(result, self._delta)):
            return result
        # (What fit the budget is what no budget gives: not applied, nor reviewed, twice.)
        full = result if result.applied else await self._within_budget(onto, budget=None)
        merged, self._consolidation = await self._consolidate(full.playbook, self._stats)
        if self._consolidation is not None and self._fits(narrowed := narrowed_to(full, merged)):
            return narrowed
        self._base, self._consolidation = await self._consolidate(onto, self._stats)
        if self._consolidation is not None:
            return await self._within_budget(self._base)
        return result

    async def _merged_similar(self, result: ApplyResult) -> ApplyResult:
        """A new bullet that gives the advice another of its section gives (``merge_similar``,
        the learner's embedding check and merge): the candidate with those merged, so the
        rule stated once per case becomes one."""
        if self._merge_similar is None or self._consolidation is not None or not result.applied:
            return result
        new = set(result.added)
        merged, consolidation = await self._merge_similar(result.playbook, new, self._stats)
        if consolidation is None or not self._fits(narrowed := narrowed_to(result, merged)):
            return result
        self._consolidation = consolidation
        return narrowed

    def _fits_size(self, result: ApplyResult) -> bool:
        """Measured before the gate: a candidate that cannot be published is not reviewed
        (its rejection is the size's)."""
        limit = self._limit
        if limit is not None and (would_be := self._size(result, self._delta)) > limit:
            self._rejection = SizeRejection(limit=limit, would_be=would_be)
            return False
        return True

    async def _gated(self, result: ApplyResult) -> ApplyResult:
        """The gate's review, with the blame-prune: once more without the new bullets the
        agent relied on and failed with, so one bad lesson does not cost the window's good
        ones, nor get in with them (kept when the rest passes; else the first verdict stands).
        A refusal keeps nothing of the candidate: provenance only."""
        verdict = await self._reviewed_by_gate(result.playbook)
        self._report = verdict.report
        if verdict.holdout is not None:
            self._holdout = verdict.holdout
        if verdict.deferred:
            return self._deferred(result, verdict)
        if verdict.blame:
            by = verdict.report.gate if verdict.report is not None else self._gate.name
            pruned, second = await self._reviewed_without(result, verdict.blame, by=by)
            if second.deferred or second.accepted:
                self._note_left_out(result, verdict.blame, by)
            if second.deferred:
                # A gate chain's first gate blamed bullets and the next cannot judge yet: the
                # rest waits, as an unblamed window's would.
                return self._deferred(pruned, second)
            if second.accepted:
                result, verdict = pruned, second
        if not verdict.accepted:
            result, verdict = await self._split(result, verdict)
        if not verdict.accepted:
            self._rejection = GateRejection(gate=self._gate.name, reason=verdict.reason)
            self._base, self._consolidation = self._onto, None
            self._fallbacks = [self._keep_only(False)]
        return result

    def _deferred(self, result: ApplyResult, verdict: Verdict) -> ApplyResult:
        """Not judged: what the review kept waits for the next window's candidate; this
        version carries the window's tags and provenance (its traces are learned)."""
        waiting = changes(self._base, result.playbook)
        holdout = verdict.holdout or self._holdout or Holdout()
        self._holdout = msgspec.structs.replace(holdout, pending=waiting)
        self._base, self._consolidation = self._onto, None
        self._fallbacks = [self._keep_only(True), self._keep_only(False)]
        log.info("gate deferred the window", key=self._onto.key, reason=verdict.reason,
                 pending=len(waiting))  # fmt: skip
        return result

    async def _split(self, result: ApplyResult, verdict: Verdict) -> tuple[ApplyResult, Verdict]:
        """A refused candidate that carries both earlier windows' waiting lessons and this
        window's, reviewed as each part alone (the earlier windows' first: they waited only
        because the gate could not judge yet); the first that passes is kept. Without this, the
        first window the gate judges after a deferral decides the lessons of every window
        before it: a real 1.5B run lost three windows' lessons to one refusal (README, the
        eighth run). Each part is one more review of the same held-out tasks, so at most two
        more per window, and only on the window that ends a deferral."""
        # Told apart by text (ids may be given again when a consolidation re-applies the
        # delta); a merged bullet whose text is new counts as this window's.
        new = set(result.added)
        earlier = {
            i for i in new
            if (b := find_bullet(result.playbook, i)) and normalize(b.content) in self._waiting
        }  # fmt: skip
        own = new - earlier
        if not own or not earlier:
            return result, verdict
        for left_out in (own, earlier):
            part, second = await self._reviewed_without(
                result, sorted(left_out), split=True, by=self._gate.name
            )
            if second.accepted:
                log.info("gate passed a part of the refused candidate", key=self._onto.key,
                         left_out=len(left_out), kept=len(new) - len(left_out))  # fmt: skip
                self._note_left_out(result, sorted(left_out), f"{self._gate.name} (split)")
                return part, second
        return result, verdict

    async def _reviewed_without(
        self, result: ApplyResult, left_out: list[str], *, by: str, split: bool = False
    ) -> tuple[ApplyResult, Verdict]:
        """The gate's review of ``result`` without the bullets ``left_out`` (the blame-prune's
        and the split's second look): passed, the narrowed result, its report naming what was
        left out; deferred, the narrowed result; else ``result`` as it was, with the verdict."""
        part = without(result.playbook, set(left_out))
        verdict = await self._reviewed_by_gate(part)
        if verdict.deferred:
            return narrowed_to(result, part), verdict
        if not verdict.accepted:
            return result, verdict
        # A gate with nothing left to judge reports nothing (the lesson check, once every new
        # bullet is left out): the first report then stands, naming what was left out, so the
        # version still says which bullets the gate kept from its agents.
        report = verdict.report or self._report
        if report is not None:
            self._report = msgspec.structs.replace(
                report, pruned=left_out, split=split, pruned_by=by
            )
        return narrowed_to(result, part), verdict

    def _note_left_out(self, result: ApplyResult, bullet_ids: Iterable[str], by: str) -> None:
        for bullet_id in bullet_ids:
            bullet = find_bullet(result.playbook, bullet_id)
            if bullet is not None:
                self._left_out.append(LeftOut(bullet_id, bullet.content, by))

    def _fallen_back(self, result: ApplyResult, applied_delta: Delta) -> tuple[ApplyResult, Delta]:
        """The first fallback that applies within the budget (tags + provenance, provenance)."""
        for fallback in self._fallbacks:
            attempt = apply(self._base, fallback, token_budget=self._config.token_budget)
            if attempt.applied:
                # What the review refused stays counted: those operations are gone for good.
                kept = msgspec.structs.replace(
                    attempt, rejected=result.rejected, skipped=[*result.skipped, *attempt.skipped]
                )
                return kept, fallback
        return result, applied_delta

    async def _consolidation_reviewed(
        self, result: ApplyResult, applied_delta: Delta
    ) -> tuple[ApplyResult, Delta]:
        """The window did not fit even so (budget or size): the consolidation alone is still a
        change of the prompt, reviewed like any."""
        rejection = self._rejection
        if self._consolidation is None or rejection is None or rejection.kind == "gate":
            return result, applied_delta
        verdict = await self._reviewed_by_gate(result.playbook)
        self._report = verdict.report or self._report
        if not verdict.accepted:
            self._rejection = GateRejection(gate=self._gate.name, reason=verdict.reason)
            self._consolidation = None
            result = apply(self._onto, self._keep_only(False), token_budget=None)
            applied_delta = self._keep_only(False)
        return result, applied_delta

    def _size_bounded(self, out: WindowResult) -> WindowResult:
        """A fallback, the gate's regressions or the consolidation made it too large (a key
        near the limit): the exact bound holds for what is published, whatever made it."""
        limit, measure = self._limit, self._measure
        if limit is not None and measure is not None and (would_be := measure(out)) > limit:
            return size_rejected(out, self._onto, would_be, self._max_update_bytes)
        return out

    # ---------------------------------------------------------------- helpers

    def _built(
        self,
        applied: ApplyResult,
        applied_delta: Delta,
        *,
        final: bool = True,
    ) -> WindowResult:
        proposal = self._proposal
        return WindowResult(
            playbook=applied.playbook, delta=applied_delta, proposed=proposal.delta,
            applied=applied, failed=proposal.failed, reflections=proposal.reflections,
            stats=self._stats, rejection=self._rejection if final else None,
            held_out=list(self._held_out), holdout=self._holdout,
            report=self._report if final else None,
            left_out=list(self._left_out) if final else [],
        )  # fmt: skip

    def _size(self, applied: ApplyResult, applied_delta: Delta) -> int:
        """The bytes of the version ``applied`` would make (0 when nothing bounds it)."""
        if self._limit is None or self._measure is None or not applied.applied:
            return 0
        return self._measure(self._built(applied, applied_delta, final=False))

    def _fits(self, applied: ApplyResult) -> bool:
        return playbook_tokens(applied.playbook) <= self._config.token_budget and (
            self._limit is None or self._size(applied, self._delta) <= self._limit
        )

    def _near_budget(self, result: ApplyResult, size: int) -> bool:
        """Whether to consolidate: the playbook or the window's result is near the token
        budget, or the version it makes (``size`` bytes) near ``max_update_bytes``: a key of
        CJK lessons reaches the byte limit long before the token budget, and without this every
        later window of it would be rejected for size."""
        share = self._config.consolidate_at
        if share <= 0:
            return False
        line = share * self._config.token_budget
        if isinstance(result.rejected, BudgetRejection):
            return True
        if self._max_update_bytes is not None and size >= share * self._max_update_bytes:
            return True
        return playbook_tokens(self._onto) >= line or (result.applied and result.tokens >= line)

    def _keep_only(self, with_tags: bool) -> Delta:
        delta, onto = self._delta, self._onto
        tags = delta.tags if with_tags else []
        return Delta(key=onto.key, tags=tags, sources=delta.sources, base_version=onto.version)

    async def _reviewed_by_gate(self, playbook: Playbook) -> Verdict:
        onto, proposal = self._onto, self._proposal
        return await self._gate.review(
            Candidate(
                key=onto.key, parent=onto, playbook=playbook, delta=self._delta,
                reflections=proposal.reflections, holdout=self._holdout,
                add_traces=proposal.add_traces, retries=proposal.retries,
            )
        )  # fmt: skip


def size_rejected(
    result: WindowResult, onto: Playbook, would_be: int, max_update_bytes: int | None
) -> WindowResult:
    """``result``'s window as the smallest version it can make: committed onto ``onto``
    with its provenance only (no tags, no operations, no consolidation, the held-out
    tasks ``onto``'s version had, no operations waiting for the gate), rejected for size.
    Also what a driver publishes when the broker refuses ``result``'s record (``would_be``:
    its size)."""
    limit = max_update_bytes or would_be - 1
    provenance = Delta(key=onto.key, sources=result.delta.sources, base_version=onto.version)
    bumped = apply(onto, provenance, token_budget=None)
    held = {s.trace_id for s in result.held_out}
    holdout = result.holdout
    if holdout is not None:
        # The window's own held-out tasks are what grew it; operations waiting for the gate
        # may be too: the smallest version keeps neither.
        holdout = Holdout(
            tasks=[t for t in holdout.tasks if t.trace_id not in held],
            regressions=[t for t in holdout.regressions if t.trace_id not in held],
        )
    stats = msgspec.structs.replace(result.stats, consolidation=None)
    log.warning(
        "version too large: window rejected for size",
        key=onto.key,
        limit=limit,
        would_be=would_be,
    )
    return WindowResult(
        playbook=bumped.playbook, delta=provenance, proposed=result.proposed, applied=bumped,
        failed=result.failed, reflections=result.reflections, stats=stats,
        rejection=SizeRejection(limit=limit, would_be=would_be), held_out=result.held_out,
        holdout=holdout, report=result.report, left_out=result.left_out,
    )  # fmt: skip


def changes(before: Playbook, after: Playbook) -> list[Operation]:
    """The operations that make ``after``'s bullets of ``before``'s (counters aside): an ADD per
    new bullet, an UPDATE per changed text, a REMOVE per bullet gone; canonical order."""
    old = {b.id: b for s in before.sections for b in s.bullets}
    now = {b.id for s in after.sections for b in s.bullets}
    ops: list[Operation] = []
    for section in after.sections:
        for bullet in section.bullets:
            was = old.get(bullet.id)
            if was is None:
                ops.append(AddOp(section=section.name, content=bullet.content))
            elif was.content != bullet.content:
                ops.append(UpdateOp(bullet_id=bullet.id, content=bullet.content))
    ops.extend(RemoveOp(bullet_id=i) for i in old if i not in now)
    return canonical_operations(ops)


def without(playbook: Playbook, ids: set[str]) -> Playbook:
    """A copy of ``playbook`` without the bullets ``ids``."""
    out = copy_playbook(playbook)
    for section in out.sections:
        section.bullets = [b for b in section.bullets if b.id not in ids]
    return out


def narrowed_to(result: ApplyResult, playbook: Playbook) -> ApplyResult:
    """``result`` with ``playbook`` (its own, some bullets merged or left out) in its place."""
    kept = {b.id for s in playbook.sections for b in s.bullets}
    return msgspec.structs.replace(
        result,
        playbook=playbook,
        tokens=playbook_tokens(playbook),
        added=[i for i in result.added if i in kept],
        updated=[i for i in result.updated if i in kept],
    )


__all__ = [
    "Commit",
    "Consolidate",
    "MergeSimilar",
    "Review",
    "changes",
    "narrowed_to",
    "size_rejected",
    "without",
]
