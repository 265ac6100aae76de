"""A playbook that keeps learning past its budget: near the token budget the learner merges
near-duplicate bullets (the consolidator, on the curator's endpoint) and drops clearly harmful
ones, never truncating; against the simulator in process, whose curator writes every wording
of a lesson as a bullet of its own and whose consolidator recognises the wordings of one."""

from __future__ import annotations

import random
from contextlib import AbstractAsyncContextManager

import pytest
from engine_support import learned_in_memory, sim_learner

from combee_stream.config import Config, LearningConfig
from combee_stream.core.learner import Learner
from combee_stream.core.playbook import new_playbook, playbook_tokens
from combee_stream.schemas import Bullet, Feedback, PromptUpdate, Section, Trace
from combee_stream.sim.markers import VARIANT, base_id, marker_line, retained_ids
from combee_stream.sim.traces import lesson_text

KEY = "sim-k0"
LESSONS, WORDINGS = 24, 30
BUDGET = 1_200  # the 24 lessons, one bullet each, use about 70 % of it


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def learner(**learning: object) -> AbstractAsyncContextManager[Learner]:
    settings = LearningConfig(seed=0, token_budget=BUDGET, **learning)  # type: ignore[arg-type]
    return sim_learner(Config(learning=settings))


def worded_stream() -> list[Trace]:
    """Each lesson in 30 wordings; lessons come in over the whole stream (each one's wordings
    spread over about three lessons' worth of traces), 20x the budget in all."""
    rng = random.Random(5)
    slots = [(j + rng.uniform(0, 3), j, n) for j in range(LESSONS) for n in range(WORDINGS)]
    traces = []
    for i, (_, j, n) in enumerate(sorted(slots)):
        lesson = f"k0-l{j:03d}"
        text = f"{lesson_text(0, lesson)[:-1]} (noted in case family {n})."
        traces.append(
            Trace(
                key=KEY,
                trace_id=f"w-{i:05d}",
                task=f"Case {i} of the queue",
                feedback=Feedback(passed=False, text=marker_line(f"{lesson}{VARIANT}{n}", text)),
            )
        )
    return traces


async def learn(traces: list[Trace], **learning: object) -> list[PromptUpdate]:
    async with learner(**learning) as gated:
        return await learned_in_memory(gated, KEY, traces, 24)


def lessons_kept(update: PromptUpdate) -> set[str]:
    return {base_id(i) for i in retained_ids(update.playbook)}


@pytest.mark.anyio
async def test_a_key_fed_twenty_budgets_keeps_learning() -> None:
    traces = worded_stream()
    words = sum(len(t.feedback.text or "") for t in traces) / 4
    assert words > 20 * BUDGET  # the stream's lessons, as bullets, are 20 budgets' worth
    updates = await learn(traces)
    assert all(playbook_tokens(u.playbook) <= BUDGET for u in updates)  # never over the budget
    consolidated = [u for u in updates if u.stats.consolidated is not None]
    assert consolidated and all(c.stats.consolidated.merged for c in consolidated)  # type: ignore[union-attr]
    final = lessons_kept(updates[-1])
    assert len(final) >= 0.9 * LESSONS, sorted(final)  # lessons of the whole stream retained
    # Lessons that arrived after the budget first filled were still learned.
    first_full = next(u.version for u in updates if u.stats.consolidated is not None)
    late = lessons_kept(updates[-1]) - lessons_kept(updates[first_full - 1])
    assert late
    # Without consolidation, the same stream stops learning once the budget is full.
    stuck = await learn(traces, consolidate_at=0.0)
    assert all(playbook_tokens(u.playbook) <= BUDGET for u in stuck)
    assert sum(u.stats.rejection is not None for u in stuck) > len(stuck) // 2
    assert len(lessons_kept(stuck[-1])) < 0.5 * LESSONS


