"""The commit ladder (core/commit.py) step by step, without an LLM: a window's proposal, a gate
that records what it was shown, and a size measure counted by hand."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import msgspec
import pytest

from combee_stream.config import LearningConfig
from combee_stream.core.commit import Commit, Review
from combee_stream.core.gate import AcceptAll, Candidate, Verdict
from combee_stream.core.playbook import ApplyResult, SkippedOp, apply, new_playbook
from combee_stream.core.results import LeftOut, Proposal, WindowResult, WindowStats
from combee_stream.schemas import (
    AddOp,
    BudgetRejection,
    Consolidation,
    Delta,
    GateRejection,
    GateReport,
    Playbook,
    SizeRejection,
    Source,
)

KEY = "k"
BUDGET = 10_000
SECTION = "STRATEGIES & INSIGHTS"
SOURCES = [Source("t1", 0, 1), Source("t2", 0, 2)]


class Recording:
    """A gate that answers ``verdicts`` in turn and keeps every candidate's bullets."""

    name = "recording"

    def __init__(self, *verdicts: Verdict) -> None:
        self.verdicts = list(verdicts)
        self.shown: list[list[str]] = []

    async def review(self, candidate: Candidate) -> Verdict:
        self.shown.append(bullets(candidate.playbook))
        return self.verdicts.pop(0) if self.verdicts else Verdict(accepted=True)


def reviewing(token_budget: int) -> Review:
    """The learner's review without its hygiene: the delta applied within the budget."""

    async def review(
        snapshot: Playbook,
        delta: Delta,
        tasks: Sequence[str],
        *,
        budget: int | None = -1,
        own_tasks: Mapping[str, Sequence[str]] | None = None,
        refused: Sequence[SkippedOp] = (),
        quoted: Sequence[str] = (),
    ) -> ApplyResult:
        return apply(snapshot, delta, token_budget=token_budget if budget == -1 else budget)

    return review


async def no_consolidation(
    playbook: Playbook, stats: WindowStats
) -> tuple[Playbook, Consolidation | None]:
    return playbook, None


def bullets(playbook: Playbook) -> list[str]:
    return [b.content for s in playbook.sections for b in s.bullets]


def proposal(*lessons: str) -> Proposal:
    delta = Delta(
        key=KEY,
        operations=[AddOp(section=SECTION, content=text) for text in lessons],
        sources=SOURCES,
    )
    return Proposal(KEY, 0, delta, [], [], WindowStats(strategy="combee", traces=2))


async def committed(
    lessons: Sequence[str],
    gate: Recording | AcceptAll,
    *,
    budget: int = BUDGET,
    limit: int | None = None,
) -> WindowResult:
    """``lessons`` committed onto an empty playbook; ``limit``: bytes, one per character of
    the version's bullets (a measure the test can count)."""

    def measure(result: WindowResult) -> int:
        return sum(len(text) for text in bullets(result.playbook))

    ladder = Commit(
        proposal(*lessons),
        new_playbook(KEY),
        learning=LearningConfig(token_budget=budget, consolidate_at=0),
        gate=gate,
        review=reviewing(budget),
        consolidate=no_consolidation,
        max_update_bytes=limit,
        measure=measure if limit is not None else None,
    )
    return await ladder.run()


def run(lessons: Sequence[str], gate: Recording | AcceptAll, **kw: int) -> WindowResult:
    async def main() -> WindowResult:
        return await committed(lessons, gate, **kw)

    return anyio.run(main)


def test_a_candidate_within_its_bounds_is_reviewed_once_and_published_whole() -> None:
    gate = Recording()
    result = run(["use the ledger", "check the units"], gate)
    assert gate.shown == [["use the ledger", "check the units"]]
    assert result.rejection is None and bullets(result.playbook) == gate.shown[0]
    assert result.learned == SOURCES


