"""Operator commands on a key's prompt versions: ``prompts set`` (start or re-seed a key from
your own system prompt), ``prompts promote|rollback|pin|labels`` (move and show labels, every
move audited) and ``inspect`` (the newest prompt, the versions on the topic, labels, diffs, a
bullet's provenance)."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Any

import anyio

from combee_stream.config import Config
from combee_stream.core.playbook import find_bullet
from combee_stream.core.versions import seed_update
from combee_stream.errors import DecodeError, UserError
from combee_stream.kafka.client import make_producer, start_client
from combee_stream.kafka.history import CANDIDATE, PRODUCTION, move_label, read_history
from combee_stream.kafka.producer import publish_update
from combee_stream.kafka.reader import content_digest, read_updates
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.schemas import PromptUpdate, encode


def register(sub: Any) -> None:
    prompts = sub.add_parser("prompts", help="operate on prompt versions")
    prompts_sub = prompts.add_subparsers(dest="prompts_command", required=True)
    seed = prompts_sub.add_parser(
        "set", help="publish a seed prompt (version 0) for a key from your own system prompt"
    )
    seed.add_argument("key")
    seed.add_argument("file", help="text file holding the system prompt")
    seed.add_argument(
        "--force",
        action="store_true",
        help="key already has versions: publish the new base prompt as the next version, "
        "keeping the learned bullets",
    )
    seed.set_defaults(handler=_prompts_set)

    who = argparse.ArgumentParser(add_help=False)
    who.add_argument("--why", default="", help="the reason, kept in the audit record")
    who.add_argument(
        "--by", default=None, help="who moves it (default: $USER), kept in the audit record"
    )
    promote = prompts_sub.add_parser(
        "promote",
        parents=[who],
        help="point production at a version (default: make it follow the newest again)",
    )
    promote.add_argument("key")
    promote.add_argument("--version", type=int, default=None)
    promote.add_argument("--label", default="production", help="the label to move")
    promote.set_defaults(handler=_promote)
    rollback = prompts_sub.add_parser(
        "rollback",
        parents=[who],
        help="move production back to the version it pointed at before (or --version V)",
    )
    rollback.add_argument("key")
    rollback.add_argument("--version", type=int, default=None)
    rollback.set_defaults(handler=_rollback)
    pin = prompts_sub.add_parser("pin", parents=[who], help="point a label at a version")
    pin.add_argument("key")
    pin.add_argument("label")
    pin.add_argument("version", type=int)
    pin.set_defaults(handler=_pin)
    approval = prompts_sub.add_parser(
        "approval",
        parents=[who],
        help="approval mode: production stays where it is until `prompts promote` (on), or "
        "follows latest again after the next promotion (off)",
    )
    approval.add_argument("key")
    approval.add_argument("state", choices=["on", "off"])
    approval.set_defaults(handler=_approval)
    labels = prompts_sub.add_parser("labels", help="a key's labels and every move of them")
    labels.add_argument("key")
    labels.set_defaults(handler=_labels)

    inspect = sub.add_parser("inspect", help="show a key's playbook, versions and a diff")
    inspect.add_argument("key")
    inspect.add_argument(
        "--diff", nargs=2, type=int, metavar=("OLD", "NEW"), help="diff two versions' prompts"
    )
    inspect.add_argument("--json", action="store_true", help="print the newest update as JSON")
    inspect.add_argument(
        "--why",
        metavar="BULLET",
        default=None,
        help="where a bullet came from: the versions that carry it, its counters, and the trace "
        "ids of the windows that added or changed it",
    )
    inspect.set_defaults(handler=_inspect)


async def _prompts_set(args: argparse.Namespace, config: Config) -> int:
    try:
        text = await anyio.Path(args.file).read_text()
    except FileNotFoundError:
        raise UserError(f"{args.file}: file not found") from None
    update = await seed_prompt(config, args.key, text, force=args.force)
    print(encode(update).decode())
    return 0


async def seed_prompt(config: Config, key: str, text: str, *, force: bool = False) -> PromptUpdate:
    """Publish the operator's system prompt for ``key`` (version 0, or the next one with force)."""
    async with PromptSubscriber(config.kafka, keys={key}) as prompts:
        current = prompts.latest(key)
    if current is not None and not force:
        raise UserError(
            f"key {key!r} already has version {current.version}; use --force to publish this "
            "base prompt as the next version (learned bullets are kept)"
        )
    try:
        update = seed_update(key, text, current)
    except DecodeError as exc:
        raise UserError(f"invalid key {key!r}: {exc}") from None
    producer = make_producer(config.kafka)
    await start_client(producer, config.kafka)
    try:
        await publish_update(producer, config.kafka, update)
    finally:
        await producer.stop()
    return update


