"""Combee's Shuffle and Reduce: augmented shuffle, then an asynchronous merge tree.

One code path, three strategies (selected by name, :data:`STRATEGIES`):

- ``sequential``: windows of one trace, one curator call (ACE, batch 1);
- ``naive``: one curator call over the whole window (the overloaded baseline);
- ``combee``: duplicate every record ``p`` times, shuffle with a seeded RNG, split contiguously
  into ``k`` groups, one curator call per group on the same frozen snapshot, then combine.

Decisions where the paper (Combee notes §8) leaves a choice open:

- **k** = ``floor(sqrt(n))`` of the *original* n (both reference implementations), a single group
  when n < 4. With ``fan_in = f > 0`` instead: ``ceil(p*n / f)`` groups so no curator call sees
  more than f records, and combine nodes of at most f children stacked until one root (depth
  ``ceil(log_f k)``) — the deeper tree the paper suggests for thousands of traces.
- **Duplication** is dropped to 1 when there is a single group: a second copy in the same call
  adds tokens, not chances.
- **Groups** are contiguous slices of the shuffled multiset, sizes differing by at most one
  (reference code); two copies of a record may share a group.
- **Combine** defaults to the deterministic union (``delta.merge``, exact dedup after
  normalisation): it costs no LLM round, cannot drop a lesson, and is associative and commutative,
  so the result does not depend on tree shape or completion order. ``combine="llm"`` adds one
  combiner call per inner node (closer to the paper's Combine box; it can reconcile near
  duplicates and conflicts, at the price of one more LLM round per level and of the
  associativity, which an LLM does not have). Near duplicates under the union are left to the
  optional embedding dedup at apply.
- **No level barriers**: every node is a task of one task group that starts the moment its inputs
  are ready; children report to their parent over a memory object stream, and a union node folds
  each input as it arrives. The first failure cancels the whole tree and is re-raised.
- **Provenance** is the tree's job, not the LLM's: every node's output carries the union of its
  inputs' sources, whatever a combiner returns.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from msgspec import Struct

from combee_stream.core.delta import canonical, empty, merge
from combee_stream.schemas import Delta, Source

T = TypeVar("T")

StrategyName = Literal["combee", "naive", "sequential"]
CombineMode = Literal["union", "llm"]

Curate = Callable[[Sequence[T]], Awaitable[Delta]]
Combine = Callable[[Sequence[Delta]], Awaitable[Delta]]


class StrategySpec(Struct, frozen=True):
    """What distinguishes the strategies: window size and how the window is grouped."""

    name: StrategyName
    window_size: int | None  # forced window size (sequential: 1); None = the batch size
    single_group: bool  # one curator call over the window


STRATEGIES: Final[dict[str, StrategySpec]] = {
    "combee": StrategySpec(name="combee", window_size=None, single_group=False),
    "naive": StrategySpec(name="naive", window_size=None, single_group=True),
    "sequential": StrategySpec(name="sequential", window_size=1, single_group=True),
}


def strategy(name: str) -> StrategySpec:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r} (one of {', '.join(STRATEGIES)})") from None


class ScanParams(Struct, frozen=True):
    duplication: int = 2  # p
    fan_in: int = 0  # 0 = k = floor(sqrt(n)) and one combine node
    combine: CombineMode = "union"
    single_group: bool = False

    def __post_init__(self) -> None:
        if self.duplication < 1:
            raise ValueError(f"duplication must be >= 1, got {self.duplication}")
        if self.fan_in < 0:
            raise ValueError(f"fan_in must be >= 0, got {self.fan_in}")


class Plan(Struct, frozen=True):
    """How one window of n records is grouped."""

    n: int
    groups: int  # k
    duplication: int  # effective p


def plan(n: int, params: ScanParams) -> Plan:
    if n <= 0:
        return Plan(n=0, groups=0, duplication=1)
    if params.single_group:
        k = 1
    elif params.fan_in > 0:
        k = math.ceil(params.duplication * n / params.fan_in)
    else:
        k = 1 if n < 4 else math.isqrt(n)
    return Plan(n=n, groups=k, duplication=params.duplication if k > 1 else 1)


def split_contiguous(items: Sequence[T], k: int) -> list[list[T]]:
    """``k`` contiguous slices whose sizes differ by at most one (the first ones are larger)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    q, r = divmod(len(items), k)
    out: list[list[T]] = []
    start = 0
    for i in range(k):
        size = q + (1 if i < r else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out


def augmented_shuffle(
    items: Sequence[T], duplication: int, groups: int, rng: random.Random
) -> list[list[T]]:
    """Every item ``duplication`` times, shuffled, split contiguously into ``groups`` groups."""
    multiset = [item for item in items for _ in range(duplication)]
    rng.shuffle(multiset)
    return split_contiguous(multiset, groups)


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True, slots=True)
class _Leaf:
    group: int


@dataclass(frozen=True, slots=True)
class _Node:
    children: tuple[_Leaf | _Node, ...]


