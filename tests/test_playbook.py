"""ACE playbook (apply, dedup, budget, render) and the delta monoid (merge, rebase)."""

from __future__ import annotations

import math

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from combee_stream.core import delta as dl
from combee_stream.core import playbook as pb
from combee_stream.schemas import (
    AddOp,
    Bullet,
    BulletTag,
    Delta,
    Operation,
    Playbook,
    RemoveOp,
    Section,
    Source,
    UpdateOp,
)
from combee_stream.tokens import estimate_tokens

KEY = "k"
WORDS = ["alpha", "Beta", "gamma", "delta", "LESSON[k-l1]:", "use", "x", "y"]
SECTIONS = [*pb.DEFAULT_SECTIONS[:3], "strategies & insights", "Made Up Section"]
IDS = ["strat-00001", "calc-00002", "code-00003", "misc-00004", "ghost-00099"]

# Small alphabets so collisions (duplicates after normalisation, repeated ids) are common.
contents = (
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)
    .map(" ".join)
    .flatmap(
        lambda text: st.sampled_from([text, text.upper(), f"  {text}!", text.replace(" ", "  ")])
    )
)
adds = st.builds(AddOp, section=st.sampled_from(SECTIONS), content=contents)
updates = st.builds(UpdateOp, bullet_id=st.sampled_from(IDS), content=contents)
removes = st.builds(RemoveOp, bullet_id=st.sampled_from(IDS))
operations: st.SearchStrategy[Operation] = st.one_of(adds, updates, removes)
tags = st.builds(
    BulletTag,
    bullet_id=st.sampled_from(IDS),
    tag=st.sampled_from(["helpful", "harmful", "neutral"]),
)
sources = st.builds(Source, trace_id=st.sampled_from(["t1", "t2", "t3", "t4"]))
deltas = st.builds(
    Delta,
    key=st.just(KEY),
    operations=st.lists(operations, max_size=6),
    tags=st.lists(tags, max_size=4),
    sources=st.lists(sources, max_size=3),
    base_version=st.integers(0, 3),
)


def seeded() -> Playbook:
    """A playbook with one bullet in each of the first four sections (ids from IDS)."""
    book = pb.new_playbook(KEY, base_prompt="You are a careful agent.")
    for i, (bullet_id, text) in enumerate(
        zip(IDS[:3], ["alpha use", "beta x", "gamma y"], strict=True)
    ):
        book.sections[i].bullets.append(Bullet(id=bullet_id, content=text, helpful=i))
    book.sections[6].bullets.append(Bullet(id=IDS[3], content="delta"))
    book.next_id = 5
    return book


@st.composite
def playbooks(draw: st.DrawFn) -> Playbook:
    book = pb.new_playbook(KEY)
    texts = draw(st.lists(contents, max_size=8))
    for i, text in enumerate(texts):
        section = draw(st.integers(0, len(book.sections) - 1))
        book.sections[section].bullets.append(
            Bullet(id=f"b-{i:05d}", content=text, helpful=draw(st.integers(0, 3)))
        )
    book.next_id = len(texts) + 1
    return book


# --------------------------------------------------------------------------- render, ids


def test_render_lists_base_prompt_then_sections_and_bullets() -> None:
    text = pb.render(seeded())
    assert text.startswith("You are a careful agent.\n\n## STRATEGIES & INSIGHTS\n")
    # Agents read bullets without counters; the curator's view carries them.
    assert "[strat-00001] alpha use\n" in text and "helpful=" not in text
    assert "[calc-00002] beta x\n" in text
    curator_view = pb.render(seeded(), counters=True)
    assert "[strat-00001] helpful=0 harmful=0 :: alpha use" in curator_view
    assert "[calc-00002] helpful=1 harmful=0 :: beta x" in curator_view
    assert text.index("## FORMULAS & CALCULATIONS") < text.index("## OTHERS")
    assert estimate_tokens(text) == math.ceil(len(text) / 4)
    assert pb.playbook_tokens(seeded()) == estimate_tokens(text)


