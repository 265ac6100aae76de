"""A key's version chain, and the one place where a ``PromptUpdate`` is built.

Every driver holds one :class:`KeyChain` per key: the engine (restored from the compacted prompts
topic), offline ``learn`` (restored from ``history.jsonl``) and the benchmarks. A window's
:class:`~combee_stream.core.results.WindowResult` becomes the next version with
:meth:`KeyChain.next_update`; the driver writes it wherever it publishes, and only once it is
durable calls :meth:`KeyChain.advance`. An operator's re-seed (``prompts set``) goes through
:func:`seed_update`. So the stats of a version mean the same thing whoever wrote it (see
:class:`~combee_stream.schemas.UpdateStats`).

Decisions:

- ``parent_version`` is the version of the playbook the window was committed to; the first
  learned version (1) has parent 0, the implicit empty playbook, published or not.
- ``watermark`` carries, per traces-topic partition, the highest offset of the key's traces that
  this version and its ancestors learned; sources without a partition (files) add nothing.
- ``traces_learned`` counts distinct traces: a window's sources are distinct by construction,
  a trace at or below the watermark is never handed to a window again, and a trace id the chain
  has already seen (:meth:`KeyChain.seen`) is skipped: producers retry and agents re-send.
  The horizon of that check is bounded: the last ``horizon`` trace ids the driver handed to the
  key. Its durable part, the last ``horizon`` ids the key's versions learned
  (:attr:`KeyChain.horizon`, :meth:`KeyChain.horizon_after`), is what the driver keeps with
  each version (the engine: the dedup topic, in the version's transaction) and hands back to
  :meth:`KeyChain.restore`, so a restart, an eviction or a rebalance forgets nothing of it.
  Ids are held as 8-byte BLAKE2b digests (:func:`trace_digest`): the same size whatever an id's
  length, and a false match (a new trace taken for a re-send) has a chance of about
  ``horizon / 2**64`` per trace.
- **Size.** What publishing a version costs is measured by the learner's ``update_size``
  (the wiring gives every driver :func:`combee_stream.kafka.sizes.update_bytes`: the larger of
  its two record batches, framing included), bounded against ``kafka.max_message_bytes`` (the
  learner's size rejection, through :meth:`KeyChain.measure`); a record the sink's broker
  refuses all the same (a topic whose ``max.message.bytes`` an operator lowered) is
  :class:`UpdateTooLarge`.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import Final

from msgspec import Struct

from combee_stream.core.playbook import copy_playbook, new_playbook, render
from combee_stream.core.results import UpdateSize, WindowResult
from combee_stream.errors import CombeeError, DecodeError
from combee_stream.schemas import (
    Holdout,
    Playbook,
    PromptUpdate,
    UpdateStats,
    decode,
    encode,
    utcnow,
)

# What may differ between a measured update and the one sent: the digits of delay_s (a float)
# and of created_at (microseconds are left out when 0).
MEASURE_SLACK: Final = 64


class UpdateTooLarge(CombeeError):
    """A sink's broker refused a version's record as too large (MESSAGE_TOO_LARGE and the like):
    no retry can succeed, so the key pipeline publishes the window size-rejected instead."""

    def __init__(self, key: str, version: int, size: int, error: str) -> None:
        super().__init__(f"{key} v{version}: the broker refused {size} bytes: {error}")
        self.size = size


class WindowInfo(Struct, frozen=True, kw_only=True):
    """What the driver knows about the window beyond its result."""

    batch_size: int  # what the batch-size policy chose for it
    delay_s: float  # wall seconds from its close to now (driver-specific)
    reverted_to: int | None = None  # committed onto this version's playbook (see revert_onto)


DIGEST_BYTES: Final = 8


def trace_digest(trace_id: str) -> int:
    """The 8-byte digest a chain knows a trace id by."""
    digest = hashlib.blake2b(trace_id.encode(), digest_size=DIGEST_BYTES).digest()
    return int.from_bytes(digest, "big")


def pack_digests(digests: Iterable[int]) -> bytes:
    return b"".join(d.to_bytes(DIGEST_BYTES, "big") for d in digests)


def unpack_digests(packed: bytes) -> Iterator[int]:
    """The digests of ``packed`` (a trailing partial digest, which no writer makes, is left)."""
    for at in range(0, len(packed) - DIGEST_BYTES + 1, DIGEST_BYTES):
        yield int.from_bytes(packed[at : at + DIGEST_BYTES], "big")


class Restored(Struct, frozen=True):
    """A key's state read back by its driver: its newest version, and the horizon kept beside
    it (packed digests, written with version ``covers``; -1: none was found)."""

    update: PromptUpdate
    horizon: bytes = b""
    covers: int = -1


class KeyChain:
    """The newest durable version of one key, as its driver holds it."""

    def __init__(
        self,
        key: str,
        *,
        partition: int = -1,
        newest: PromptUpdate | None = None,
        horizon: int = 10_000,
    ):
        if newest is not None and newest.key != key:
            raise ValueError(f"update of key {newest.key!r} restored into chain {key!r}")
        self.key = key
        self.partition = partition  # the traces partition the key lives in; -1 offline
        self.newest = newest
        self._horizon = horizon
        # Handed to the key (learned, in flight or being reflected), newest last.
        self._recent: OrderedDict[int, None] = OrderedDict()
        # Learned by the published versions, packed, oldest first: what the driver keeps.
        self._learned = b""
        if newest is not None:
            self._learned = self.horizon_after(newest)
            for digest in unpack_digests(self._learned):
                self._remember(digest)

    def restore(self, update: PromptUpdate, horizon: bytes = b"", covers: int = -1) -> set[int]:
        """Take ``update`` (read back from where it was published) as the newest version, with
        the horizon kept beside it (``horizon``: packed digests written with version
        ``covers``). Returns the digests restored: what a re-send is recognised by."""
        if update.key != self.key:
            raise ValueError(f"update of key {update.key!r} restored into chain {self.key!r}")
        if self.newest is not None and update.version <= self.newest.version:
            return set()
        self.newest = update
        # A horizon written with an older version (one published without it: an operator's
        # re-seed, which learns nothing, or a build before the dedup topic) lacks the newest
        # version's ids: they are added.
        if covers >= update.version:
            self._learned = horizon[-self._horizon * DIGEST_BYTES :]
        else:
            self._learned = self.horizon_after(update, horizon)
        restored = set(unpack_digests(self._learned))
        for digest in unpack_digests(self._learned):
            self._remember(digest)
        return restored

    @property
    def horizon(self) -> bytes:
        """The digests of the last ``horizon`` trace ids the published versions learned."""
        return self._learned

    def horizon_after(self, update: PromptUpdate, before: bytes | None = None) -> bytes:
        """:attr:`horizon` once ``update`` is published (or on ``before``): what the driver
        keeps with it."""
        packed = (self._learned if before is None else before) + pack_digests(
            trace_digest(t) for t in _consumed(update)
        )
        return packed[-self._horizon * DIGEST_BYTES :]

    def seen(self, trace_id: str) -> bool:
        """Whether ``trace_id`` was handed to this key before (within the horizon); a new id
        is remembered. The driver skips a seen one: it is learned, in flight, or parked."""
        digest = trace_digest(trace_id)
        if digest in self._recent:
            self._recent.move_to_end(digest)
            return True
        self._remember(digest)
        return False

    def forget(self, trace_id: str) -> None:
        """``trace_id`` was parked, not learned: a replay of it must be learned."""
        self._recent.pop(trace_digest(trace_id), None)

    def _remember(self, digest: int) -> None:
        self._recent[digest] = None
        self._recent.move_to_end(digest)
        while len(self._recent) > self._horizon:
            self._recent.popitem(last=False)

    @property
    def playbook(self) -> Playbook:
        """The newest playbook (an empty one before the first version)."""
        return self.newest.playbook if self.newest is not None else new_playbook(self.key)

    @property
    def version(self) -> int:
        """The newest published version; -1 before any."""
        return self.newest.version if self.newest is not None else -1

    @property
    def watermark(self) -> int:
        """Highest offset of this key's traces in its partition already learned; -1 for none."""
        if self.newest is None:
            return -1
        return self.newest.watermark.get(self.partition, -1)

    @property
    def holdout(self) -> Holdout | None:
        """The key's held-out tasks (the replay gate), as of the newest version."""
        return self.newest.holdout if self.newest is not None else None

    @property
    def traces_learned(self) -> int:
        return self.newest.stats.traces_learned if self.newest is not None else 0

    def next_update(self, result: WindowResult, window: WindowInfo) -> PromptUpdate | None:
        """The version ``result`` makes of this chain; None when the window learned nothing
        (every reflection failed). ``result`` must be committed onto :attr:`playbook`."""
        learned = sorted(result.learned)
        consumed = sorted(result.consumed)
        if not consumed:
            return None
        parent = self.playbook
        book = result.playbook
        if book.version != parent.version + 1:
            raise ValueError(
                f"{self.key}: result v{book.version} was not committed onto v{parent.version}"
            )
        watermark = dict(self.newest.watermark) if self.newest is not None else {}
        for source in consumed:
            if source.partition >= 0:
                previous = watermark.get(source.partition, -1)
                watermark[source.partition] = max(previous, source.offset)
        stats = result.stats
        return PromptUpdate(
            key=self.key,
            version=book.version,
            parent_version=parent.version,
            playbook=book,
            prompt=render(book),
            stats=UpdateStats(
                traces_learned=self.traces_learned + len(learned),
                window_traces=len(learned),
                trace_ids=[s.trace_id for s in learned],
                strategy=stats.strategy,
                batch_size=window.batch_size,
                llm_calls=stats.llm_calls - stats.cached_calls,
                cached_calls=stats.cached_calls,
                tokens_in=stats.tokens_in,
                tokens_out=stats.tokens_out,
                delay_s=window.delay_s,
                bullets_added=len(result.applied.added),
                skipped=_skipped(result),
                rejection=result.rejection,
                held_out=[s.trace_id for s in result.held_out],
                gate=result.report,
                reverted_to=window.reverted_to,
                consolidated=stats.consolidation,
                deferred=len(result.holdout.pending) if result.holdout is not None else 0,
            ),
            watermark=watermark,
            created_at=utcnow(),
            holdout=result.holdout,
        )

    def measure(self, result: WindowResult, window: WindowInfo, size: UpdateSize) -> int:
        """``size`` of the version :meth:`next_update` would make of ``result`` (0 for none),
        plus :data:`MEASURE_SLACK`: the learner's bound on a candidate."""
        update = self.next_update(result, window)
        return 0 if update is None else size(update) + MEASURE_SLACK

    def advance(self, update: PromptUpdate) -> None:
        """Record ``update`` as published: the chain's new head."""
        if update.key != self.key or update.version <= self.version:
            raise ValueError(
                f"{self.key}: cannot advance v{self.version} to {update.key} v{update.version}"
            )
        self._learned = self.horizon_after(update)
        self.newest = update