def test_a_candidate_over_the_size_bound_is_never_shown_to_the_gate() -> None:
    gate = Recording()
    # 14 + 15 characters of bullets: over a 20-byte bound, so the version falls back.
    result = run(["use the ledger", "check the units"], gate, limit=20)
    assert gate.shown == []
    assert result.rejection == SizeRejection(limit=20, would_be=29)
    assert bullets(result.playbook) == [] and result.learned == SOURCES


def test_a_candidate_over_the_token_budget_falls_back_to_provenance_unreviewed() -> None:
    gate = Recording()
    result = run(["a lesson far too long for a budget of a few tokens " * 4], gate, budget=5)
    assert gate.shown == []
    assert isinstance(result.rejection, BudgetRejection)
    assert bullets(result.playbook) == [] and result.learned == SOURCES


def test_the_gate_blame_is_pruned_and_the_rest_reviewed_again() -> None:
    first = new_playbook(KEY)
    blamed = apply(first, proposal("poison rule", "good rule").delta, token_budget=None)
    poison_id = blamed.added[0]
    gate = Recording(Verdict(accepted=False, reason="broke a task", blame=[poison_id]))
    result = run(["poison rule", "good rule"], gate)
    assert gate.shown == [["poison rule", "good rule"], ["good rule"]]
    assert result.rejection is None and bullets(result.playbook) == ["good rule"]
    # Its text is in no version: the window's result carries it for a report.
    assert result.left_out == [LeftOut(poison_id, "poison rule", "recording")]


def test_a_blame_of_every_new_bullet_is_still_reported() -> None:
    """The lesson check blames the window's only bullet; shown the parent again it has nothing
    to judge and reports nothing: the version keeps the first report, naming the bullet."""
    blamed = apply(new_playbook(KEY), proposal("vague rule").delta, token_budget=None)
    found = GateReport(gate="lessons", accepted=True, n=4, current=0.0, candidate=0.0, lower=0)
    gate = Recording(Verdict(accepted=True, blame=blamed.added, report=found))
    result = run(["vague rule"], gate)
    assert gate.shown == [["vague rule"], []]
    assert result.rejection is None and bullets(result.playbook) == []
    assert result.report is not None and result.report.pruned == blamed.added
    assert result.report.left_out() == "left out 1 new bullet(s) the lessons gate blamed"


def test_the_report_of_the_second_look_names_the_gate_whose_blame_left_bullets_out() -> None:
    """In a chain the lesson check blames and the replay gate reviews the rest: the version
    carries the replay gate's measurement, and the blame is the lesson check's, not its."""
    blamed = apply(new_playbook(KEY), proposal("vague rule", "good rule").delta, token_budget=None)
    found = GateReport(gate="lessons", accepted=True, n=2, current=0.0, candidate=0.5, lower=0)
    replayed = GateReport(gate="replay", accepted=True, n=20, current=0.4, candidate=0.5, lower=0)
    gate = Recording(
        Verdict(accepted=False, blame=[blamed.added[0]], report=found),
        Verdict(accepted=True, report=replayed),
    )
    result = run(["vague rule", "good rule"], gate)
    assert gate.shown == [["vague rule", "good rule"], ["good rule"]]
    assert result.report is not None and result.report.gate == "replay"
    assert result.report.pruned == [blamed.added[0]] and result.report.pruned_by == "lessons"
    assert result.report.left_out() == "left out 1 new bullet(s) the lessons gate blamed"
    assert result.left_out == [LeftOut(blamed.added[0], "vague rule", "lessons")]


def test_what_the_blame_leaves_waits_when_the_second_review_cannot_judge_yet() -> None:
    """A chain's lesson check blames a bullet, and the replay gate after it, shown the rest,
    has too few held-out tasks: the rest waits for the next review, not refused."""
    blamed = apply(new_playbook(KEY), proposal("vague rule", "good rule").delta, token_budget=None)
    wait = Verdict(accepted=False, reason="3 held-out task(s)", deferred=True)
    gate = Recording(Verdict(accepted=False, reason="fixed none", blame=[blamed.added[0]]), wait)
    result = run(["vague rule", "good rule"], gate)
    assert gate.shown == [["vague rule", "good rule"], ["good rule"]]
    assert result.rejection is None and bullets(result.playbook) == []
    assert result.holdout is not None
    assert result.holdout.pending == [AddOp(section=SECTION, content="good rule")]


