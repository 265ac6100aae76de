"""Deltas as a commutative monoid: ``merge`` is the associative operator of the Combee scan.

``merge(a, b)`` is a *canonical union*:

- operations are deduplicated after :func:`~combee_stream.core.playbook.normalize` — one ADD per
  normalised content (whatever the section), one UPDATE per (bullet id, normalised content),
  one REMOVE per bullet id — and the survivor of each duplicate group is the smallest under a
  total order, then everything is sorted in that order (ADDs, then UPDATEs, then REMOVEs).
  "Keep the minimum of each group, sort" is a semilattice operation, so it is associative,
  commutative and idempotent on operations;
- tags are a multiset sum (each tag is one vote of one trace), sorted;
- sources are a set union, sorted;
- ``base_version`` is the minimum over non-empty deltas (the oldest snapshot any part was
  computed on); an empty delta (no operations, tags or sources) is neutral for a non-empty one,
  two empty ones keep the larger version, so ``empty(key)`` (version 0) is the identity.

So the result of a tree of merges does not depend on its shape or on the order in which nodes
finish, and ids allocated by ``apply`` for a canonical delta are reproducible. The price: the
bullets a window adds land in canonical (alphabetical by normalised content) order rather than
the curator's proposal order; within one section that order carries no meaning in ACE.

``rebase(delta, onto)`` adapts a delta computed on an older snapshot to the newest playbook: it
drops UPDATE/REMOVE/tags whose bullet no longer exists and ADDs whose content is already there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec
from msgspec import Struct

from combee_stream.core.playbook import normalize, section_key
from combee_stream.schemas import AddOp, BulletTag, Delta, Operation, Playbook, UpdateOp

_OpKey = tuple[int, str, str, str, str]


def _sort_key(op: Operation) -> _OpKey:
    """Total order on operations; the first two fields (after the kind) are the dedup key."""
    if isinstance(op, AddOp):
        return (0, normalize(op.content), section_key(op.section), op.content, op.section)
    if isinstance(op, UpdateOp):
        return (1, op.bullet_id, normalize(op.content), op.content, "")
    return (2, op.bullet_id, "", "", "")


def _dedup_key(op: Operation) -> tuple[int, str, str]:
    kind, first, second, _, _ = _sort_key(op)
    if kind == 0:
        return (kind, first, "")  # one ADD per content, whatever the section
    return (kind, first, second)


def canonical_operations(ops: Iterable[Operation]) -> list[Operation]:
    out: list[Operation] = []
    seen: set[tuple[int, str, str]] = set()
    for op in sorted(ops, key=_sort_key):
        key = _dedup_key(op)
        if key not in seen:
            seen.add(key)
            out.append(op)
    return out


def is_empty(delta: Delta) -> bool:
    return not (delta.operations or delta.tags or delta.sources)


def empty(key: str, base_version: int = 0) -> Delta:
    """The identity of :func:`merge`."""
    return Delta(key=key, base_version=base_version)


def canonical(delta: Delta) -> Delta:
    """``delta`` in canonical form (what ``merge`` returns); ``merge(d, empty) == canonical(d)``."""
    return Delta(
        key=delta.key,
        operations=canonical_operations(delta.operations),
        tags=sorted(delta.tags),
        sources=sorted(set(delta.sources)),
        base_version=delta.base_version,
    )


def merge(a: Delta, b: Delta) -> Delta:
    """The canonical union of two deltas of the same key (associative and commutative)."""
    if a.key != b.key:
        raise ValueError(f"cannot merge deltas of keys {a.key!r} and {b.key!r}")
    if is_empty(b) and not is_empty(a):
        return canonical(a)
    if is_empty(a) and not is_empty(b):
        return canonical(b)
    if is_empty(a) and is_empty(b):  # max, so that empty(key) (version 0) is the identity
        return empty(a.key, max(a.base_version, b.base_version))
    return Delta(
        key=a.key,
        operations=canonical_operations([*a.operations, *b.operations]),
        tags=sorted([*a.tags, *b.tags]),
        sources=sorted({*a.sources, *b.sources}),
        base_version=min(a.base_version, b.base_version),
    )


def merge_all(key: str, deltas: Iterable[Delta]) -> Delta:
    out = empty(key)
    for delta in deltas:
        out = merge(out, delta)
    return canonical(out)


class Dropped(Struct, frozen=True):
    """An operation or tag that ``rebase`` removed, and why."""

    op: Operation | BulletTag
    reason: Literal["missing_bullet", "already_present"]


def rebase_with_report(delta: Delta, onto: Playbook) -> tuple[Delta, list[Dropped]]:
    """:func:`rebase`, also returning what was dropped."""
    if delta.key != onto.key:
        raise ValueError(f"delta for key {delta.key!r} rebased onto playbook {onto.key!r}")
    present_ids = {b.id for s in onto.sections for b in s.bullets}
    present_text = {normalize(b.content) for s in onto.sections for b in s.bullets}
    dropped: list[Dropped] = []
    ops: list[Operation] = []
    for op in delta.operations:
        if isinstance(op, AddOp):
            if normalize(op.content) in present_text:
                dropped.append(Dropped(op=op, reason="already_present"))
                continue
        elif op.bullet_id not in present_ids:
            dropped.append(Dropped(op=op, reason="missing_bullet"))
            continue
        ops.append(op)
    tags: list[BulletTag] = []
    for tag in delta.tags:
        if tag.bullet_id in present_ids:
            tags.append(tag)
        else:
            dropped.append(Dropped(op=tag, reason="missing_bullet"))
    rebased = msgspec.structs.replace(delta, operations=ops, tags=tags, base_version=onto.version)
    return rebased, dropped


def rebase(delta: Delta, onto: Playbook) -> Delta:
    """Adapt ``delta`` (computed on an older snapshot) to ``onto``: drop UPDATE/REMOVE/tags of
    bullets that are gone and ADDs whose content ``onto`` already has; sources are kept (the
    traces are still learned) and ``base_version`` becomes ``onto.version``."""
    return rebase_with_report(delta, onto)[0]


__all__ = [
    "Dropped",
    "canonical",
    "canonical_operations",
    "empty",
    "is_empty",
    "merge",
    "merge_all",
    "rebase",
    "rebase_with_report",
]
