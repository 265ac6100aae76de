"""``combee-stream bench SUITE [--quick] [--json] [--out DIR] [--time-scale F]``.

Prints the suite's Markdown table (or, with ``--json``, one JSON object) on stdout; with
``--out DIR`` also writes ``DIR/SUITE.md``, ``DIR/SUITE.json`` and the suite's PNG plots.
Suites that need Kafka start the local broker of ``config.broker`` first (idempotent; it is
left running), so ``--broker-port`` etc. choose which one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from combee_stream.bench import latency, overhead, plots, saturation, scaling
from combee_stream.bench.report import describe_latency
from combee_stream.bench.vclock import VirtualClockLoop
from combee_stream.config import Config
from combee_stream.errors import UserError
from combee_stream.logs import configure_logging

SUITES = ("scaling", "saturation", "overhead", "latency")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks against the simulated LLM: scaling, saturation, overhead, latency",
        description=(
            "Run one benchmark suite against the project's SIMULATED LLM (never a real model). "
            "scaling: sequential vs naive vs combee over batch sizes; saturation: engine "
            "throughput vs the endpoint's bound C/(L*calls per trace); overhead: engine vs a "
            "bare Kafka consumer, and peak memory under a backlog; latency: trace-to-publish "
            "latency, pipelined vs synchronous windows."
        ),
    )
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="small sizes (< 2 min per suite)")
    parser.add_argument("--json", action="store_true", help="print one JSON object, not Markdown")
    parser.add_argument("--out", type=Path, default=None, help="write SUITE.md/.json and PNG plots")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        metavar="F",
        help=(
            "compress simulated time F-fold (real sleeps / F, reported times x F). scaling: "
            "default is a virtual clock (exact, no sleeping); Kafka suites: default "
            f"{saturation.DEFAULT_TIME_SCALE:g}, lowered per configuration so the real LLM call "
            "rate stays within what this machine's CPU sustains"
        ),
    )
    parser.add_argument("--seed", type=int, default=0)
    broker = parser.add_argument_group("local Kafka broker (saturation, overhead, latency)")
    broker.add_argument("--broker-port", type=int, default=None, help="default: broker.port")
    broker.add_argument("--broker-controller-port", type=int, default=None)
    broker.add_argument("--broker-state-dir", default=None, help="default: broker.state_dir")
    parser.set_defaults(handler=handle)


def _with_broker(args: argparse.Namespace, config: Config) -> Config:
    changes: dict[str, Any] = {}
    if args.broker_port is not None:
        changes["port"] = args.broker_port
    if args.broker_controller_port is not None:
        changes["controller_port"] = args.broker_controller_port
    if args.broker_state_dir is not None:
        changes["state_dir"] = args.broker_state_dir
    if not changes:
        return config
    return msgspec.structs.replace(config, broker=msgspec.structs.replace(config.broker, **changes))


class Outcome(msgspec.Struct):
    report: Any
    markdown: str
    subtitle: str
    plot: Callable[[Any, Path, str], list[Path]]


def run_suite(
    suite: str, config: Config, *, quick: bool, time_scale: float | None, seed: int
) -> Outcome:
    """Run one suite to completion (each suite owns its event loop)."""
    if time_scale is not None and time_scale <= 0:
        raise UserError(f"--time-scale must be > 0, got {time_scale:g}")
    if suite == "scaling":
        s = scaling.scaling_settings(quick=quick, time_scale=time_scale, seed=seed)
        options = {"loop_factory": VirtualClockLoop} if time_scale is None else {}
        sc = anyio.run(scaling.run_scaling, s, backend_options=options)
        subtitle = f"Latency: {describe_latency(sc.latency_model)}."
        return Outcome(sc, scaling.markdown(sc), subtitle, plots.scaling_plots)
    if suite == "saturation":
        ss = saturation.saturation_settings(quick=quick, time_scale=time_scale, seed=seed)
        sa = anyio.run(saturation.run_saturation, config, ss)
        subtitle = "Latency: constant L per call (no token terms, no jitter)."
        return Outcome(sa, saturation.markdown(sa), subtitle, plots.saturation_plots)
    if suite == "overhead":
        os_ = overhead.overhead_settings(quick=quick, seed=seed)
        ov = anyio.run(overhead.run_overhead, config, os_)
        subtitle = "Latency: zero (in-process simulator)."
        return Outcome(ov, overhead.markdown(ov), subtitle, plots.overhead_plots)
    if suite == "latency":
        ls = latency.latency_settings(quick=quick, time_scale=time_scale, seed=seed)
        la = anyio.run(latency.run_latency, config, ls)
        subtitle = f"Latency: {describe_latency(la.latency_model)}."
        return Outcome(la, latency.markdown(la), subtitle, plots.latency_plots)
    raise UserError(f"unknown suite {suite!r} (one of {', '.join(SUITES)})")


def handle(args: argparse.Namespace, config: Config) -> int:
    if args.log_level is None:  # engine and client info logs would drown the tables
        configure_logging("warning", config.log.format)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        plots.require_matplotlib()  # fail before a long run, not after it
    outcome = run_suite(
        args.suite,
        _with_broker(args, config),
        quick=args.quick,
        time_scale=args.time_scale,
        seed=args.seed,
    )
    as_json = msgspec.json.encode(outcome.report)
    if args.json:
        sys.stdout.write(as_json.decode() + "\n")
    else:
        sys.stdout.write(outcome.markdown)
    if args.out is not None:
        (args.out / f"{args.suite}.md").write_text(outcome.markdown)
        (args.out / f"{args.suite}.json").write_bytes(msgspec.json.format(as_json) + b"\n")
        for path in outcome.plot(outcome.report, args.out, outcome.subtitle):
            print(f"wrote {path}", file=sys.stderr)
    sys.stdout.flush()
    return 0


__all__ = ["SUITES", "Outcome", "handle", "register", "run_suite"]