def test_a_refused_candidate_keeps_nothing_of_its_window_but_its_provenance() -> None:
    gate = Recording(Verdict(accepted=False, reason="worse on held-out tasks"))
    result = run(["a rule the gate refuses"], gate)
    assert gate.shown == [["a rule the gate refuses"]]
    assert result.rejection == GateRejection(gate="recording", reason="worse on held-out tasks")
    assert bullets(result.playbook) == [] and result.delta.tags == []
    assert result.learned == SOURCES and result.playbook.version == 1


def test_a_gate_that_cannot_judge_yet_defers_and_the_next_window_is_reviewed_with_it() -> None:
    wait = Verdict(accepted=False, reason="3 held-out task(s)", deferred=True)
    gate = Recording(wait)

    async def main() -> tuple[WindowResult, WindowResult]:
        first = await committed(["round to the decimals asked"], gate)
        ladder = Commit(
            msgspec.structs.replace(proposal("write percentages as fractions"), snapshot_version=1),
            first.playbook, learning=LearningConfig(token_budget=BUDGET, consolidate_at=0),
            gate=gate, review=reviewing(BUDGET), consolidate=no_consolidation,
            max_update_bytes=None, holdout=first.holdout,
        )  # fmt: skip
        return first, await ladder.run()

    first, second = anyio.run(main)
    # Deferred: nothing served, nothing refused, the lesson waiting with the gate's state.
    assert first.rejection is None and bullets(first.playbook) == []
    assert first.learned == SOURCES and first.playbook.version == 1
    assert first.holdout is not None
    assert first.holdout.pending == [AddOp(section=SECTION, content="round to the decimals asked")]
    # The next candidate carries both windows' lessons, reviewed once, and publishes them.
    assert gate.shown[-1] == ["round to the decimals asked", "write percentages as fractions"]
    assert second.rejection is None and bullets(second.playbook) == gate.shown[-1]
    assert second.holdout is not None and second.holdout.pending == []


def deferred_then(
    second_lessons: Sequence[str], *verdicts: Verdict
) -> tuple[Recording, WindowResult]:
    """A first window deferred by the gate, then ``second_lessons`` committed with its waiting
    lessons, the gate answering ``verdicts`` to the candidates after the deferral."""
    gate = Recording(Verdict(accepted=False, reason="3 held-out task(s)", deferred=True), *verdicts)

    async def main() -> WindowResult:
        first = await committed(["round to the decimals asked"], gate)
        ladder = Commit(
            msgspec.structs.replace(proposal(*second_lessons), snapshot_version=1),
            first.playbook, learning=LearningConfig(token_budget=BUDGET, consolidate_at=0),
            gate=gate, review=reviewing(BUDGET), consolidate=no_consolidation,
            max_update_bytes=None, holdout=first.holdout,
        )  # fmt: skip
        return await ladder.run()

    return gate, anyio.run(main)


REFUSED = Verdict(accepted=False, reason="worse on held-out tasks")


def test_a_refused_candidate_after_a_deferral_keeps_the_earlier_windows_lessons_if_they_pass() -> (
    None
):
    passed = GateReport(gate="recording", accepted=True, n=10, current=0.5, candidate=0.6, lower=0)
    gate, result = deferred_then(
        ["scale every amount by a million"], REFUSED, Verdict(accepted=True, report=passed)
    )
    assert gate.shown[1:] == [
        ["round to the decimals asked", "scale every amount by a million"],
        ["round to the decimals asked"],
    ]
    assert result.rejection is None
    assert bullets(result.playbook) == ["round to the decimals asked"]
    # The report is of the part kept, and names the bullet of the part left out.
    assert result.report is not None and result.report.split
    [left] = result.report.pruned
    assert left not in {b.id for s in result.playbook.sections for b in s.bullets}
    assert (
        result.report.left_out() == "left out 1 new bullet(s) of one part (the whole was refused)"
    )
    assert result.left_out == [
        LeftOut(left, "scale every amount by a million", "recording (split)")
    ]


