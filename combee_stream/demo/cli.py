"""CLI: ``demo`` (the real-model loop, :mod:`~combee_stream.demo.live`) and ``demo --sim``
(:mod:`~combee_stream.demo.sim`)."""

from __future__ import annotations

import argparse
from typing import Any

from combee_stream.config import Config
from combee_stream.demo.common import engine_logs
from combee_stream.demo.live import DEMO_FAMILIES, run_live_demo
from combee_stream.demo.sim import run_sim_demo
from combee_stream.tasks.generated import FAMILIES


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "demo",
        help="the whole loop locally: broker, a real local model (or --sim), engine, an agent",
    )
    parser.add_argument("--sim", action="store_true", help="the quick simulated-LLM demo")
    # 16: two windows (10 and 6), the second learned under the first's version. With 24 (until
    # 2026-12-06) the two runs with worked examples took 17 and 19 minutes, over the 15 the demo
    # should fit, and every bullet their later windows added came from failures the first
    # window's version already answered right (the lesson check's parent_right). Seed 959608
    # with 16: 11.5 minutes from the engine's start, base 0 and v2 19 of 20.
    parser.add_argument("--tasks", type=int, default=16, help="tasks the agent works on")
    # 20 (10 a family), to fit the demo's time; the paired interval it prints says what that
    # size can show (0 of 20 before, 5 of 20 after: +4 to +47 points; 0 and 0: -16 to +16).
    parser.add_argument("--held-out", type=int, default=20, help="tasks of the before/after")
    parser.add_argument("--model", default=None, help="local model (default: local_llm.model)")
    parser.add_argument("--seed", type=int, default=None, help="task seed (default: random)")
    parser.add_argument(
        "--families",
        default=",".join(DEMO_FAMILIES),
        help=f"task families, comma-separated (default: {','.join(DEMO_FAMILIES)}; all: "
        f"{','.join(FAMILIES)})",
    )
    # the simulated demo
    parser.add_argument("--traces", type=int, default=120, help="--sim: synthetic traces to send")
    parser.add_argument("--keys", type=int, default=2, help="--sim: keys")
    # Six lessons a key: the gate's held-out tasks (about 18 a key) then cover every lesson, so
    # a wrong rule for any case meets a task it breaks. With 12, one case in five had no
    # held-out task and its poison passed the gate (what a replay gate can and cannot see).
    parser.add_argument("--lessons", type=int, default=6, help="--sim: distinct lessons per key")
    parser.set_defaults(handler=_demo)


async def _demo(args: argparse.Namespace, config: Config) -> int:
    with engine_logs(config):
        if args.sim:
            return await run_sim_demo(args, config)
        return await run_live_demo(args, config)


__all__ = ["register"]
