"""Offline learning: the key pipelines of the engine, fed from a file instead of a topic.

Reads and validates every line (a bad line is reported with its number, skipped and counted; a
repeated trace id is skipped as a duplicate), groups traces by key and runs one
:class:`~combee_stream.core.pipeline.KeyPipeline` per key (keys concurrently), in the paper's
synchronous mode: a window closes at the batch size (or at the end of the file), is reflected on
the newest version, reduced, committed through the gate, and only then does the next one start.
After EVERY window ``DIR/history.jsonl`` gets the version (the same ``PromptUpdate`` the engine
would publish, from :mod:`combee_stream.core.versions`) and ``DIR/playbook.json`` /
``DIR/playbook.md`` are replaced; ``DIR/report.json`` is written at the end (also when the run
stops early, with ``"complete": false``).

- ``--batch-size auto``: the online controller explores its candidate sizes on real windows,
  then settles on the fitted size; the report lists every size it chose. ``sequential`` always
  uses windows of one trace.
- A trace whose reflection fails ``learning.max_attempts`` times, or whose window's curation
  does, is reported in ``report.json`` (``failed``) and the exit code is 1; a later ``--resume``
  tries it again. Finished calls replay from the completion memo.
- ``--resume`` continues from ``DIR/history.jsonl``: each key restarts from its newest version
  and traces already learned are skipped. The completion memo is persisted in ``DIR/memo.jsonl``
  (unless ``llm.memo_path`` is set), so calls finished before an interruption are not paid twice.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final, TextIO

import anyio
import msgspec
from msgspec import Struct

from combee_stream.config import Config
from combee_stream.core.controller import batch_policy
from combee_stream.core.learner import LearnerFactory, required_roles
from combee_stream.core.pipeline import KeyPipeline, PipelineSettings, Window, closed_inbox
from combee_stream.core.prompts import PROMPTS_VERSION
from combee_stream.core.results import FailedTrace
from combee_stream.core.scan import STRATEGIES
from combee_stream.core.versions import KeyChain
from combee_stream.errors import UserError
from combee_stream.formats import trace_format
from combee_stream.llm import LLMClient, RoleUsage
from combee_stream.offline.source import BadLine, read_traces
from combee_stream.offline.store import History, OutputDir
from combee_stream.progress import PhaseProgress
from combee_stream.schemas import AddOp, Playbook, PromptUpdate, Source, Trace, UpdateOp

_SHOWN_BAD_LINES: Final = 20


class FailedTraceReport(Struct, frozen=True):
    key: str
    trace_id: str
    attempts: int
    reason: str
    stage: str = "reflect"  # reflect | curate


class LeftOutReport(Struct, frozen=True):
    """A proposal the learner did not serve, with its text (which is in no version)."""

    key: str
    version: int  # the version of the window that proposed it
    # Why: the gate whose blame left a new bullet out ("lessons", "replay", "<gate> (split)"),
    # or the review's reason for refusing an ADD or an UPDATE (restates_task, near_duplicate...).
    by: str
    content: str


class LearnReport(Struct, kw_only=True):
    """``DIR/report.json``."""

    strategy: str
    batch_size: int | list[int]  # the fixed size, or every size the controller chose
    traces: int  # valid, distinct traces in the file
    windows: int  # versions written by this run
    llm_calls: int  # calls sent to an endpoint (memo hits excluded, see cached_calls)
    tokens_in: int
    tokens_out: int
    max_curator_items: int
    wall_s: float
    failed_traces: int
    per_role: dict[str, RoleUsage]
    complete: bool = False
    learned: int = 0  # traces learned by this run
    already_learned: int = 0  # skipped on --resume
    cached_calls: int = 0
    rounds: int = 0  # sequential LLM rounds, summed over windows
    rejected_windows: int = 0  # deltas refused by the token budget or the gate
    bad_lines: int = 0
    duplicate_traces: int = 0
    keys: int = 0
    versions: dict[str, int] = {}
    failed: list[FailedTraceReport] = []
    bad: list[BadLine] = []
    combine: str = ""
    duplication: int = 0
    fan_in: int = 0
    seed: int = 0
    prompts_version: str = PROMPTS_VERSION
    # What the learner did not serve, with its text, window by window (kept across --resume).
    # The counts are in each version's stats; only here is the text, since no version holds it:
    # which filter dropped a lesson was the question a real run's report could not answer
    # (the twenty-second bench quality run, docs/benchmarks/quality-runs.md).
    left_out: list[LeftOutReport] = []


class FileSink:
    """The pipelines' sink offline: every version to ``history.jsonl``, failures to the report."""

    def __init__(
        self,
        out: OutputDir,
        report: LearnReport,
        progress: PhaseProgress,
        playbooks: dict[str, Playbook],
        attempts: int,
    ) -> None:
        self._out = out
        self._report = report
        self._progress = progress
        self.playbooks = playbooks
        self._attempts = attempts
        self.chosen_sizes: list[int] = []

    async def publish(self, chain: KeyChain, update: PromptUpdate, window: Window) -> bool:
        self._out.append_history(update)
        self.playbooks[update.key] = update.playbook
        self._out.write_playbooks(self.playbooks)
        report = self._report
        report.windows += 1
        report.learned += update.stats.window_traces
        report.rejected_windows += int(update.stats.rejection is not None)
        if window.result is not None:
            result = window.result
            stats = result.stats
            report.max_curator_items = max(report.max_curator_items, stats.max_curator_items)
            report.rounds += stats.rounds
            report.left_out.extend(
                LeftOutReport(update.key, update.version, skip.reason, skip.op.content)
                for skip in result.applied.skipped
                if isinstance(skip.op, AddOp | UpdateOp)
            )
            report.left_out.extend(
                LeftOutReport(update.key, update.version, out.by, out.content)
                for out in result.left_out
            )
        # Written every window, so an interrupted run's left-outs survive to its --resume.
        self._out.write_report(report)
        self.chosen_sizes.append(update.stats.batch_size)
        self._progress.advance(update.stats.window_traces)
        return True

    async def park(
        self, chain: KeyChain, failed: Sequence[tuple[FailedTrace, Trace]], stage: str
    ) -> None:
        for failure, trace in failed:
            self._report.failed.append(
                FailedTraceReport(
                    key=chain.key,
                    trace_id=trace.trace_id,
                    attempts=self._attempts,
                    reason=failure.reason,
                    stage=stage,
                )
            )