@pytest.mark.anyio
async def test_consolidation_merges_duplicates_drops_the_harmful_and_rewrites_nothing_else() -> (
    None
):
    one = f"k0-l001{VARIANT}"
    bullets = [
        Bullet(id="s-00001", content=marker_line(f"{one}1", "Check the refund policy."),
               helpful=2, sources=["t1"]),
        Bullet(id="s-00002", content=marker_line(f"{one}2", "Always check refund policy."),
               helpful=1, harmful=1, sources=["t2"]),
        Bullet(id="s-00003", content="Quote the order number in the reply.", helpful=1),
        Bullet(id="s-00004", content="Answer before looking anything up.", harmful=4),
    ]  # fmt: skip
    book = new_playbook(KEY)
    book.sections = [Section(name="STRATEGIES & INSIGHTS", bullets=bullets)]
    async with learner() as gated:
        out, report = await gated.consolidator.consolidate(book, gated.new_stats())
    assert report is not None
    assert report.merged == [["s-00001", "s-00002"]] and report.dropped == ["s-00004"]
    [section] = out.sections
    assert [b.id for b in section.bullets] == ["s-00001", "s-00003"]
    merged, untouched = section.bullets
    assert (merged.helpful, merged.harmful, merged.sources) == (3, 1, ["t1", "t2"])
    assert merged.content == marker_line("k0-l001", "Check the refund policy.")
    assert untouched == bullets[2]  # not a duplicate: not rewritten
    assert report.tokens_after < report.tokens_before
    assert book.sections[0].bullets == bullets  # the input is not modified


@pytest.mark.anyio
async def test_a_merge_that_drops_what_a_bullet_said_is_refused() -> None:
    from combee_stream.config import LearningConfig
    from combee_stream.core.learner import Learner
    from combee_stream.core.outputs import ConsolidatorOutput, Merge
    from combee_stream.llm import Completion
    from combee_stream.wiring import load_prompts

    npv = "When discounting cash flows given in thousands, write them in full units."
    sharpe = "When computing a Sharpe ratio, round it to the decimals the question asks for."
    capm = "When computing a CAPM return, round it to the decimals the question asks for."
    # What a 1.5B consolidator answered for such a section: all three into the first one.
    bad = Merge(bullet_ids=["s-1", "s-2", "s-3"], content=npv)
    # ... or two of them joined, which says what each said (the real run's NPV units rule and
    # Sharpe rounding rule, one bullet of two "When" sentences, MiniLM 0.86 and 0.56 to them).
    joined = Merge(bullet_ids=["s-1", "s-2"], content=f"{npv} {sharpe}")
    good = Merge(bullet_ids=["s-2", "s-3"], content="When computing a ratio, round it as asked.")

    class Consolidator:
        def __init__(self, merge: Merge) -> None:
            self.merge = merge

        async def complete(self, role: str, messages: object, output_type: object) -> Completion:  # type: ignore[type-arg]
            value = ConsolidatorOutput(merges=[self.merge])
            return Completion(value=value, tokens_in=1, tokens_out=1, cached=False, attempts=1,
                              latency_s=0.0)  # fmt: skip

    async def embed(texts: list[str]) -> list[list[float]]:
        # One axis for rounding, one for units: a text saying both points between them.
        return [[float("round" in t), float("thousands" in t)] for t in texts]

    book = new_playbook(KEY)
    bullets = [Bullet(id=f"s-{i}", content=t) for i, t in enumerate((npv, sharpe, capm), 1)]
    book.sections = [Section(name="STRATEGIES & INSIGHTS", bullets=bullets)]
    for merge, expected in ((bad, None), (joined, None), (good, [["s-2", "s-3"]])):
        learner = Learner(
            Consolidator(merge), LearningConfig(), prompts=load_prompts(), embed=embed,  # type: ignore[arg-type]
        )  # fmt: skip
        out, report = await learner.consolidator.consolidate(book, learner.new_stats())
        if expected is None:
            assert report is None and out == book  # refused: the section as it was
        else:
            assert report is not None and report.merged == expected
            assert [b.content for b in out.sections[0].bullets] == [npv, good.content]