def test_then_this_windows_lessons_alone_and_a_refusal_of_both_parts_keeps_nothing() -> None:
    gate, result = deferred_then(
        ["write percentages as fractions"], REFUSED, REFUSED, Verdict(accepted=True)
    )
    assert gate.shown[-1] == ["write percentages as fractions"]
    assert result.rejection is None and bullets(result.playbook) == gate.shown[-1]

    gate, result = deferred_then(["write percentages as fractions"], REFUSED, REFUSED, REFUSED)
    assert len(gate.shown) == 4  # the deferral, the whole, and each part once
    assert result.rejection == GateRejection(gate="recording", reason="worse on held-out tasks")
    assert bullets(result.playbook) == [] and result.holdout is not None
    assert result.holdout.pending == []


def test_a_refused_candidate_of_one_window_is_not_split() -> None:
    gate = Recording(REFUSED, Verdict(accepted=True))
    result = run(["one rule", "another rule"], gate)
    assert gate.shown == [["one rule", "another rule"]]
    assert isinstance(result.rejection, GateRejection) and bullets(result.playbook) == []


def test_a_proposal_for_another_key_or_an_older_version_is_refused() -> None:
    with pytest.raises(ValueError, match="committed to"):
        Commit(
            proposal("x"), new_playbook("other"), learning=LearningConfig(), gate=AcceptAll(),
            review=reviewing(BUDGET), consolidate=no_consolidation, max_update_bytes=None,
        )  # fmt: skip


def test_a_new_bullet_close_to_another_has_the_candidate_consolidated_before_review() -> None:
    async def merge(
        playbook: Playbook, new: set[str], stats: WindowStats
    ) -> tuple[Playbook, Consolidation | None]:
        rounding = [b for s in playbook.sections for b in s.bullets if "round" in b.content]
        if len(rounding) < 2 or not any(b.id in new for b in rounding):
            return playbook, None
        out = playbook.__copy__()
        keep = [b for s in playbook.sections for b in s.bullets if "round" not in b.content]
        merged = msgspec.structs.replace(rounding[0], content="round every ratio as asked")
        out.sections = [msgspec.structs.replace(playbook.sections[0], bullets=[merged, *keep])]
        report = Consolidation(tokens_before=0, tokens_after=0, merged=[[b.id for b in rounding]])
        return out, report

    def commit(gate: Recording, *lessons: str) -> WindowResult:
        async def main() -> WindowResult:
            ladder = Commit(
                proposal(*lessons), new_playbook(KEY),
                learning=LearningConfig(token_budget=BUDGET, consolidate_at=0), gate=gate,
                review=reviewing(BUDGET), consolidate=no_consolidation, max_update_bytes=None,
                merge_similar=merge,
            )  # fmt: skip
            return await ladder.run()

        return anyio.run(main)

    gate = Recording()
    result = commit(gate, "round the Sharpe ratio", "round the CAPM return", "read the units")
    # The gate saw one rounding rule, not two, and the version says it was consolidated.
    assert gate.shown == [["round every ratio as asked", "read the units"]]
    assert bullets(result.playbook) == gate.shown[0]
    assert result.stats.consolidation is not None
    # Nothing close: no consolidation, the gate sees the window as it is.
    plain = Recording()
    assert commit(plain, "round the Sharpe ratio", "read the units").stats.consolidation is None
    assert plain.shown == [["round the Sharpe ratio", "read the units"]]