async def read_versions(config: Config, key: str) -> tuple[list[PromptUpdate], list[int]]:
    """Every version of ``key`` still on the prompts topic (compaction keeps the newest), the
    first published of each when a version was written twice, and the forked version numbers
    (two different updates with one number)."""
    versions: dict[int, PromptUpdate] = {}
    forks: set[int] = set()
    for update in await read_updates(config.kafka, keys={key}):
        first = versions.setdefault(update.version, update)
        if first is not update and content_digest(first) != content_digest(update):
            forks.add(update.version)  # the subscriber's and the restore's comparison
    return [versions[v] for v in sorted(versions)], sorted(forks)


async def _inspect(args: argparse.Namespace, config: Config) -> int:
    versions, forks = await read_versions(config, args.key)
    if forks:
        print(
            f"combee-stream inspect: FORK: versions {forks} of {args.key!r} were published "
            "twice with different content; the first published of each is the one served and "
            "restored until compaction, which keeps only the key's last record (see README, "
            "guarantees)",
            file=sys.stderr,
        )
    if not versions:
        raise UserError(f"no versions of key {args.key!r} on {config.kafka.prompts_topic}")
    by_version = {u.version: u for u in versions}
    newest = versions[-1]
    out = sys.stdout
    if args.json:
        out.write(json.dumps(json.loads(encode(newest)), indent=2) + "\n")
        return 0
    if args.why:
        return _why(args.key, args.why, versions)
    if args.diff:
        old, new = args.diff
        missing = [v for v in (old, new) if v not in by_version]
        if missing:
            raise UserError(
                f"versions {missing} are not on the topic (compaction keeps only recent ones); "
                f"available: {sorted(by_version)}"
            )
        diff = difflib.unified_diff(
            by_version[old].prompt.splitlines(),
            by_version[new].prompt.splitlines(),
            f"{args.key} v{old}",
            f"{args.key} v{new}",
            lineterm="",
        )
        out.write("\n".join(diff) + "\n")
        return 0
    out.write(f"# {args.key} — version {newest.version}\n\n")
    try:
        history = await read_history(config.kafka, args.key)
    except UserError:  # no history topic (created before it existed): no labels to show
        history = None
    if history is not None and history.moves:
        last = history.moves[-1]
        out.write(
            f"production serves version {history.resolve(PRODUCTION)} (moved {len(history.moves)}"
            f" time(s); last: {last.label} {last.from_version} -> {last.to_version} by {last.by}"
            f"{': ' + last.why if last.why else ''}; see `prompts labels`)\n\n"
        )
    out.write(newest.prompt.rstrip() + "\n\n## versions on the topic\n\n")
    out.write("version  parent  traces  learned  window  bullets  created  notes\n")
    for u in versions:
        bullets = sum(len(s.bullets) for s in u.playbook.sections)
        created = u.created_at.isoformat(timespec="seconds") if u.created_at else "-"
        out.write(
            f"{u.version:>7}  {u.parent_version:>6}  {u.stats.traces_learned:>6}  "
            f"{u.stats.window_traces:>7}  {u.stats.batch_size:>6}  {bullets:>7}  {created}"
            f"  {_notes(u)}\n".rstrip()
            + "\n"
        )
    return 0


def _notes(u: PromptUpdate) -> str:
    """What the gate, consolidation and reverts did to a version, in a few words."""
    st, notes = u.stats, []
    if st.rejection is not None:
        notes.append(f"refused ({st.rejection.kind}: {getattr(st.rejection, 'reason', '')})")
    if st.gate is not None:
        g = st.gate
        notes.append(f"{g.gate} gate n={g.n} {g.current:.2f}->{g.candidate:.2f}")
        if g.pruned:
            notes.append(g.left_out())
    if st.held_out:
        notes.append(f"{len(st.held_out)} held out")
    if st.deferred:
        notes.append(f"{st.deferred} operation(s) wait for the gate (too few held-out tasks)")
    if st.consolidated is not None:
        c = st.consolidated
        notes.append(
            f"consolidated {c.tokens_before}->{c.tokens_after} tokens "
            f"({len(c.merged)} merges, {len(c.dropped)} dropped)"
        )
    if st.reverted_to is not None:
        notes.append(f"started from v{st.reverted_to}")
    return "; ".join(notes)


