"""Combee's augmented shuffle and asynchronous merge tree (in-process curator functions: these
tests exercise the tree, not an LLM)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from combee_stream.core import delta as dl
from combee_stream.core import scan
from combee_stream.schemas import AddOp, Delta, Operation, Source

KEY = "k"


def item_delta(item: int) -> Delta:
    """What a deterministic curator makes of one record: one or two ADDs, some shared."""
    ops: list[Operation] = [AddOp(section="OTHERS", content=f"lesson {item % 7}")]
    if item % 3 == 0:
        ops.append(AddOp(section="STRATEGIES & INSIGHTS", content=f"Insight {item}!"))
    return Delta(key=KEY, operations=ops, sources=[Source(trace_id=f"t{item:03d}")])


def make_curate(rng: random.Random, calls: list[int]) -> scan.Curate[int]:
    async def curate(group: Sequence[int]) -> Delta:
        calls.append(len(group))
        for _ in range(rng.randrange(0, 8)):  # finish in a random order
            await anyio.lowlevel.checkpoint()
        return dl.merge_all(KEY, [item_delta(i) for i in group])

    return curate


# --------------------------------------------------------------------------- shuffle


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 200),
    p=st.integers(1, 4),
    k=st.integers(1, 30),
    seed=st.integers(0, 2**32),
)
def test_shuffle_holds_every_item_p_times_in_near_equal_groups(
    n: int, p: int, k: int, seed: int
) -> None:
    items = list(range(n))
    groups = scan.augmented_shuffle(items, p, k, random.Random(seed))
    assert len(groups) == k
    assert Counter(x for g in groups for x in g) == Counter({i: p for i in items})
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1
    assert groups == scan.augmented_shuffle(items, p, k, random.Random(seed)), "seeded"


def test_shuffle_actually_shuffles() -> None:
    groups = scan.augmented_shuffle(list(range(40)), 2, 6, random.Random(1))
    assert [x for g in groups for x in g] != sorted([*range(40), *range(40)])


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 5000), p=st.integers(1, 3), fan_in=st.integers(0, 50))
def test_plan_group_counts(n: int, p: int, fan_in: int) -> None:
    got = scan.plan(n, scan.ScanParams(duplication=p, fan_in=fan_in))
    if fan_in == 0:
        assert got.groups == (1 if n < 4 else math.isqrt(n))
    else:
        assert math.ceil(p * n / got.groups) <= fan_in or got.groups == 1
        assert got.groups == math.ceil(p * n / fan_in)
    assert got.duplication == (p if got.groups > 1 else 1)
    single = scan.plan(n, scan.ScanParams(duplication=p, fan_in=fan_in, single_group=True))
    assert (single.groups, single.duplication) == (1, 1)


def test_plan_matches_the_paper_example() -> None:
    got = scan.plan(40, scan.ScanParams())
    assert (got.groups, got.duplication) == (6, 2)  # 80 records in groups of 13-14
    assert scan.strategy("sequential").window_size == 1
    assert scan.strategy("naive").single_group and not scan.strategy("combee").single_group
    with pytest.raises(ValueError, match="unknown strategy"):
        scan.strategy("bogus")


# --------------------------------------------------------------------------- tree


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 60), fan_in=st.integers(0, 9))
def test_tree_shape_respects_fan_in_and_holds_every_leaf_once(k: int, fan_in: int) -> None:
    shape = scan.tree_shape(k, fan_in)
    leaves: list[int] = []

    def walk(node: object) -> None:
        if isinstance(node, scan._Leaf):
            leaves.append(node.group)
            return
        assert isinstance(node, scan._Node)
        assert 2 <= len(node.children)
        if fan_in > 0:
            assert len(node.children) <= max(2, fan_in)
        for child in node.children:
            walk(child)

    walk(shape)
    assert sorted(leaves) == list(range(k))
    depth = scan.combine_depth(shape)
    if k == 1:
        assert depth == 0
    elif fan_in == 0:
        assert depth == 1
    else:
        assert depth == math.ceil(math.log(k, max(2, fan_in)) - 1e-9)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 120),
    p=st.integers(1, 3),
    fan_in=st.sampled_from([0, 2, 3, 5, 16]),
    seed=st.integers(0, 2**16),
    order_seed=st.integers(0, 2**16),
)
def test_union_result_is_independent_of_shape_fan_in_and_completion_order(
    n: int, p: int, fan_in: int, seed: int, order_seed: int
) -> None:
    items = list(range(n))
    expected = dl.merge_all(KEY, [item_delta(i) for i in items])

    async def run() -> tuple[Delta, scan.TreeStats, list[int]]:
        params = scan.ScanParams(duplication=p, fan_in=fan_in)
        window = scan.plan(n, params)
        groups = scan.augmented_shuffle(
            items, window.duplication, window.groups, random.Random(seed)
        )
        calls: list[int] = []
        curate = make_curate(random.Random(order_seed), calls)
        root, tree = await scan.reduce_tree(KEY, groups, curate, fan_in=fan_in)
        return root, tree, calls

    root, tree, calls = anyio.run(run)
    assert root == expected
    assert tree.curator_calls == len(calls) == tree.groups
    assert tree.max_curator_items == max(calls)
    assert tree.combiner_calls == 0 and tree.combine_rounds == 0
    if fan_in:
        assert tree.max_curator_items <= fan_in


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 80), fan_in=st.sampled_from([0, 2, 4]), order_seed=st.integers(0, 999))
def test_llm_combine_nodes_see_children_in_order_and_keep_provenance(
    n: int, fan_in: int, order_seed: int
) -> None:
    items = list(range(n))

    async def run() -> tuple[Delta, scan.TreeStats, list[int]]:
        window = scan.plan(n, scan.ScanParams(fan_in=fan_in))
        groups = scan.augmented_shuffle(items, window.duplication, window.groups, random.Random(0))
        rng = random.Random(order_seed)
        widths: list[int] = []

        async def combine(partials: Sequence[Delta]) -> Delta:
            widths.append(len(partials))
            for _ in range(rng.randrange(0, 5)):
                await anyio.lowlevel.checkpoint()
            # An "LLM" that keeps only the first operation of each partial and no sources.
            return Delta(key=KEY, operations=[d.operations[0] for d in partials if d.operations])

        root, tree = await scan.reduce_tree(
            KEY, groups, make_curate(rng, []), combine=combine, fan_in=fan_in
        )
        return root, tree, widths

    root, tree, widths = anyio.run(run)
    assert root.sources == sorted(Source(trace_id=f"t{i:03d}") for i in items)
    assert tree.combiner_calls == len(widths)
    assert tree.max_combiner_items == max(widths, default=0)
    assert tree.combine_rounds == (
        0 if tree.groups == 1 else scan.combine_depth(scan.tree_shape(tree.groups, fan_in))
    )
    if fan_in:
        assert all(w <= fan_in for w in widths)


def test_a_combine_node_starts_before_slow_siblings_finish() -> None:
    """No level barrier: with fan-in 2 and 4 groups, the node over groups 0-1 combines while
    groups 2-3 are still blocked."""

    async def run() -> list[str]:
        release = anyio.Event()
        log: list[str] = []

        async def curate(group: Sequence[int]) -> Delta:
            if group[0] >= 2:
                await release.wait()
            log.append(f"curated {group[0]}")
            return item_delta(group[0])

        async def combine(partials: Sequence[Delta]) -> Delta:
            ids = sorted(s.trace_id for d in partials for s in d.sources)
            log.append(f"combined {','.join(ids)}")
            if ids == ["t000", "t001"]:
                release.set()  # only now may the slow leaves finish
            return dl.merge_all(KEY, partials)

        with anyio.fail_after(30):  # a level barrier would deadlock here, not pass slowly
            await scan.reduce_tree(KEY, [[0], [1], [2], [3]], curate, combine=combine, fan_in=2)
        return log

    log = anyio.run(run)
    assert log.index("combined t000,t001") < log.index("curated 2")
    assert log[-1] == "combined t000,t001,t002,t003"


def test_first_failure_cancels_the_tree_and_is_raised_as_is() -> None:
    class Boom(Exception):
        pass

    async def run() -> list[int]:
        finished: list[int] = []

        async def curate(group: Sequence[int]) -> Delta:
            if group[0] == 1:
                raise Boom("curator failed")
            await anyio.sleep(5)
            finished.append(group[0])
            return item_delta(group[0])

        with pytest.raises(Boom):
            await scan.reduce_tree(KEY, [[0], [1], [2]], curate)
        return finished

    assert anyio.run(run) == []


def test_empty_window_is_the_empty_delta() -> None:
    async def never(group: Sequence[int]) -> Delta:
        raise AssertionError("no curator call for an empty window")

    root, tree = anyio.run(lambda: scan.reduce_tree(KEY, [], never))
    assert root == dl.empty(KEY) and tree.curator_calls == 0