@pytest.mark.anyio
async def test_bullets_that_give_the_same_advice_are_grouped_not_those_sharing_a_situation() -> (
    None
):
    from combee_stream.core.playbook import advice, similar_groups

    vocabulary = ("sharpe", "capm", "wacc", "sortino", "round", "decimal", "subtract", "risk")

    async def embed(texts: list[str]) -> list[list[float]]:  # bag of words
        return [[float(w in t.lower()) for w in vocabulary] for t in texts]

    sharpe_round = "When calculating the Sharpe ratio, round the result to 2 decimal places."
    capm_round = "When calculating the CAPM return, round the result to 2 decimal places."
    sharpe_rf = "When calculating the Sharpe ratio, subtract the risk-free rate first."
    wacc_round = "When computing the WACC, round the result to 2 decimal places."
    sortino_rf = "When computing the Sortino ratio, subtract the risk-free rate first."
    assert advice(sharpe_rf) == "subtract the risk-free rate first."
    book = new_playbook(KEY)
    book.sections = [
        Section(name="FORMULAS & CALCULATIONS", bullets=[
            Bullet(id="c-1", content=wacc_round), Bullet(id="c-2", content=sharpe_round),
            Bullet(id="c-3", content=sharpe_rf), Bullet(id="c-4", content=capm_round),
        ]),
        Section(name="COMMON MISTAKES TO AVOID", bullets=[
            Bullet(id="m-1", content=sortino_rf), Bullet(id="m-2", content=sharpe_rf),
        ]),
    ]  # fmt: skip
    # c-2 and c-3 share their situation, not their advice: only the rounding rules are one
    # group (the older c-1 with them); the second section has no new bullet.
    assert await similar_groups(book, {"c-3", "c-4"}, embed, 0.8) == [(0, ["c-1", "c-2", "c-4"])]
    assert await similar_groups(book, {"c-3"}, embed, 0.8) == []


@pytest.mark.anyio
async def test_a_group_is_shown_to_the_consolidator_alone_and_merged_within_itself() -> None:
    from combee_stream.core.learner import Learner
    from combee_stream.core.outputs import ConsolidatorOutput, Merge
    from combee_stream.llm import Completion
    from combee_stream.wiring import load_prompts

    rounding = "When computing a {}, round it to the decimals the question asks for."
    bullets = [
        Bullet(id="s-1", content=rounding.format("Sharpe ratio"), helpful=1, sources=["t1"]),
        Bullet(id="s-2", content="When a rate is given in percent, divide it by 100.", harmful=5),
        Bullet(id="s-3", content=rounding.format("CAPM return"), helpful=2, sources=["t3"]),
    ]
    book = new_playbook(KEY)
    book.sections = [Section(name="STRATEGIES & INSIGHTS", bullets=bullets)]
    merged_text = "When computing a Sharpe ratio or a CAPM return, round it as the question asks."

    class Consolidator:
        def __init__(self) -> None:
            self.shown: list[str] = []

        async def complete(
            self, role: str, messages: list[dict[str, str]], output_type: object
        ) -> Completion:  # type: ignore[type-arg]
            self.shown.append(messages[-1]["content"])
            merges = [
                Merge(bullet_ids=["s-1", "s-2"], content="s-2 is outside the group"),
                Merge(bullet_ids=["s-1", "s-3"], content=merged_text),
            ]
            return Completion(value=ConsolidatorOutput(merges=merges), tokens_in=1, tokens_out=1,
                              cached=False, attempts=1, latency_s=0.0)  # fmt: skip

    consolidator = Consolidator()
    learner = Learner(consolidator, LearningConfig(), prompts=load_prompts())  # type: ignore[arg-type]
    out, report = await learner.consolidator.consolidate(
        book, learner.new_stats(), groups=[(0, ["s-1", "s-3"])]
    )
    [shown] = consolidator.shown
    assert "[s-1]" in shown and "[s-3]" in shown and "[s-2]" not in shown
    assert report is not None and report.merged == [["s-1", "s-3"]] and report.refused == 1
    assert report.dropped == []  # a merge of similar bullets drops nothing, harmful or not
    [section] = out.sections
    assert [b.id for b in section.bullets] == ["s-1", "s-2"]
    assert (section.bullets[0].content, section.bullets[0].helpful) == (merged_text, 3)
    assert section.bullets[0].sources == ["t1", "t3"]