def test_apply_allocates_global_ids_tags_first_then_ops_and_bumps_version() -> None:
    book = seeded()
    delta = Delta(
        key=KEY,
        operations=[
            AddOp(section="COMMON MISTAKES TO AVOID", content="check units"),
            AddOp(section="no such section", content="goes to others"),
            AddOp(section="formulas and calculations", content="net = gross - tax"),
            UpdateOp(bullet_id="calc-00002", content="beta x, twice"),
            RemoveOp(bullet_id="code-00003"),
            RemoveOp(bullet_id="ghost-00099"),
        ],
        tags=[
            BulletTag(bullet_id="strat-00001", tag="helpful"),
            BulletTag(bullet_id="strat-00001", tag="harmful"),
            BulletTag(bullet_id="calc-00002", tag="neutral"),
            BulletTag(bullet_id="ghost-00099", tag="helpful"),
        ],
    )
    result = pb.apply(book, delta, token_budget=None)
    assert result.applied and result.rejected is None
    out = result.playbook
    assert out.version == book.version + 1
    assert result.added == ["err-00005", "misc-00006", "calc-00007"]
    assert out.next_id == 8
    names = {s.name: [b.id for b in s.bullets] for s in out.sections}
    assert names["COMMON MISTAKES TO AVOID"] == ["err-00005"]
    assert names["OTHERS"] == ["misc-00004", "misc-00006"]
    assert names["FORMULAS & CALCULATIONS"] == ["calc-00002", "calc-00007"]
    assert names["CODE SNIPPETS & TEMPLATES"] == []
    first = pb.find_bullet(out, "strat-00001")
    assert first is not None and (first.helpful, first.harmful) == (1, 1)
    updated = pb.find_bullet(out, "calc-00002")
    assert updated is not None and updated.content == "beta x, twice" and updated.helpful == 1
    assert result.updated == ["calc-00002"] and result.removed == ["code-00003"]
    assert result.tagged == 3
    assert {(type(s.op).__name__, s.reason) for s in result.skipped} == {
        ("RemoveOp", "missing_bullet"),
        ("BulletTag", "missing_bullet"),
    }
    assert pb.find_bullet(book, "code-00003") is not None, "the input must not be mutated"


def test_apply_skips_exact_duplicates_after_normalisation() -> None:
    book = seeded()
    delta = Delta(
        key=KEY,
        operations=[
            AddOp(section="OTHERS", content="  ALPHA,   use!"),  # == strat-00001
            AddOp(section="OTHERS", content="new one"),
            AddOp(section="OTHERS", content="New One."),  # == the previous ADD
            UpdateOp(bullet_id="calc-00002", content="Gamma Y"),  # would equal code-00003
        ],
    )
    result = pb.apply(book, delta, token_budget=None)
    assert result.added == ["misc-00005"]
    assert [s.reason for s in result.skipped] == ["duplicate", "duplicate", "duplicate"]
    assert result.updated == []


def test_token_budget_rejection_is_structured_and_leaves_playbook_unchanged() -> None:
    book = seeded()
    before = pb.copy_playbook(book)
    current = pb.playbook_tokens(book)
    delta = Delta(key=KEY, operations=[AddOp(section="OTHERS", content="x " * 400)])
    result = pb.apply(book, delta, token_budget=current + 10)
    assert not result.applied
    assert result.playbook == before and book == before
    reason = result.rejected
    assert reason is not None and reason.kind == "token_budget"
    assert reason.budget == current + 10 and reason.current == current
    assert reason.would_be > reason.budget
    assert result.added == []
    # The same delta fits a larger budget, and a shrinking delta is allowed over budget.
    assert pb.apply(book, delta, token_budget=reason.would_be).applied
    shrink = Delta(key=KEY, operations=[RemoveOp(bullet_id="strat-00001")])
    assert pb.apply(book, shrink, token_budget=1).applied


@settings(max_examples=200, deadline=None)
@given(book=playbooks(), delta=deltas, budget=st.integers(1, 400))
def test_budget_is_never_exceeded_silently(book: Playbook, delta: Delta, budget: int) -> None:
    before = pb.copy_playbook(book)
    result = pb.apply(book, delta, token_budget=budget)
    assert book == before
    if result.applied:
        tokens = pb.playbook_tokens(result.playbook)
        assert tokens <= budget or tokens <= pb.playbook_tokens(book)
        assert result.playbook.version == book.version + 1
    else:
        assert result.playbook == before and result.rejected is not None
        assert result.rejected.would_be > budget