def tree_shape(k: int, fan_in: int) -> _Leaf | _Node:
    """Leaves 0..k-1 under combine nodes of at most ``fan_in`` children (all k when 0)."""
    level: list[_Leaf | _Node] = [_Leaf(i) for i in range(k)]
    if k == 1:
        return level[0]
    if fan_in <= 0:
        return _Node(tuple(level))
    width = max(2, fan_in)  # a node must combine at least two inputs to make progress
    while len(level) > 1:
        chunks = split_contiguous(level, math.ceil(len(level) / width))
        level = [chunk[0] if len(chunk) == 1 else _Node(tuple(chunk)) for chunk in chunks]
    return level[0]


def combine_depth(node: _Leaf | _Node) -> int:
    """Inner-node levels above the leaves (LLM rounds of an ``llm`` combine)."""
    if isinstance(node, _Leaf):
        return 0
    return 1 + max(combine_depth(child) for child in node.children)


class TreeStats(Struct):
    groups: int = 0
    curator_calls: int = 0
    combiner_calls: int = 0
    max_curator_items: int = 0  # records (copies included) in the largest curator call
    max_combiner_items: int = 0  # partial deltas in the largest combiner call
    combine_rounds: int = 0  # sequential LLM rounds after level 1 (0 for the union)


def _sources(deltas: Sequence[Delta]) -> list[Source]:
    return sorted({s for d in deltas for s in d.sources})


@dataclass(slots=True)
class _Run(Generic[T]):
    """The state of one tree reduction (kept per call: no module state)."""

    key: str
    groups: Sequence[Sequence[T]]
    curate: Curate[T]
    combine: Combine | None
    stats: TreeStats
    failure: list[BaseException]

    def spawn(
        self,
        tg: TaskGroup,
        node: _Leaf | _Node,
        index: int,
        out: MemoryObjectSendStream[tuple[int, Delta]],
    ) -> None:
        if isinstance(node, _Leaf):
            tg.start_soon(self._guard, tg, self._leaf, node, index, out)
            return
        send, receive = anyio.create_memory_object_stream[tuple[int, Delta]](len(node.children))
        with send:
            for i, child in enumerate(node.children):
                self.spawn(tg, child, i, send.clone())
        tg.start_soon(self._guard, tg, self._inner, node, index, receive, out)

    async def _guard(
        self, tg: TaskGroup, work: Callable[..., Awaitable[None]], *args: object
    ) -> None:
        try:
            await work(*args)
        except Exception as exc:  # the first failure stops the whole tree; re-raised by run()
            if not self.failure:
                self.failure.append(exc)
            tg.cancel_scope.cancel()

    async def _leaf(
        self, leaf: _Leaf, index: int, out: MemoryObjectSendStream[tuple[int, Delta]]
    ) -> None:
        async with out:
            group = self.groups[leaf.group]
            self.stats.curator_calls += 1
            self.stats.max_curator_items = max(self.stats.max_curator_items, len(group))
            delta = await self.curate(group)
            await out.send((index, delta))

    async def _inner(
        self,
        node: _Node,
        index: int,
        receive: MemoryObjectReceiveStream[tuple[int, Delta]],
        out: MemoryObjectSendStream[tuple[int, Delta]],
    ) -> None:
        async with out, receive:
            if self.combine is None:
                acc = empty(self.key)
                async for _, delta in receive:  # fold each input the moment it lands
                    acc = merge(acc, delta)
                result = canonical(acc)
            else:
                received = sorted([item async for item in receive], key=lambda x: x[0])
                partials = [delta for _, delta in received]  # child order, not finish order
                self.stats.combiner_calls += 1
                self.stats.max_combiner_items = max(self.stats.max_combiner_items, len(partials))
                combined = await self.combine(partials)
                result = merge(
                    canonical(Delta(key=self.key, operations=combined.operations)),
                    Delta(
                        key=self.key,
                        sources=_sources(partials),
                        base_version=min(d.base_version for d in partials),
                    ),
                )
            await out.send((index, result))


async def reduce_tree(
    key: str,
    groups: Sequence[Sequence[T]],
    curate: Curate[T],
    *,
    combine: Combine | None = None,
    fan_in: int = 0,
) -> tuple[Delta, TreeStats]:
    """Curate every group and combine the partial deltas up a tree (``combine=None``: union).

    Returns the canonical root delta and what the tree cost. The first exception of any node
    cancels the others and is re-raised as is.
    """
    stats = TreeStats(groups=len(groups))
    if not groups:
        return empty(key), stats
    shape = tree_shape(len(groups), fan_in)
    stats.combine_rounds = combine_depth(shape) if combine is not None else 0
    run = _Run(key=key, groups=groups, curate=curate, combine=combine, stats=stats, failure=[])
    send, receive = anyio.create_memory_object_stream[tuple[int, Delta]](1)
    async with anyio.create_task_group() as tg:
        run.spawn(tg, shape, 0, send)
    if run.failure:
        raise run.failure[0]
    with receive:
        _, root = receive.receive_nowait()
    return canonical(root), stats


__all__ = [
    "STRATEGIES",
    "Combine",
    "CombineMode",
    "Curate",
    "Plan",
    "ScanParams",
    "StrategyName",
    "StrategySpec",
    "TreeStats",
    "augmented_shuffle",
    "combine_depth",
    "plan",
    "reduce_tree",
    "split_contiguous",
    "strategy",
    "tree_shape",
]
