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

from combee_stream.bench import (
    gate,
    ingest,
    keys,
    latency,
    overhead,
    plots,
    quality,
    saturation,
    scaling,
)
from combee_stream.bench.report import describe_latency
from combee_stream.bench.vclock import VirtualClockLoop
from combee_stream.config import Config, LLMConfig
from combee_stream.errors import UserError
from combee_stream.http import free_port
from combee_stream.logs import configure_logging

SUITES = ("scaling", "saturation", "overhead", "latency", "ingest", "gate", "keys", "quality")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: scaling, saturation, overhead, latency, gate (simulated LLM); ingest "
        "(no LLM); quality (a real model)",
        description=(
            "scaling, saturation, overhead and latency run against the project's SIMULATED LLM "
            "(never a real model): sequential vs naive vs combee over batch sizes; engine "
            "throughput vs the endpoint's bound C/(L*calls per trace); engine vs a bare Kafka "
            "consumer, and peak memory under a backlog; trace-to-publish latency, pipelined vs "
            "synchronous windows; gate: the replay gate over a stream with poisoned traces "
            "(time served worse than the best earlier version, its cost in calls and latency); "
            "keys: memory and /metrics series against distinct keys seen (idle keys evicted). "
            "ingest (no LLM): the OpenTelemetry ingest stage vs a bare "
            "consumer of the spans topic, and its memory with many traces open. quality runs a "
            "REAL model (--local MODEL starts one here, or the config's LLM roles): held-out "
            "accuracy of the agent with the base prompt and "
            "with each strategy's learned playbook."
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
    q = parser.add_argument_group("quality (a real model)")
    q.add_argument(
        "--local", default=None, metavar="MODEL", help="start this local model (llm serve) first"
    )
    q.add_argument("--train", default="generated:1", help="training task source")
    q.add_argument("--train-n", type=int, default=80)
    q.add_argument("--held-out", default="generated:2", help="held-out task source")
    q.add_argument("--held-out-n", type=int, default=100)
    q.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="for naive and combee; default: a quarter of the training stream (4 windows)",
    )
    q.add_argument("--strategies", default=",".join(quality.DEFAULT_STRATEGIES))
    q.add_argument(
        "--sequential-n",
        type=int,
        default=0,
        metavar="N",
        help="sequential (one LLM round per trace) learns from the first N traces only",
    )
    q.add_argument(
        "--no-gate", action="store_true", help="learn without the replay gate (default: on)"
    )
    q.add_argument(
        "--check-lessons",
        action="store_true",
        help="gate.check_lessons: each new bullet is retried on the failed training tasks it "
        "was learned from, and left out when it fixes none (default: off)",
    )
    q.add_argument(
        "--worked-examples",
        action="store_true",
        help="learning.worked_examples: each new bullet learned from a failed training trace "
        "ends with that trace's worked example (default: off)",
    )
    q.add_argument(
        "--reflect-successes",
        choices=("all", "cited", "none"),
        default="cited",
        help="learning.reflect_successes of the learners (default: cited, for a small reflector)",
    )
    q.add_argument(
        "--merge-similar",
        type=float,
        default=0.8,
        metavar="COSINE",
        help="learning.merge_similar of the learners (default 0.8: MiniLM cosine between two "
        "bullets' advice; 0 = off)",
    )
    q.add_argument(
        "--combine",
        choices=("union", "llm"),
        default="union",
        help="learning.combine of combee: the union of the groups' operations (default) or "
        "one combiner call that merges them",
    )
    q.add_argument("--work", type=Path, default=None, help="traces and playbooks (resumable)")
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
    suite: str,
    config: Config,
    *,
    quick: bool,
    time_scale: float | None,
    seed: int,
    args: argparse.Namespace | None = None,
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
    if suite == "ingest":
        ing = anyio.run(ingest.run_ingest, config, ingest.ingest_settings(quick=quick, seed=seed))
        return Outcome(ing, ingest.markdown(ing), "", lambda *_: [])
    if suite == "gate":
        gr = anyio.run(gate.run_gate, config, gate.gate_settings(quick=quick, seed=seed))
        return Outcome(gr, gate.markdown(gr), "", lambda *_: [])
    if suite == "keys":
        kr = anyio.run(keys.run_keys, config, keys.keys_settings(quick=quick, seed=seed))
        return Outcome(kr, keys.markdown(kr), "", lambda *_: [])
    if suite == "quality":
        assert args is not None
        qr = anyio.run(_quality, config, args, quick)
        subtitle = f"Model: {qr.settings.model}; held-out n = {qr.settings.held_out_n}."
        return Outcome(qr, quality.markdown(qr), subtitle, plots.quality_plots)
    raise UserError(f"unknown suite {suite!r} (one of {', '.join(SUITES)})")


