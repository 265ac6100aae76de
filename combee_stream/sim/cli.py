"""``combee-stream sim ...``: serve the simulated LLM, make synthetic traces, score a playbook."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from combee_stream.errors import UserError
from combee_stream.schemas import encode
from combee_stream.sim.score import load_playbooks, load_traces, score
from combee_stream.sim.server import sim_server
from combee_stream.sim.settings import FaultModel, LatencyModel, SimSettings
from combee_stream.sim.traces import generate_traces


def register(subparsers: Any) -> None:
    sim = subparsers.add_parser("sim", help="simulated LLM server and synthetic traces")
    sub = sim.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)

    server = sub.add_parser(
        "llm-server", help="serve a deterministic SIMULATED OpenAI-compatible LLM until Ctrl-C"
    )
    server.add_argument("--port", type=int, required=True, help="0 = any free port")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--seed", type=int, default=0)
    server.add_argument("--overload", type=int, default=None, metavar="C", help="curator capacity")
    latency = server.add_argument_group("latency (simulated seconds)")
    latency.add_argument("--latency-base", type=float, default=0.0, metavar="S")
    latency.add_argument("--latency-per-in-token", type=float, default=0.0, metavar="S")
    latency.add_argument("--latency-per-out-token", type=float, default=0.0, metavar="S")
    latency.add_argument("--jitter", type=float, default=0.0, metavar="F", help="relative, ±F")
    latency.add_argument(
        "--time-scale", type=float, default=1.0, metavar="F", help="simulated s per real s"
    )
    faults = server.add_argument_group("faults (rate per attempt, 0..1)")
    for flag in ("429", "500", "timeout", "malformed", "schema"):
        faults.add_argument(f"--fault-{flag}", type=float, default=0.0, metavar="R")
    faults.add_argument("--retry-after", type=float, default=1.0, metavar="S", help="for 429s")
    faults.add_argument(
        "--timeout-s", type=float, default=120.0, metavar="S", help="real seconds a timeout holds"
    )
    server.set_defaults(handler=_llm_server)

    traces = sub.add_parser("traces", help="write synthetic Trace JSONL with lesson markers")
    traces.add_argument("--n", type=int, required=True, help="number of traces")
    traces.add_argument("--keys", type=int, required=True)
    traces.add_argument("--lessons", type=int, required=True, help="lessons per key")
    traces.add_argument("--seed", type=int, default=0)
    traces.add_argument("--out", type=Path, default=None, help="default: stdout")
    traces.set_defaults(handler=_traces)

    scorer = sub.add_parser("score", help="count the traces' lessons a learned playbook retained")
    scorer.add_argument("--traces", type=Path, required=True, help="Trace JSONL file")
    scorer.add_argument("--playbook", type=Path, required=True, help="learn output DIR")
    scorer.add_argument("--key", default=None, help="only this key")
    scorer.set_defaults(handler=_score)


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    try:
        return SimSettings(
            seed=args.seed,
            overload=args.overload,
            time_scale=args.time_scale,
            latency=LatencyModel(
                base_s=args.latency_base,
                per_input_token_s=args.latency_per_in_token,
                per_output_token_s=args.latency_per_out_token,
                jitter=args.jitter,
            ),
            faults=FaultModel(
                rate_429=args.fault_429,
                retry_after_s=args.retry_after,
                rate_500=args.fault_500,
                rate_timeout=args.fault_timeout,
                timeout_s=args.timeout_s,
                rate_malformed=args.fault_malformed,
                rate_schema_violation=args.fault_schema,
            ),
        )
    except ValueError as exc:
        raise UserError(f"bad simulator settings: {exc}") from exc


def describe(settings: SimSettings) -> str:
    """One line naming the latency, fault and overload models."""
    lat = settings.latency
    rates = ", ".join(f"{k} {v:g}" for k, v in settings.faults.rates().items() if v) or "none"
    overload = "off" if settings.overload is None else f"C={settings.overload}"
    return (
        f"latency {lat.base_s:g}s + {lat.per_input_token_s:g}s/in-token + "
        f"{lat.per_output_token_s:g}s/out-token ±{lat.jitter:.0%}, "
        f"time scale {settings.time_scale:g}x; faults: {rates}; overload {overload}; "
        f"seed {settings.seed}"
    )


async def _llm_server(args: argparse.Namespace, config: object) -> int:
    settings = settings_from_args(args)
    try:
        async with sim_server(
            settings, host=args.host, port=args.port, capture_signals=True
        ) as server:
            print(
                f"SIMULATED LLM (combee-stream simulator, not a real model) at {server.base_url}"
                f" | {describe(settings)} | Ctrl-C to stop",
                flush=True,
            )
            await server.wait_stopped()
    except OSError as exc:
        raise UserError(f"cannot serve on {args.host}:{args.port}: {exc}") from exc
    return 0


def _traces(args: argparse.Namespace, config: object) -> int:
    try:
        traces = generate_traces(args.n, args.keys, args.lessons, args.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    data = b"".join(encode(trace) + b"\n" for trace in traces)
    if args.out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        args.out.write_bytes(data)
    return 0


def _score(args: argparse.Namespace, config: object) -> int:
    try:
        result = score(load_traces(args.traces), load_playbooks(args.playbook), args.key)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    print(json.dumps(msgspec.to_builtins(result)))
    return 0


__all__ = ["describe", "register", "settings_from_args"]
