"""History and labels: every version of a key (for ``kafka.history_versions``), its movable
labels, and every move of them, in one compacted topic co-partitioned with the prompts topic.

Record keys (all written to the partition the prompt key hashes to, so a key's history lives in
the partition number of its traces and its newest version):

- ``KEY@VERSION``: the ``PromptUpdate`` of that version, written by the engine in the same
  transaction as the prompts-topic record; the version ``history_versions`` older is deleted
  (tombstoned) in that transaction, so compaction keeps the last N of every key.
- ``KEY#labels``: the key's :class:`~combee_stream.schemas.Labels` (the newest record stands).
- ``KEY#move#SEQ``: one :class:`~combee_stream.schemas.LabelMove` per move, for audit; a move
  and the labels it produces are written in one transaction, so a move happens exactly once.

Labels: ``latest`` is the engine's newest version; ``production`` follows it until someone
pins it (a promotion of one version, or a rollback) and follows it again after a promotion
with no version; any other label points at one version.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any, Final

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

from combee_stream.config import CANARY_SECRET_ENV, KafkaConfig
from combee_stream.errors import DecodeError, UserError
from combee_stream.kafka.client import make_producer, start_client, stop_quietly
from combee_stream.kafka.reader import read_to_end
from combee_stream.schemas import LabelMove, Labels, PromptUpdate, decode, encode

LATEST: Final = "latest"
PRODUCTION: Final = "production"
CANDIDATE: Final = "candidate"
_LABELS: Final = "#labels"
_MOVE: Final = "#move#"
_PREVIOUS_KEPT: Final = 20


def partition_of(key: str, partitions: int) -> int:
    """The partition aiokafka's (and the Java client's) default partitioner gives ``key``."""
    return int(murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def version_key(key: str, version: int) -> bytes:
    return f"{key}@{version}".encode()


def history_records(update: PromptUpdate, keep: int) -> list[tuple[bytes, bytes | None]]:
    """What publishing ``update`` writes to the history topic: the version, and the tombstone
    of the version ``keep`` older."""
    records: list[tuple[bytes, bytes | None]] = [
        (version_key(update.key, update.version), encode(update))
    ]
    if update.version - keep >= 1:
        records.append((version_key(update.key, update.version - keep), None))
    return records


class KeyHistory(msgspec.Struct, kw_only=True):
    key: str
    versions: dict[int, PromptUpdate]
    labels: Labels
    moves: list[LabelMove]

    @property
    def newest(self) -> int | None:
        return max(self.versions) if self.versions else None

    def resolve(self, label: str) -> int | None:
        """The version ``label`` points at now (None: the key has no version, or no such
        label)."""
        return resolve(self.labels, label, self.newest)


def canary_key_id(secret: str) -> str:
    """What the labels record of the canary secret: enough to tell two secrets apart, nothing
    to recover one from."""
    return hmac.new(secret.encode(), b"combee canary key id", hashlib.sha256).hexdigest()[:16]


def in_canary(session: str, fraction: float, *, key: str = "", secret: str | None = None) -> bool:
    """Whether the agent session ``session`` is in the canary share ``fraction`` of prompt key
    ``key``: a hash of the id, so a session keeps its side for as long as the canary runs.
    With ``secret`` the hash is keyed (HMAC-SHA256 of key and session), so that whoever lacks
    the secret cannot pick a session in the arm of their choice; without it, the public hash
    of older engines."""
    if secret is None:
        digest = hashlib.sha256(f"canary:{session}".encode()).digest()[:8]
    else:
        message = f"canary:{key}\x00{session}".encode()
        digest = hmac.new(secret.encode(), message, hashlib.sha256).digest()[:8]
    return int.from_bytes(digest, "big") < fraction * 2**64


def canary_arm(labels: Labels, session: str, secret: str | None) -> bool | None:
    """Whether ``session`` is in the running canary's share (True: served the candidate), by
    the split the labels record; None when that split is keyed with a secret other than
    ``secret`` (or ``secret`` is None): the arm cannot be told."""
    if not labels.canary_key:
        return in_canary(session, labels.canary)
    if secret is None or canary_key_id(secret) != labels.canary_key:
        return None
    return in_canary(session, labels.canary, key=labels.key, secret=secret)


def resolve(
    labels: Labels,
    label: str,
    newest: int | None,
    session: str | None = None,
    secret: str | None = None,
) -> int | None:
    """The version ``label`` points at; an agent ``session`` in the canary share asking for
    production gets the candidate while a canary runs (a session whose arm cannot be told,
    not holding the canary's secret, gets production)."""
    if label == LATEST:
        return newest
    if label == PRODUCTION:
        candidate = labels.labels.get(CANDIDATE)
        if session and labels.canary > 0 and candidate is not None:
            if canary_arm(labels, session, secret):
                return candidate
        return newest if labels.production is None else labels.production
    return labels.labels.get(label)


def parse(record: Any, history: dict[str, KeyHistory], keys: frozenset[str] | None) -> None:
    """Fold one history-topic record into ``history`` (per key)."""
    name = record.key.decode() if record.key else ""
    if _MOVE in name:
        key = name.split(_MOVE, 1)[0]
    elif name.endswith(_LABELS):
        key = name[: -len(_LABELS)]
    else:
        key = name.rpartition("@")[0]
    if not key or (keys is not None and key not in keys):
        return
    entry = history.setdefault(
        key, KeyHistory(key=key, versions={}, labels=Labels(key=key), moves=[])
    )
    try:
        if _MOVE in name:
            if record.value is not None:
                entry.moves.append(decode(record.value, LabelMove))
        elif name.endswith(_LABELS):
            entry.labels = decode(record.value, Labels) if record.value else Labels(key=key)
        else:
            version = int(name.rpartition("@")[2])
            if record.value is None:
                entry.versions.pop(version, None)
            else:
                entry.versions[version] = decode(record.value, PromptUpdate)
    except (DecodeError, ValueError):
        return  # not ours to judge here: an undecodable record is skipped


async def read_history(
    cfg: KafkaConfig, key: str, env: Mapping[str, str] | None = None
) -> KeyHistory:
    """Everything the history topic holds of ``key`` now (committed records only)."""
    history: dict[str, KeyHistory] = {}
    partition = partition_of(key, cfg.partitions)
    records = await read_to_end(cfg, cfg.history_topic, partitions=[partition], env=env)
    for record in records:
        parse(record, history, frozenset({key}))
    found = history.get(key)
    if found is None:
        return KeyHistory(key=key, versions={}, labels=Labels(key=key), moves=[])
    found.moves.sort(key=lambda m: m.seq)
    return found


async def move_label(
    cfg: KafkaConfig,
    key: str,
    label: str,
    to_version: int | None,
    *,
    by: str,
    why: str = "",
    rollback: bool = False,
    approval: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> LabelMove:
    """Move ``label`` of ``key`` to ``to_version`` (None: ``production`` follows latest again,
    or, in approval mode, moves to the newest; another label is removed); with ``rollback``,
    move ``production`` back to where it pointed before (``to_version`` ignored). With
    ``approval`` (production only), switch approval mode on (production is pinned where it is,
    and from then on only a promotion moves it) or off. The labels and the audit record go in
    one transaction."""
    if label == LATEST:
        raise UserError("'latest' is the engine's newest version: it cannot be moved")
    history = await read_history(cfg, key, env)
    if history.newest is None:
        raise UserError(f"key {key!r} has no version on {cfg.history_topic}")
    labels = history.labels
    current = labels.production if label == PRODUCTION else labels.labels.get(label)
    previous = list(labels.previous)
    if rollback:
        if label != PRODUCTION:
            raise UserError("rollback moves production; use pin for other labels")
        if current is None:
            # It follows latest: back to the version before the newest (pinned there).
            older = [v for v in history.versions if v < history.newest]
            if not older:
                raise UserError(f"{key!r} has no version before {history.newest} to roll back to")
            to_version, previous = max(older), [*previous, None][-_PREVIOUS_KEPT:]
        elif previous:
            to_version = previous.pop()  # None: it followed latest before it was pinned
        else:
            raise UserError(f"production of {key!r} was never moved: nothing to roll back to")
    elif label == PRODUCTION:
        if approval is not None:  # on: pinned where it is now; off: stays until a promotion
            to_version = resolve(labels, PRODUCTION, history.newest) if approval else current
        elif to_version is None and labels.approval:
            to_version = history.newest  # approval mode: a promotion pins the newest
        if to_version != current:
            previous = [*previous, current][-_PREVIOUS_KEPT:]
    if to_version is not None and to_version not in history.versions:
        raise UserError(
            f"version {to_version} of {key!r} is not in the history (kept: "
            f"{sorted(history.versions)}; kafka.history_versions = {cfg.history_versions})"
        )
    if approval is not None and label != PRODUCTION:
        raise UserError("approval mode is a property of production")
    if label == PRODUCTION:
        moved = msgspec.structs.replace(
            labels,
            production=to_version,
            previous=previous,
            approval=labels.approval if approval is None else approval,
        )
    else:
        moved = _pointed(labels, label, to_version)
    moved, move = _recorded(
        labels, moved, label, to_version, history.newest, by=by, why=why, approval=approval
    )
    await _write(cfg, key, moved, [move], env)
    return move


async def engine_move(
    cfg: KafkaConfig,
    key: str,
    changes: Mapping[str, int | None],
    *,
    why: str,
    canary: float | None = None,
    canary_key: str | None = None,
    by: str = "combee-stream engine",
    env: Mapping[str, str] | None = None,
) -> KeyHistory:
    """The engine's own moves (the live canary, automatic rollback), read fresh and written in
    one transaction: each label of ``changes`` to its version (production: pinned there, 0 for
    "nothing yet"; another label: None removes it), the canary share and the id of its split's
    key if given, one audit record per label that moved. Returns the history as it is
    afterwards."""
    history = await read_history(cfg, key, env)
    labels, moves = history.labels, []
    for label, to in changes.items():
        if label == PRODUCTION:
            if to == labels.production:
                continue
            previous = [*labels.previous, labels.production][-_PREVIOUS_KEPT:]
            moved = msgspec.structs.replace(labels, production=to, previous=previous)
        else:
            if labels.labels.get(label) == to:
                continue
            moved = _pointed(labels, label, to)
        labels, move = _recorded(labels, moved, label, to, history.newest, by=by, why=why)
        moves.append(move)
    if canary is not None and canary != labels.canary:
        labels = msgspec.structs.replace(labels, canary=canary)
    if canary_key is not None and canary_key != labels.canary_key:
        labels = msgspec.structs.replace(labels, canary_key=canary_key)
    if labels != history.labels:
        await _write(cfg, key, labels, moves, env)
        history.labels = labels
        history.moves.extend(moves)
    return history


def _pointed(labels: Labels, label: str, to: int | None) -> Labels:
    """``labels`` with ``label`` (not production) at ``to``; None removes it."""
    others = {k: v for k, v in labels.labels.items() if k != label}
    if to is not None:
        others[label] = to
    return msgspec.structs.replace(labels, labels=others)


def _recorded(
    before: Labels,
    after: Labels,
    label: str,
    to: int | None,
    newest: int | None,
    *,
    by: str,
    why: str,
    approval: bool | None = None,
) -> tuple[Labels, LabelMove]:
    """The move from ``before`` to ``after``: ``after`` numbered, and its audit record."""
    seq = before.seq + 1
    move = LabelMove(
        key=before.key,
        seq=seq,
        label=label,
        from_version=resolve(before, label, newest),
        to_version=to,
        approval=approval,
        by=by,
        why=why,
        at=dt.datetime.now(dt.UTC),
    )
    return msgspec.structs.replace(after, seq=seq), move


async def _write(
    cfg: KafkaConfig,
    key: str,
    labels: Labels,
    moves: list[LabelMove],
    env: Mapping[str, str] | None,
) -> None:
    """The labels and the audit records of their moves, in one transaction."""
    partition = partition_of(key, cfg.partitions)
    # One transactional id per key: two writers moving one key's labels at once are
    # serialised (the later one fences the earlier), and a move is all or nothing.
    producer = make_producer(cfg, env, transactional_id=f"combee-labels.{cfg.history_topic}.{key}")
    await start_client(producer, cfg)
    try:
        async with producer.transaction():
            await _send(producer, cfg, partition, f"{key}{_LABELS}".encode(), encode(labels))
            for move in moves:
                name = f"{key}{_MOVE}{move.seq:08d}".encode()
                await _send(producer, cfg, partition, name, encode(move))
    finally:
        await stop_quietly(producer)


async def _send(
    producer: AIOKafkaProducer, cfg: KafkaConfig, partition: int, key: bytes, value: bytes | None
) -> None:
    await producer.send(cfg.history_topic, value=value, key=key, partition=partition)


__all__ = [
    "CANARY_SECRET_ENV",
    "CANDIDATE",
    "LATEST",
    "PRODUCTION",
    "KeyHistory",
    "canary_arm",
    "canary_key_id",
    "engine_move",
    "history_records",
    "in_canary",
    "move_label",
    "parse",
    "partition_of",
    "read_history",
    "resolve",
    "version_key",
]