def _parse_batch_size(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        size = int(value)
    except ValueError:
        raise UserError(
            f"--batch-size must be a positive integer or 'auto', got {value!r}"
        ) from None
    if size < 1:
        raise UserError(f"--batch-size must be >= 1, got {size}")
    return size


def offline_settings(config: Config) -> PipelineSettings:
    """The paper's synchronous loop: one window at a time, each reflected at its close on the
    newest version; windows close at their size or at the end of the file, never by time."""
    return PipelineSettings(
        pipelined=False,
        max_windows_in_flight=1,
        max_wait_s=math.inf,
        attempts=config.learning.max_attempts,
        grow_with_backlog=False,
    )


def _calls_sent(usage: Iterable[RoleUsage]) -> int:
    """The model calls that reached an endpoint (a memo hit asked nothing): the report's
    ``llm_calls`` and the progress line's count."""
    return sum(u.calls - u.cached_calls for u in usage)


async def _show_activity(progress: PhaseProgress, client: LLMClient, done: anyio.Event) -> None:
    """The calls and tokens of the windows under way on the progress line, until ``done``."""
    while True:
        with anyio.move_on_after(progress.refresh_s):
            await done.wait()
        usage = client.usage().values()
        progress.activity(calls=_calls_sent(usage), tokens_out=sum(u.tokens_out for u in usage))
        if done.is_set():
            return


async def run_learn(
    config: Config,
    traces_path: Path,
    out_dir: Path,
    make_learner: LearnerFactory,
    *,
    strategy: str | None = None,
    batch_size: str | None = None,
    resume: bool = False,
    seed: int | None = None,
    env: Mapping[str, str] | None = None,
    stderr: TextIO | None = None,
) -> LearnReport:
    """The whole ``learn`` command, callable from code (benchmarks, tests), with the learner
    ``make_learner`` makes of the run's config and LLM client (:func:`combee_stream.run_learn`:
    the configured one)."""
    stderr = stderr or sys.stderr
    started = anyio.current_time()
    learning = config.learning
    name = strategy or learning.strategy
    if name not in STRATEGIES:
        raise UserError(f"unknown strategy {name!r} (one of {', '.join(STRATEGIES)})")
    spec = STRATEGIES[name]
    size = _parse_batch_size(batch_size or str(learning.batch_size))
    if spec.window_size is not None:
        size = spec.window_size
    learning = msgspec.structs.replace(
        learning,
        strategy=spec.name,
        batch_size=size if size is not None else "auto",
        seed=learning.seed if seed is None else seed,
    )
    config = msgspec.structs.replace(config, learning=learning)
    llm_config = config.llm
    # Fail fast (MissingEndpointError says exactly what to set) before touching --out.
    probe = LLMClient(msgspec.structs.replace(llm_config, memo_path=""), env=env)
    try:
        probe.require(*required_roles(config))  # type: ignore[arg-type]
    finally:
        await probe.aclose()
    out = OutputDir(out_dir)
    out.prepare(resume)
    if not llm_config.memo_path:
        llm_config = msgspec.structs.replace(llm_config, memo_path=str(out.memo))
        config = msgspec.structs.replace(config, llm=llm_config)

    source = read_traces(traces_path, trace_format(config))
    for bad in source.bad[:_SHOWN_BAD_LINES]:
        print(f"combee-stream learn: {traces_path}:{bad.line}: {bad.reason}", file=stderr)
    if len(source.bad) > _SHOWN_BAD_LINES:
        more = len(source.bad) - _SHOWN_BAD_LINES
        print(f"combee-stream learn: ... and {more} more bad line(s)", file=stderr)
    history = out.load_history() if resume else History(newest={}, learned={})
    by_key: dict[str, list[tuple[Trace, Source]]] = {}
    already = 0
    for trace, src in source.traces:
        if trace.trace_id in history.learned.get(trace.key, set()):
            already += 1
            continue
        by_key.setdefault(trace.key, []).append((trace, src))

    report = LearnReport(
        strategy=spec.name,
        batch_size=size if size is not None else [],
        traces=len(source.traces),
        windows=0,
        llm_calls=0,
        tokens_in=0,
        tokens_out=0,
        max_curator_items=0,
        wall_s=0.0,
        failed_traces=0,
        per_role={},
        already_learned=already,
        bad_lines=len(source.bad) - source.duplicates,
        duplicate_traces=source.duplicates,
        bad=source.bad[:100],
        combine=learning.combine,
        duplication=learning.duplication,
        fan_in=learning.fan_in,
        seed=learning.seed,
    )
    if resume and out.report.is_file():
        with contextlib.suppress(msgspec.DecodeError):
            earlier = msgspec.json.decode(out.report.read_bytes(), type=LearnReport)
            report.left_out = [
                r for r in earlier.left_out
                if (newest := history.newest.get(r.key)) and r.version <= newest.version
            ]  # fmt: skip
    client = LLMClient(llm_config, env=env)
    total = sum(len(v) for v in by_key.values())
    progress = PhaseProgress(f"learn ({spec.name})", total, stream=stderr)
    sink = FileSink(out, report, progress, history.playbooks, learning.max_attempts)
    try:
        with progress:
            learner = make_learner(config, client)
            settings = offline_settings(config)
            finished = anyio.Event()
            running = len(by_key)

            async def learn_key(pipeline: KeyPipeline) -> None:
                nonlocal running
                await pipeline.run()
                running -= 1
                if running == 0:
                    finished.set()

            async with anyio.create_task_group() as tg:
                if by_key:
                    tg.start_soon(_show_activity, progress, client, finished)
                for key, items in by_key.items():
                    chain = KeyChain(key, newest=history.newest.get(key))
                    policy = batch_policy(learning, key=key)
                    pipeline = KeyPipeline(
                        chain,
                        learner,
                        policy,
                        sink,
                        closed_inbox(items),
                        settings,
                    )
                    tg.start_soon(learn_key, pipeline)
            report.complete = True
    finally:
        usage = client.usage()
        await client.aclose()
        playbooks = sink.playbooks
        report.keys = len({t.key for t, _ in source.traces} | set(playbooks))
        report.versions = {k: playbooks[k].version for k in sorted(playbooks)}
        report.per_role = usage
        report.llm_calls = _calls_sent(usage.values())
        report.cached_calls = sum(u.cached_calls for u in usage.values())
        report.tokens_in = sum(u.tokens_in for u in usage.values())
        report.tokens_out = sum(u.tokens_out for u in usage.values())
        report.failed_traces = len(report.failed)
        if size is None:
            report.batch_size = sink.chosen_sizes
        report.wall_s = anyio.current_time() - started
        out.write_report(report)
        if playbooks and not out.playbook_json.exists():
            out.write_playbooks(playbooks)
    return report


__all__ = [
    "FailedTraceReport",
    "FileSink",
    "LearnReport",
    "LeftOutReport",
    "offline_settings",
    "run_learn",
]
