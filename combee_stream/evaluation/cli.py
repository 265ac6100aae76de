"""CLI: ``eval``, the example agent over a task set with one prompt (or two, paired)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from combee_stream.config import Config
from combee_stream.core.playbook import render
from combee_stream.errors import DecodeError, UserError
from combee_stream.evaluation.answerer import Answerer
from combee_stream.evaluation.run import EvalResult, compare, evaluate
from combee_stream.kafka.reader import read_updates
from combee_stream.llm import LLMClient
from combee_stream.schemas import Playbook, decode
from combee_stream.tasks import load_tasks


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "eval",
        help="run the example agent on a task set and report accuracy with a 95%% interval",
        description=(
            "The prompt is the base prompt (none) unless --playbook PATH or --key K --version V "
            "is given; --compare-to base|vN|PATH adds a paired comparison on the same tasks. "
            "The agent's endpoint is the config's llm.agent role (or OPENAI_BASE_URL)."
        ),
    )
    parser.add_argument(
        "--tasks",
        required=True,
        help="generated[:SEED], formula:PATH, ... (PATH@N skips its first N rows)",
    )
    parser.add_argument("--limit", type=int, default=None, help="the first N tasks")
    parser.add_argument("--key", default=None, help="the prompt key (with --version)")
    parser.add_argument("--version", type=int, default=None, help="a version on the topic")
    parser.add_argument("--playbook", type=Path, default=None, help="playbook.json or a text file")
    parser.add_argument("--compare-to", default=None, metavar="base|vN|PATH")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_eval)


async def prompt_from(spec: str, config: Config, key: str | None) -> tuple[str, str]:
    """(label, system prompt) of ``base``, ``vN`` (a version of --key on the topic) or a
    file (a playbook.json of ``learn``, or plain text)."""
    if spec == "base":
        return "base", ""
    if spec.startswith("v") and spec[1:].isdigit():
        if key is None:
            raise UserError("a version needs --key")
        version = int(spec[1:])
        found = [u for u in await read_updates(config.kafka, keys={key}) if u.version == version]
        if not found:
            raise UserError(f"version {version} of {key!r} is not on {config.kafka.prompts_topic}")
        return f"{key} v{version}", found[-1].prompt
    path = Path(spec)
    try:
        data = await anyio.Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    if path.suffix == ".json":
        try:
            books = decode(data, dict[str, Playbook])
        except DecodeError as exc:
            raise UserError(
                f"{path}: not a playbook.json of `combee-stream learn`: {exc}"
            ) from None
        if key is None and len(books) != 1:
            raise UserError(f"{path} holds keys {sorted(books)}: choose one with --key")
        book = books[key] if key is not None else next(iter(books.values()))
        return f"{path} ({book.key} v{book.version})", render(book)
    return str(path), data.decode()


def _summary(result: EvalResult) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(result)
    out.pop("outcomes")
    out["failures"] = [{"task": o.task_id, "error": o.error} for o in result.outcomes if o.error]
    return out


async def _eval(args: argparse.Namespace, config: Config) -> int:
    tasks = load_tasks(args.tasks, limit=args.limit)
    if not tasks:
        raise UserError(f"--tasks {args.tasks}: no tasks")
    if args.playbook is not None and args.version is not None:
        raise UserError("give --playbook or --key/--version, not both")
    spec = (
        str(args.playbook)
        if args.playbook
        else f"v{args.version}"
        if args.version is not None
        else "base"
    )
    label, prompt = await prompt_from(spec, config, args.key)
    async with LLMClient(config.llm) as llm:
        llm.require("agent")
        answerer = Answerer(llm)
        result = await evaluate(answerer, prompt, tasks, label=label, concurrency=args.concurrency)
        other = None
        if args.compare_to:
            other_label, other_prompt = await prompt_from(args.compare_to, config, args.key)
            other = await evaluate(
                answerer, other_prompt, tasks, label=other_label, concurrency=args.concurrency
            )
    report: dict[str, Any] = {"tasks": args.tasks, **_summary(result)}
    if other is not None:
        report["compared_to"] = _summary(other)
        report["paired"] = msgspec.to_builtins(compare(other, result))
    if args.json:
        print(json.dumps(report))
        return 0
    lo, hi = result.ci95
    print(
        f"{label}: {result.correct}/{result.n} correct, accuracy {result.accuracy:.1%} "
        f"(95% CI {lo:.1%}-{hi:.1%})"
    )
    for family, (right, n) in result.by_family.items():
        print(f"  {family}: {right}/{n}")
    if other is not None:
        p = compare(other, result)
        print(
            f"against {other.label}: {other.accuracy:.1%}; difference {p.difference:+.1%} "
            f"(paired 95% CI {p.ci95[0]:+.1%} to {p.ci95[1]:+.1%}), gained {p.only_b}, "
            f"lost {p.only_a}, exact McNemar p = {p.mcnemar_p:.3g}"
        )
    if result.errors:
        print(f"{result.errors} task(s) failed to get an answer (counted wrong)", file=sys.stderr)
    return 0


__all__ = ["prompt_from", "register"]
