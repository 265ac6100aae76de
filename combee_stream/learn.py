"""``combee-stream learn``: learn playbooks offline from a JSONL file of traces (no broker).

    combee-stream learn --traces traces.jsonl --out DIR [--strategy combee|naive|sequential]
                        [--batch-size N|auto] [--resume] [--seed S]

Reads and validates every line (a bad line is reported with its number, skipped and counted; a
repeated trace id is skipped as a duplicate), groups traces by key, learns each key in windows
of the batch size with :class:`~combee_stream.core.learner.Learner` (keys run concurrently, a
key's windows in order), and after EVERY window writes ``DIR/history.jsonl`` (one PromptUpdate
per version), ``DIR/playbook.json`` and ``DIR/playbook.md``; ``DIR/report.json`` at the end (also
when the run stops early, with ``"complete": false``).

- ``--batch-size auto``: the online controller (:mod:`combee_stream.core.controller`) explores its
  candidate sizes on real windows (one each), then settles on the fitted size; the report lists
  every size it chose. ``sequential`` always uses windows of one trace.
- A trace whose reflection fails after the client's retries goes back to the front of the queue
  and is retried in the next window, up to ``engine.max_trace_attempts`` times; then it is
  reported in ``report.json`` (``failed``) and the exit code is 1. A window whose curator fails
  is retried (``WINDOW_ATTEMPTS``); its finished calls replay from the completion memo.
- ``--resume`` continues from ``DIR/history.jsonl``: each key restarts from its newest version and
  traces already learned are skipped. The completion memo is persisted in ``DIR/memo.jsonl``
  (unless ``llm.memo_path`` is set), so calls finished before an interruption are not paid twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, TextIO

import anyio
import msgspec
from msgspec import Struct

from combee_stream.config import Config
from combee_stream.core.controller import ControllerSettings, OnlineController
from combee_stream.core.learner import Learner, WindowError, WindowResult
from combee_stream.core.llm import LLMClient, RoleUsage
from combee_stream.core.playbook import new_playbook, render
from combee_stream.core.prompts import PROMPTS_VERSION
from combee_stream.core.scan import STRATEGIES, StrategySpec
from combee_stream.errors import UserError
from combee_stream.logs import get_logger
from combee_stream.schemas import (
    DecodeError,
    Playbook,
    PromptUpdate,
    Source,
    Trace,
    UpdateStats,
    decode,
    encode,
    utcnow,
)

log = get_logger(__name__)

WINDOW_ATTEMPTS: Final = 3
_SHOWN_BAD_LINES: Final = 20


class BadLine(Struct, frozen=True):
    line: int
    reason: str


class FailedTraceReport(Struct, frozen=True):
    key: str
    trace_id: str
    attempts: int
    reason: str


class LearnReport(Struct, kw_only=True):
    """``DIR/report.json`` (the fields of helpers/contract.md first)."""

    strategy: str
    batch_size: int | list[int]
    traces: int  # valid, distinct traces in the file
    windows: int
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
    rejected_windows: int = 0  # deltas refused by the token budget
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


# --------------------------------------------------------------------------- input


class TraceFile(Struct):
    traces: list[tuple[Trace, Source]]
    bad: list[BadLine]
    duplicates: int


def read_traces(path: Path) -> TraceFile:
    """Every valid trace with its Source; bad lines and repeated trace ids reported, not fatal."""
    traces: list[tuple[Trace, Source]] = []
    bad: list[BadLine] = []
    first_line: dict[str, int] = {}
    duplicates = 0
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise UserError(f"cannot read traces {path}: {exc.strerror or exc}") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                trace = decode(raw, Trace)
            except (DecodeError, ValueError) as exc:
                bad.append(BadLine(line=number, reason=str(exc)))
                continue
            if trace.trace_id in first_line:
                duplicates += 1
                reason = f"duplicate trace_id {trace.trace_id!r} (first at line "
                bad.append(BadLine(line=number, reason=reason + f"{first_line[trace.trace_id]})"))
                continue
            first_line[trace.trace_id] = number
            traces.append((trace, Source(trace_id=trace.trace_id)))
    return TraceFile(traces=traces, bad=bad, duplicates=duplicates)


# --------------------------------------------------------------------------- output folder


class History(Struct):
    playbooks: dict[str, Playbook]
    learned: dict[str, set[str]]
    traces_learned: dict[str, int]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


class OutputDir:
    """The learn output folder (helpers/contract.md)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.history = root / "history.jsonl"
        self.playbook_json = root / "playbook.json"
        self.playbook_md = root / "playbook.md"
        self.report = root / "report.json"
        self.memo = root / "memo.jsonl"

    def prepare(self, resume: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"--out {self.root} exists and is not a folder")
        self.root.mkdir(parents=True, exist_ok=True)
        if not resume and self.history.exists() and self.history.stat().st_size:
            raise UserError(
                f"{self.history} already holds a learn run: pass --resume to continue it, "
                "or choose another --out folder"
            )
        if not resume:
            for path in (self.memo, self.playbook_json, self.playbook_md, self.report):
                path.unlink(missing_ok=True)

    def load_history(self) -> History:
        """Newest playbook, learned trace ids and count per key. A torn last line (a crash in
        mid-write) is dropped and cut from the file; a bad line elsewhere is an error."""
        out = History(playbooks={}, learned={}, traces_learned={})
        if not self.history.exists():
            return out
        data = self.history.read_bytes()
        lines = data.split(b"\n")
        offset = 0
        for number, line in enumerate(lines, 1):
            start = offset
            offset += len(line) + 1
            if not line.strip():
                continue
            try:
                update = decode(line, PromptUpdate)
            except DecodeError as exc:
                if number == len(lines):  # no newline after it: torn by a crash
                    log.warning("learn.history_torn_line", line=number, reason=exc.reason)
                    with self.history.open("r+b") as handle:
                        handle.truncate(start)
                    break
                raise UserError(f"{self.history}:{number}: {exc.reason}") from None
            key = update.key
            known = out.playbooks.get(key)
            if known is not None and update.version <= known.version:
                raise UserError(
                    f"{self.history}:{number}: version {update.version} of key {key!r} "
                    f"after version {known.version}"
                )
            out.playbooks[key] = update.playbook
            out.learned.setdefault(key, set()).update(update.stats.trace_ids)
            out.traces_learned[key] = update.stats.traces_learned
        else:
            if data and not data.endswith(b"\n"):  # complete record, newline lost: restore it
                with self.history.open("ab") as handle:
                    handle.write(b"\n")
        return out

    def append_history(self, update: PromptUpdate) -> None:
        with self.history.open("ab") as handle:
            handle.write(encode(update) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def write_playbooks(self, playbooks: Mapping[str, Playbook]) -> None:
        ordered = {key: playbooks[key] for key in sorted(playbooks)}
        _atomic_write(self.playbook_json, msgspec.json.format(encode(ordered)) + b"\n")
        parts = [f"# Playbooks\n\n_{len(ordered)} key(s), combee-stream learn._\n"]
        for key, book in ordered.items():
            parts.append(f"## Key `{key}` — version {book.version}\n\n```text\n{render(book)}```\n")
        _atomic_write(self.playbook_md, "\n".join(parts).encode())

    def write_report(self, report: LearnReport) -> None:
        _atomic_write(self.report, msgspec.json.format(encode(report)) + b"\n")


# --------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.done = 0
        self.windows = 0
        self._stream = stream
        self._on = stream.isatty()

    def advance(self, learned: int, key: str, version: int) -> None:
        self.done += learned
        self.windows += 1
        if not self._on:
            return
        width = 30
        filled = width * self.done // self.total if self.total else width
        bar = "#" * filled + "." * (width - filled)
        self._stream.write(
            f"\rlearn [{bar}] {self.done}/{self.total} traces, {self.windows} windows"
            f" ({key} v{version})\x1b[K"
        )
        self._stream.flush()

    def close(self) -> None:
        if self._on:
            self._stream.write("\n")
            self._stream.flush()


# --------------------------------------------------------------------------- the run


class _Item(Struct):
    trace: Trace
    source: Source
    attempts: int = 0
    reason: str = ""


class LearnRun:
    """One ``learn`` invocation: the windows of every key, and their bookkeeping."""

    def __init__(
        self,
        config: Config,
        out: OutputDir,
        learner: Learner,
        spec: StrategySpec,
        batch_size: int | None,  # None = auto
        history: History,
        report: LearnReport,
        progress: Progress,
    ) -> None:
        self._config = config
        self._out = out
        self._learner = learner
        self._spec = spec
        self._batch_size = batch_size
        self._playbooks = dict(history.playbooks)
        self._traces_learned = dict(history.traces_learned)
        self._report = report
        self._progress = progress
        self.chosen_sizes: list[int] = []

    async def learn_key(self, key: str, items: list[_Item]) -> None:
        playbook = self._playbooks.get(key) or new_playbook(key)
        pending = deque(items)
        controller = None
        if self._batch_size is None and self._spec.window_size is None:
            learning = self._config.learning
            controller = OnlineController(
                ControllerSettings(
                    min_size=learning.min_batch_size, max_size=learning.max_batch_size
                ),
                key=key,
            )
        done = self._traces_learned.get(key, 0)
        total = done + len(items)
        while pending:
            if self._spec.window_size is not None:
                size = self._spec.window_size
            elif controller is not None:
                size = controller.current()
            else:
                size = self._batch_size or 1
            window = [pending.popleft() for _ in range(min(size, len(pending)))]
            self.chosen_sizes.append(size)
            progress = f"traces {done + 1}-{done + len(window)} of {total} for key {key}"
            result = await self._learn_window(playbook, window, progress)
            if controller is not None:
                controller.observe(len(window), result.stats.delay_s)
            retry: list[_Item] = []
            failed = {f.source: f.reason for f in result.failed}
            for item in window:
                if item.source not in failed:
                    continue
                item.attempts += 1
                item.reason = failed[item.source]
                if item.attempts < self._config.engine.max_trace_attempts:
                    retry.append(item)
                else:
                    self._report.failed.append(
                        FailedTraceReport(
                            key=key,
                            trace_id=item.trace.trace_id,
                            attempts=item.attempts,
                            reason=item.reason,
                        )
                    )
            pending.extendleft(reversed(retry))  # retried first, in their original order
            self._account(result)
            if result.learned:
                done += len(result.learned)
                playbook = self._publish(playbook, result, size)
            self._progress.advance(len(result.learned), key, playbook.version)

    async def _learn_window(
        self, playbook: Playbook, window: list[_Item], progress: str
    ) -> WindowResult:
        traces = [(item.trace, item.source) for item in window]
        for attempt in range(1, WINDOW_ATTEMPTS + 1):
            try:
                return await self._learner.learn_window(playbook, traces, progress=progress)
            except WindowError as exc:
                log.warning(
                    "learn.window_retry", key=playbook.key, attempt=attempt, reason=exc.reason
                )
                if attempt == WINDOW_ATTEMPTS:
                    raise UserError(
                        f"{exc} ({WINDOW_ATTEMPTS} attempts). Every finished window is saved in "
                        f"{self._out.root}; run again with --resume to continue."
                    ) from exc
        raise AssertionError("unreachable")

    def _account(self, result: WindowResult) -> None:
        stats = result.stats
        report = self._report
        report.windows += 1
        report.max_curator_items = max(report.max_curator_items, stats.max_curator_items)
        report.rounds += stats.rounds
        report.learned += len(result.learned)
        report.rejected_windows += int(result.applied.rejected is not None)

    def _publish(self, parent: Playbook, result: WindowResult, batch_size: int) -> Playbook:
        key = parent.key
        book = result.playbook
        learned = self._traces_learned.get(key, 0) + len(result.learned)
        self._traces_learned[key] = learned
        stats = result.stats
        rejected = result.applied.rejected
        update = PromptUpdate(
            key=key,
            version=book.version,
            playbook=book,
            prompt=render(book),
            parent_version=parent.version,
            stats=UpdateStats(
                traces_learned=learned,
                window_traces=len(result.learned),
                trace_ids=[s.trace_id for s in result.learned],
                strategy=stats.strategy,
                batch_size=batch_size,
                llm_calls=stats.llm_calls - stats.cached_calls,
                tokens_in=stats.tokens_in,
                tokens_out=stats.tokens_out,
                delay_s=stats.delay_s,
                rejected=encode(rejected).decode() if rejected else None,
            ),
            created_at=utcnow(),
        )
        self._out.append_history(update)
        self._playbooks[key] = book
        self._out.write_playbooks(self._playbooks)
        return book

    @property
    def playbooks(self) -> dict[str, Playbook]:
        return self._playbooks


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


async def run_learn(
    config: Config,
    traces_path: Path,
    out_dir: Path,
    *,
    strategy: str | None = None,
    batch_size: str | None = None,
    resume: bool = False,
    seed: int | None = None,
    env: Mapping[str, str] | None = None,
    stderr: TextIO | None = None,
) -> LearnReport:
    """The whole ``learn`` command, callable from code (benchmarks, tests)."""
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
        learning, strategy=spec.name, seed=learning.seed if seed is None else seed
    )
    llm_config = config.llm
    roles: list[Any] = ["reflector", "curator"]
    if learning.combine == "llm" and spec.name == "combee":
        roles.append("combiner")
    if llm_config.embeddings.enabled:
        roles.append("embeddings")
    # Fail fast (MissingEndpointError says exactly what to set) before touching --out.
    probe = LLMClient(msgspec.structs.replace(llm_config, memo_path=""), env=env)
    try:
        probe.require(*roles)
    finally:
        await probe.aclose()
    out = OutputDir(out_dir)
    out.prepare(resume)
    if not llm_config.memo_path:
        llm_config = msgspec.structs.replace(llm_config, memo_path=str(out.memo))

    source = read_traces(traces_path)
    for bad in source.bad[:_SHOWN_BAD_LINES]:
        print(f"combee-stream learn: {traces_path}:{bad.line}: {bad.reason}", file=stderr)
    if len(source.bad) > _SHOWN_BAD_LINES:
        more = len(source.bad) - _SHOWN_BAD_LINES
        print(f"combee-stream learn: ... and {more} more bad line(s)", file=stderr)
    history = out.load_history() if resume else History(playbooks={}, learned={}, traces_learned={})
    by_key: dict[str, list[_Item]] = {}
    already = 0
    for trace, src in source.traces:
        if trace.trace_id in history.learned.get(trace.key, set()):
            already += 1
            continue
        by_key.setdefault(trace.key, []).append(_Item(trace=trace, source=src))

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
    client = LLMClient(llm_config, env=env)
    progress = Progress(sum(len(v) for v in by_key.values()), stderr)
    run: LearnRun | None = None
    try:
        learner = Learner(
            client,
            learning,
            embed=client.embed if llm_config.embeddings.enabled else None,
            dedup_threshold=llm_config.embeddings.threshold,
        )
        run = LearnRun(config, out, learner, spec, size, history, report, progress)
        async with anyio.create_task_group() as tg:
            for key, items in by_key.items():
                tg.start_soon(run.learn_key, key, items)
        report.complete = True
    finally:
        progress.close()
        usage = client.usage()
        await client.aclose()
        playbooks = run.playbooks if run is not None else history.playbooks
        report.keys = len({t.key for t, _ in source.traces} | set(playbooks))
        report.versions = {k: playbooks[k].version for k in sorted(playbooks)}
        report.per_role = usage
        report.llm_calls = sum(u.calls - u.cached_calls for u in usage.values())
        report.cached_calls = sum(u.cached_calls for u in usage.values())
        report.tokens_in = sum(u.tokens_in for u in usage.values())
        report.tokens_out = sum(u.tokens_out for u in usage.values())
        report.failed_traces = len(report.failed)
        if size is None and run is not None:
            report.batch_size = run.chosen_sizes
        report.wall_s = anyio.current_time() - started
        out.write_report(report)
        if playbooks and not out.playbook_json.exists():
            out.write_playbooks(playbooks)
    return report


# --------------------------------------------------------------------------- CLI


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
    }
    print(json.dumps(summary))
    if report.failed:
        print(
            f"combee-stream learn: {report.failed_traces} trace(s) could not be learned; "
            f"see {args.out / 'report.json'} (failed)",
            file=sys.stderr,
        )
        return 1
    return 0


__all__ = [
    "WINDOW_ATTEMPTS",
    "BadLine",
    "FailedTraceReport",
    "LearnReport",
    "OutputDir",
    "read_traces",
    "register",
    "run_learn",
]