@settings(max_examples=200, deadline=None)
@given(
    book=playbooks(),
    section=st.integers(0, len(pb.DEFAULT_SECTIONS) - 1),
    data=st.data(),
)
def test_apply_never_changes_another_sections_bullets(
    book: Playbook, section: int, data: st.DataObject
) -> None:
    name = book.sections[section].name
    own = [b.id for b in book.sections[section].bullets] + ["ghost-00099"]
    ops = data.draw(
        st.lists(
            st.one_of(
                st.builds(AddOp, section=st.just(name), content=contents),
                st.builds(UpdateOp, bullet_id=st.sampled_from(own), content=contents),
                st.builds(RemoveOp, bullet_id=st.sampled_from(own)),
            ),
            max_size=6,
        )
    )
    tag_list = data.draw(
        st.lists(st.builds(BulletTag, bullet_id=st.sampled_from(own), tag=st.just("helpful")))
    )
    result = pb.apply(book, Delta(key=KEY, operations=ops, tags=tag_list), token_budget=None)
    for i, (old, new) in enumerate(zip(book.sections, result.playbook.sections, strict=False)):
        if i != section:
            assert old == new


@settings(max_examples=200, deadline=None)
@given(book=playbooks())
def test_dedup_is_idempotent_and_keeps_counters(book: Playbook) -> None:
    once = pb.dedup(book)
    assert pb.dedup(once) == once
    texts = [pb.normalize(b.content) for s in once.sections for b in s.bullets]
    assert len(texts) == len(set(texts))
    total = sum(b.helpful for s in book.sections for b in s.bullets)
    assert sum(b.helpful for s in once.sections for b in s.bullets) == total


@settings(max_examples=200, deadline=None)
@given(book=playbooks(), delta=deltas)
def test_apply_keeps_a_deduplicated_playbook_deduplicated(book: Playbook, delta: Delta) -> None:
    clean = pb.dedup(book)
    out = pb.apply(clean, delta, token_budget=None).playbook
    assert pb.dedup(out) == out


def test_semantic_dedup_skips_near_duplicates() -> None:
    vocabulary = ["refund", "policy", "currency", "cursor", "check", "the"]

    async def embed(texts: list[str]) -> list[list[float]]:
        return [[float(pb.normalize(t).split().count(w)) for w in vocabulary] for t in texts]

    book = pb.new_playbook(KEY)
    book.sections[0].bullets.append(Bullet(id="strat-00001", content="check the refund policy"))
    book.next_id = 2
    delta = Delta(
        key=KEY,
        operations=[
            AddOp(section="OTHERS", content="check the refund policy the"),  # near duplicate
            AddOp(section="OTHERS", content="follow the cursor"),
            AddOp(section="OTHERS", content="follow the cursor cursor"),  # near the previous
        ],
    )
    result = anyio.run(
        lambda: pb.apply_semantic(book, delta, token_budget=None, embed=embed, threshold=0.9)
    )
    assert result.added == ["misc-00002"]
    assert [s.reason for s in result.skipped] == ["near_duplicate", "near_duplicate"]
    assert pb.find_bullet(result.playbook, "misc-00002") is not None
    plain = pb.apply(book, delta, token_budget=None)
    assert len(plain.added) == 3, "without embeddings only exact duplicates are skipped"


# --------------------------------------------------------------------------- merge, rebase


@settings(max_examples=300, deadline=None)
@given(a=deltas, b=deltas, c=deltas)
def test_merge_is_associative(a: Delta, b: Delta, c: Delta) -> None:
    assert dl.merge(dl.merge(a, b), c) == dl.merge(a, dl.merge(b, c))


@settings(max_examples=300, deadline=None)
@given(a=deltas, b=deltas)
def test_merge_is_commutative_with_empty_identity(a: Delta, b: Delta) -> None:
    assert dl.merge(a, b) == dl.merge(b, a)
    assert dl.merge(a, dl.empty(KEY)) == dl.canonical(a) == dl.merge(dl.empty(KEY), a)
    if not dl.is_empty(a):  # an empty delta of any version is neutral for a non-empty one
        assert dl.merge(dl.empty(KEY, 7), a) == dl.canonical(a)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(deltas, min_size=1, max_size=5), book=playbooks(), data=st.data())
def test_applying_a_merged_delta_does_not_depend_on_merge_order(
    parts: list[Delta], book: Playbook, data: st.DataObject
) -> None:
    order = data.draw(st.permutations(parts))
    left = pb.apply(book, dl.merge_all(KEY, parts), token_budget=None).playbook
    right = pb.apply(book, dl.merge_all(KEY, order), token_budget=None).playbook
    assert left == right


