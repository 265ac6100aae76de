"""CLI: ``run`` (the streaming engine) and ``inspect`` (a key's versions on the prompts topic)."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Any

from combee_stream.config import Config
from combee_stream.errors import UserError
from combee_stream.kafka.reader import read_to_end
from combee_stream.schemas import DecodeError, PromptUpdate, decode, encode


def register(sub: Any) -> None:
    run = sub.add_parser("run", help="run the streaming engine (traces in, prompt versions out)")
    run.set_defaults(handler=_run)

    inspect = sub.add_parser("inspect", help="show a key's playbook, versions and a diff")
    inspect.add_argument("key")
    inspect.add_argument(
        "--diff", nargs=2, type=int, metavar=("OLD", "NEW"), help="diff two versions' prompts"
    )
    inspect.add_argument("--json", action="store_true", help="print the newest update as JSON")
    inspect.set_defaults(handler=_inspect)


async def _run(args: argparse.Namespace, config: Config) -> int:
    from combee_stream.engine.runner import Engine

    engine = Engine(config, handle_signals=True)
    await engine.run()
    return 0


async def read_versions(config: Config, key: str) -> list[PromptUpdate]:
    """Every version of ``key`` still on the prompts topic (compaction keeps the newest)."""
    versions: dict[int, PromptUpdate] = {}
    for record in await read_to_end(config.kafka, config.kafka.prompts_topic):
        if record.key != key.encode() or record.value is None:
            continue
        try:
            update = decode(record.value, PromptUpdate)
        except DecodeError:
            continue
        versions[update.version] = update
    return [versions[v] for v in sorted(versions)]


async def _inspect(args: argparse.Namespace, config: Config) -> int:
    versions = await read_versions(config, args.key)
    if not versions:
        raise UserError(f"no versions of key {args.key!r} on {config.kafka.prompts_topic}")
    by_version = {u.version: u for u in versions}
    newest = versions[-1]
    out = sys.stdout
    if args.json:
        out.write(json.dumps(json.loads(encode(newest)), indent=2) + "\n")
        return 0
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
    out.write(newest.prompt.rstrip() + "\n\n## versions on the topic\n\n")
    out.write("version  parent  traces  learned  window  bullets  created\n")
    for u in versions:
        bullets = sum(len(s.bullets) for s in u.playbook.sections)
        created = u.created_at.isoformat(timespec="seconds") if u.created_at else "-"
        out.write(
            f"{u.version:>7}  {u.parent_version:>6}  {u.stats.traces_learned:>6}  "
            f"{u.stats.window_traces:>7}  {u.stats.batch_size:>6}  {bullets:>7}  {created}\n"
        )
    return 0
