"""CLI: ``learn``, offline learning over a JSONL file of traces (no broker)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from combee_stream.config import Config
from combee_stream.core.scan import STRATEGIES
from combee_stream.wiring import run_learn


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "learn",
        help="learn playbooks offline from a JSONL file of traces",
        description=(
            "Learn one playbook per key from a JSONL file of traces (no broker). Writes "
            "DIR/playbook.md, DIR/playbook.json and DIR/history.jsonl after every window and "
            "DIR/report.json at the end. The LLM endpoint comes from the config "
            "(llm.<role>.base_url) or OPENAI_BASE_URL / OPENAI_API_KEY."
        ),
    )
    parser.add_argument("--traces", type=Path, required=True, help="Trace JSONL file")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--strategy",
        choices=sorted(STRATEGIES),
        default=None,
        help="default: learning.strategy (combee)",
    )
    parser.add_argument(
        "--batch-size",
        default=None,
        metavar="N|auto",
        help="traces per window, or auto (the controller); default: learning.batch_size",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --out (skip learned traces)"
    )
    parser.add_argument("--seed", type=int, default=None, help="shuffle seed (learning.seed)")
    parser.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    report = await run_learn(
        config,
        args.traces,
        args.out,
        strategy=args.strategy,
        batch_size=args.batch_size,
        resume=args.resume,
        seed=args.seed,
    )
    summary = {
        "out": str(args.out),
        "strategy": report.strategy,
        "traces": report.traces,
        "learned": report.learned,
        "already_learned": report.already_learned,
        "windows": report.windows,
        "llm_calls": report.llm_calls,
        "failed_traces": report.failed_traces,
        "bad_lines": report.bad_lines,
        "duplicate_traces": report.duplicate_traces,
        "versions": report.versions,
        # Per role: replies cut at max_tokens or refused by the schema, and the prompt tokens
        # the server served from its cache (report.json has every counter).
        "per_role": {
            role: {
                "calls": u.calls,
                "tokens_in": u.tokens_in,
                "tokens_cached": u.tokens_cached,
                "truncated_replies": u.truncated_replies,
                "invalid_replies": u.invalid_replies,
            }
            for role, u in sorted(report.per_role.items())
        },
    }
    print(json.dumps(summary))
    if report.failed:
        print(
            f"combee-stream learn: {report.failed_traces} trace(s) could not be learned; "
            f"see {args.out / 'report.json'} (failed); --resume tries them again",
            file=sys.stderr,
        )
        return 1
    return 0


__all__ = ["handle", "register"]