@settings(max_examples=200, deadline=None)
@given(a=deltas, b=deltas)
def test_merge_dedups_operations_sums_tags_unions_sources(a: Delta, b: Delta) -> None:
    m = dl.merge(a, b)
    add_texts = [pb.normalize(op.content) for op in m.operations if isinstance(op, AddOp)]
    assert len(add_texts) == len(set(add_texts))
    assert sorted(m.tags) == m.tags and len(m.tags) == len(a.tags) + len(b.tags)
    assert m.sources == sorted(set(a.sources) | set(b.sources))
    assert {
        pb.normalize(op.content) for op in [*a.operations, *b.operations] if isinstance(op, AddOp)
    } == set(add_texts)


def test_merge_refuses_deltas_of_different_keys() -> None:
    with pytest.raises(ValueError, match="keys"):
        dl.merge(Delta(key="a"), Delta(key="b"))


def test_rebase_drops_ops_on_missing_bullets_and_adds_already_present() -> None:
    newest = seeded()
    newest.version = 5
    stale = Delta(
        key=KEY,
        operations=[
            AddOp(section="OTHERS", content="Alpha use."),  # already there (strat-00001)
            AddOp(section="OTHERS", content="fresh"),
            UpdateOp(bullet_id="ghost-00099", content="gone"),
            UpdateOp(bullet_id="calc-00002", content="beta x!!"),
            RemoveOp(bullet_id="ghost-00099"),
        ],
        tags=[
            BulletTag(bullet_id="ghost-00099", tag="helpful"),
            BulletTag(bullet_id="calc-00002", tag="helpful"),
        ],
        sources=[Source(trace_id="t1")],
        base_version=2,
    )
    rebased, dropped = dl.rebase_with_report(stale, newest)
    assert rebased.operations == [
        AddOp(section="OTHERS", content="fresh"),
        UpdateOp(bullet_id="calc-00002", content="beta x!!"),
    ]
    assert rebased.tags == [BulletTag(bullet_id="calc-00002", tag="helpful")]
    assert rebased.sources == stale.sources and rebased.base_version == 5
    assert sorted(d.reason for d in dropped) == ["already_present"] + ["missing_bullet"] * 3
    result = pb.apply(newest, dl.rebase(stale, newest), token_budget=None)
    assert result.skipped == []


@settings(max_examples=200, deadline=None)
@given(book=playbooks(), delta=deltas)
def test_a_rebased_delta_applies_without_skips_for_missing_ids(
    book: Playbook, delta: Delta
) -> None:
    result = pb.apply(book, dl.rebase(delta, book), token_budget=None)
    assert all(s.reason != "missing_bullet" for s in result.skipped)


def test_sections_and_slugs() -> None:
    assert pb.section_slug("STRATEGIES & INSIGHTS") == "strat"
    assert pb.section_slug("Common mistakes to avoid") == "err"
    assert pb.section_slug("Made Up Section") == "mus"
    assert pb.section_key("PROBLEM-SOLVING HEURISTICS") == "problem_solving_heuristics"
    book = Playbook(key=KEY, sections=[Section(name="ONLY")])
    out = pb.apply(
        book, Delta(key=KEY, operations=[AddOp(section="x", content="y")]), token_budget=None
    )
    assert [s.name for s in out.playbook.sections] == ["ONLY", "OTHERS"]
    assert out.added == ["misc-00001"]


def test_render_for_agents_omits_empty_sections_but_roles_see_them() -> None:
    book = pb.new_playbook("k", "Be brief.")
    assert pb.render(book) == "Be brief.\n"
    for_roles = pb.render(book, empty_sections=True)
    assert all(f"## {name}" in for_roles for name in pb.DEFAULT_SECTIONS)


def test_one_formula_detector_reads_operators_calls_and_percentages_not_list_marks() -> None:
    # The shapes a small model writes a rule in (issue 17's failures): percentages around an
    # operator, a call, a product with ×; and what is no formula: hyphenated words, a list mark.
    assert pb.formula_terms("(7% - 1.5%) / 8%") == ["7 - 1", "5 / 8"]
    assert pb.formula_terms("Interest = P × r × t") == ["interest = p", "r * t"]
    assert pb.formula_terms("use round(x, 2) for the answer") == ["round"]
    assert not pb.has_formula("the debt-to-equity ratio, +5 points")
    assert not pb.has_formula("Check these:\n- the units\n- the rounding")
    # The duplicate check reads the same detector as the review.
    assert not pb.says_more("Check these:\n- the units", "check the units")
    assert pb.says_more("When using CAPM, E(R) = Rf + beta * (Rm - Rf).", "use the CAPM formula")