async def _quality(config: Config, args: argparse.Namespace, quick: bool) -> quality.QualityReport:
    from combee_stream.localllm import local_model
    from combee_stream.localllm.server import local_llm_config

    strategies = [x for x in args.strategies.split(",") if x]
    unknown = set(strategies) - set(quality.STRATEGIES)
    if unknown:
        raise UserError(f"--strategies: unknown {sorted(unknown)}")
    train_n = 8 if quick else args.train_n
    batch = 2 if quick else args.batch_size or max(1, train_n // 4)
    settings = quality.QualitySettings(
        model=args.local or config.llm.agent.model,
        train=args.train,
        train_n=train_n,
        held_out=args.held_out,
        held_out_n=6 if quick else args.held_out_n,
        strategies=strategies,
        batch_size=batch,
        concurrency=config.llm.concurrency,
        sequential_n=args.sequential_n,
        gate=not args.no_gate,
        check_lessons=args.check_lessons,
        worked_examples=args.worked_examples,
        reflect_successes=args.reflect_successes,
        merge_similar=args.merge_similar,
        combine=args.combine,
        seed=args.seed,
    )
    # A 1.5B reflector asked about a success that cited nothing writes noise ("the formula
    # should be A, not A"): by default the suite's learners read only failures and successes
    # that cited bullets (learning.reflect_successes = "cited"; --reflect-successes all is
    # ACE), and a rule its curator states once per formula is merged into one
    # (learning.merge_similar, by the embedding model served beside the local model).
    config = msgspec.structs.replace(
        config,
        learning=msgspec.structs.replace(
            config.learning,
            reflect_successes=args.reflect_successes,
            merge_similar=args.merge_similar,
            combine=args.combine,
            seed=args.seed,
            worked_examples=args.worked_examples,
        ),
    )
    if settings.gate:
        # The replay gate as the engine runs it, its held-out tasks drawn from the training
        # stream. A quarter of 60 traces is about 15 tasks; min_samples is lowered to what a
        # one-hour run can hold out. The default margin 0.1 refused every candidate of a real
        # run, one that went from 8 to 10 of 12 included; 0.15 (z / (n + 2) = 0.137 for 10: a
        # candidate that changes nothing passes) still refuses one that swaps a single task for
        # another on 12 (bound -0.20), or gains two and loses one (-0.16): a real run of
        # 2026-12-04 lost three windows' lessons to a 6-of-12 against 6-of-12 refusal. At 0.25,
        # on 12 tasks, one that swaps a task for another passes (-0.20), as does one that gains
        # more than it loses (three for two: -0.22); two for two is still refused (-0.26), and
        # gate.no_worse refuses any candidate that answers fewer of them.
        gated = msgspec.structs.replace(
            config.gate, replay=True, holdout_fraction=0.25, min_samples=10, margin=0.25
        )
        config = msgspec.structs.replace(config, gate=gated)
    if settings.check_lessons:
        checked = msgspec.structs.replace(config.gate, check_lessons=True)
        config = msgspec.structs.replace(config, gate=checked)
    work = args.work or (args.out / "quality-work" if args.out else Path(".state/bench-quality"))
    if args.local is None:
        return await quality.run_quality(config, _named(settings, config.llm), work)
    cfg = msgspec.structs.replace(config.local_llm, model=args.local, port=free_port())
    async with local_model(cfg) as server:
        local = local_llm_config(server, config.llm)
        # A role the config points at an endpoint of its own keeps it (a stronger reflector
        # and curator for a small agent, as teams run it); the others use the local model.
        kept = {
            role: getattr(config.llm, role)
            for role in quality.ROLES
            if getattr(config.llm, role).base_url
        }
        llm = msgspec.structs.replace(local, **kept)
        settings = msgspec.structs.replace(settings, concurrency=server.parallel)
        config = msgspec.structs.replace(config, llm=llm)
        return await quality.run_quality(config, _named(settings, llm), work)


def _named(settings: quality.QualitySettings, llm: LLMConfig) -> quality.QualitySettings:
    endpoints = {
        role: f"{getattr(llm, role).model} at {getattr(llm, role).base_url}"
        for role in quality.ROLES
    }
    e = llm.embeddings
    endpoints["embeddings"] = (
        f"{e.model} at {e.base_url or 'OPENAI_BASE_URL'}, dedup at cosine {e.threshold:g}"
        if e.enabled
        else "off (no semantic dedup)"
    )
    return msgspec.structs.replace(settings, endpoints=endpoints)


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
        args=args,
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