def _by(args: argparse.Namespace) -> str:
    return args.by or os.environ.get("USER") or "unknown"


async def _move(args: argparse.Namespace, config: Config, label: str, version: int | None,
                *, rollback: bool = False, approval: bool | None = None) -> int:  # fmt: skip
    move = await move_label(
        config.kafka, args.key, label, version, by=_by(args), why=args.why, rollback=rollback,
        approval=approval,
    )  # fmt: skip
    where = "the newest version" if move.to_version is None else f"version {move.to_version}"
    print(f"{args.key}: {label} -> {where} (was {move.from_version}; move {move.seq})")
    return 0


async def _promote(args: argparse.Namespace, config: Config) -> int:
    return await _move(args, config, args.label, args.version)


async def _rollback(args: argparse.Namespace, config: Config) -> int:
    if args.version is not None:
        return await _move(args, config, PRODUCTION, args.version)
    return await _move(args, config, PRODUCTION, None, rollback=True)


async def _approval(args: argparse.Namespace, config: Config) -> int:
    return await _move(args, config, PRODUCTION, None, approval=args.state == "on")


async def _pin(args: argparse.Namespace, config: Config) -> int:
    return await _move(args, config, args.label, args.version)


async def _labels(args: argparse.Namespace, config: Config) -> int:
    history = await read_history(config.kafka, args.key)
    if history.newest is None:
        raise UserError(f"key {args.key!r} has no version on {config.kafka.history_topic}")
    out = sys.stdout
    labels = history.labels
    production = "latest" if labels.production is None else str(labels.production)
    out.write(f"# {args.key}: versions {min(history.versions)}..{history.newest} kept\n")
    out.write(f"latest      {history.newest}\n")
    mode = ", approval mode: only `prompts promote` moves it" if labels.approval else ""
    out.write(f"production  {history.resolve(PRODUCTION)}  (follows: {production}{mode})\n")
    for name, version in sorted(labels.labels.items()):
        out.write(f"{name:<11} {version}\n")
    if labels.canary and CANDIDATE in labels.labels:
        split = "keyed split" if labels.canary_key else "unkeyed split: any producer can pick arms"
        out.write(f"canary      {labels.canary:.0%} of sessions asking for production ({split})\n")
    out.write("\n## moves\n\n")
    for m in history.moves:
        at = m.at.isoformat(timespec="seconds") if m.at else "-"
        out.write(
            f"{m.seq:>4}  {at}  {m.label}: {m.from_version} -> "
            f"{'latest' if m.to_version is None else m.to_version}  by {m.by}"
            f"{'  why: ' + m.why if m.why else ''}\n"
        )
    return 0


def _why(key: str, bullet_id: str, versions: list[PromptUpdate]) -> int:
    """A bullet's provenance over the versions still on the topic."""
    carrying = [(u, b) for u in versions if (b := find_bullet(u.playbook, bullet_id)) is not None]
    if not carrying:
        raise UserError(f"no version of {key!r} on the topic carries bullet {bullet_id!r}")
    out = sys.stdout
    first, last = carrying[0], carrying[-1]
    out.write(f"# {key} {bullet_id}: {last[1].content}\n\n")
    out.write(
        f"in versions {first[0].version}..{last[0].version} of those on the topic; "
        f"helpful={last[1].helpful} harmful={last[1].harmful}\n"
    )
    out.write("added or last changed by traces: " + (", ".join(last[1].sources) or "-") + "\n")
    text = None
    for update, bullet in carrying:
        if bullet.content != text:
            change = "text" if text is not None else "first seen"
            out.write(f"  v{update.version}: {change}: {bullet.content}\n")
            text = bullet.content
    return 0


__all__ = ["read_versions", "register", "seed_prompt"]