def revert_onto(newest: Playbook, target: Playbook) -> Playbook:
    """``target``'s bullets under ``newest``'s version number: what a window is committed onto
    when the key's line since ``target`` was refused (canary) or rolled back. Bullet ids are
    never reused (``next_id`` only grows)."""
    out = copy_playbook(target)
    out.version, out.next_id = newest.version, max(newest.next_id, target.next_id)
    return out


def _consumed(update: PromptUpdate) -> list[str]:
    return [*update.stats.trace_ids, *update.stats.held_out]


def _skipped(result: WindowResult) -> dict[str, int]:
    counts: Counter[str] = Counter(op.reason for op in result.applied.skipped)
    if result.stats.uncited_tags:
        counts["uncited_tag"] = result.stats.uncited_tags
    if result.stats.covered_lessons:
        counts["covered_lesson"] = result.stats.covered_lessons
    return dict(sorted(counts.items()))


def seed_update(key: str, text: str, current: PromptUpdate | None) -> PromptUpdate:
    """The operator's system prompt ``text`` as a version of ``key``: version 0 of a new key, or
    the next version of an existing one with the learned bullets, counters and watermark kept
    (the caller decides whether that is allowed). Raises ``DecodeError`` for an invalid key."""
    # Struct constructors skip constraint checks; a round trip applies them (the key format).
    decode(encode(Playbook(key=key)), Playbook)
    if current is None:
        playbook = new_playbook(key, base_prompt=text)
        # Nothing learned yet: agents get the operator's prompt verbatim.
        return PromptUpdate(key=key, version=0, playbook=playbook, prompt=text, created_at=utcnow())
    if current.key != key:
        raise DecodeError(f"update of key {current.key!r} given as the current version of {key!r}")
    learned = current.playbook
    version = current.version + 1
    playbook = Playbook(
        key=key,
        version=version,
        base_prompt=text,
        sections=learned.sections,
        next_id=learned.next_id,
    )
    return PromptUpdate(
        key=key,
        version=version,
        parent_version=current.version,
        playbook=playbook,
        prompt=render(playbook),
        # A re-seed learns no trace: the cumulative count carries over, the window is empty.
        stats=UpdateStats(traces_learned=current.stats.traces_learned),
        watermark=current.watermark,
        created_at=utcnow(),
    )


__all__ = [
    "DIGEST_BYTES",
    "MEASURE_SLACK",
    "KeyChain",
    "Restored",
    "UpdateTooLarge",
    "WindowInfo",
    "pack_digests",
    "revert_onto",
    "seed_update",
    "trace_digest",
    "unpack_digests",
]
