"""``bench quality``: does learning make the agent better? A REAL model, held-out tasks.

1. The endpoint's capacity: output tokens per second for one request and for N at once.
2. A training stream: the example agent answers the training tasks with the base prompt; each
   run becomes a trace with the environment's feedback (saved as ``train_traces.jsonl``).
3. Each strategy (``naive`` and ``combee`` by default; ``sequential`` on a prefix of the stream
   with ``--sequential-n``, it is one LLM round per trace) learns a playbook from those traces
   with offline ``learn`` (the engine's key pipeline), at the same batch size, with the replay
   gate on (its held-out tasks drawn from the stream, as the engine draws them).
4. The agent answers the held-out tasks (disjoint from the training ones) with the base prompt
   and with each playbook; accuracy with its 95% Wilson interval, and paired against the base
   prompt (tasks gained and lost, Newcombe's interval of the difference, exact McNemar p).
5. Per playbook: bullets, near-duplicate bullets (by wordllama embeddings, a measure the
   learner's filter does not use, so the figure can fail), the learner's LLM calls and tokens,
   the share of its prompt tokens the server served from cache, replies cut at max_tokens,
   windows parked and refused by the gate, its wall time and the share of the endpoint's
   capacity it used.
6. The whole run's wall time against its floor: every output token the endpoint decoded for it
   (training traces, evaluations, learning) at the measured parallel rate. An arm whose prompt
   is another's (a strategy that served no bullet gives the agent the base prompt) reuses that
   arm's answers instead of asking the same questions again.

Every finished item is written at once and reused by a rerun (a long run on 2 cores is
interrupted): each training trace (``train_traces.jsonl``), each evaluated answer
(``eval-LABEL-DIGEST.jsonl``), each learner LLM reply (the memo of each strategy's folder).
Each phase shows its progress on stderr (a bar on a terminal, lines in a log).

Nothing here is simulated, and nothing is tuned on the held-out tasks: they are drawn after the
settings are fixed and only ever evaluated. The model and every setting go into the report.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from textwrap import shorten
from typing import Any, Final

import anyio
import httpx2
import msgspec
from msgspec import Struct

from combee_stream.agent.prompts import Prompt
from combee_stream.agent.recorder import RunRecorder
from combee_stream.bench.report import Target, document, table
from combee_stream.config import Config, GateConfig
from combee_stream.core.playbook import render
from combee_stream.evaluation.answerer import TEMPLATE_DIGEST, Answerer, system_message
from combee_stream.evaluation.run import EvalResult, TaskOutcome, compare, evaluate
from combee_stream.evaluation.stats import Paired
from combee_stream.llm import EMBEDDINGS, LLMCallError, LLMClient
from combee_stream.offline import LearnReport, LeftOutReport
from combee_stream.offline.store import OutputDir
from combee_stream.progress import PhaseProgress
from combee_stream.schemas import Playbook, PromptUpdate, Trace, decode, encode
from combee_stream.tasks import KEY, Task, load_tasks, task_feedback
from combee_stream.wiring import run_learn

STRATEGIES = ("sequential", "naive", "combee")
DEFAULT_STRATEGIES = ("naive", "combee")
ROLES = ("agent", "reflector", "curator", "combiner")
# wordllama cosine at which two bullets count as one rule stated twice. Its paraphrases score
# lower than MiniLM's (mean 0.52 on the notes' toy pairs); "DSCR is net operating income
# divided by total debt service" and "The debt service coverage ratio equals NOI over annual
# debt service payments" score 0.50, two different Formula rules (round in the expression;
# percentages as fractions) 0.22.
NEAR_DUPLICATE_COSINE = 0.5


class QualitySettings(Struct, kw_only=True):
    model: str  # the endpoint's model, as the report names it
    train: str  # task source of the training stream
    train_n: int
    held_out: str  # task source of the held-out evaluation
    held_out_n: int
    strategies: list[str]
    batch_size: int
    concurrency: int  # requests in flight (the endpoint's slots)
    key: str = KEY
    sequential_n: int = 0  # sequential learns from this prefix of the stream (0: all of it)
    gate: bool = True  # the replay gate reviews every candidate
    check_lessons: bool = False  # gate.check_lessons: new bullets retried on their failures
    worked_examples: bool = False  # learning.worked_examples: new bullets end with an example
    reflect_successes: str = "all"  # learning.reflect_successes of the learners
    merge_similar: float = 0.0  # learning.merge_similar of the learners
    combine: str = "union"  # learning.combine of combee (naive has one group, nothing to combine)
    seed: int = 0  # learning.seed (the shuffle); the held-out key is the work folder's secret
    endpoints: dict[str, str] = {}  # role -> "model at base_url"


class Capacity(Struct, kw_only=True):
    """Output tokens per second the endpoint sustains, alone and with ``n`` requests at once."""

    single_tokens_per_s: float
    parallel_tokens_per_s: float
    parallel: int


class PromptRow(Struct, kw_only=True):
    prompt: str  # base | a strategy
    accuracy: float
    ci95: tuple[float, float]
    correct: int
    n: int
    by_family: dict[str, list[int]]
    vs_base: Paired | None = None
    bullets: int = 0
    near_duplicates: int = 0  # bullets with a near-duplicate elsewhere in the playbook
    near_duplicate_share: float = 0.0
    skipped: dict[str, int] = {}  # proposals the learner refused, by reason
    learn_traces: int = 0
    learn_calls: int = 0
    learn_tokens_in: int = 0
    learn_tokens_out: int = 0
    learn_tokens_cached: int = 0  # prompt tokens the server served from its cache
    # Chat prompt tokens (learn_tokens_in less the embedding inputs: an embedding endpoint has
    # no prompt cache), the denominator of cache_share.
    learn_prompt_tokens: int = 0
    cache_share: float = 0.0
    cache_by_role: dict[str, float] = {}  # each chat role's cached / prompt tokens
    truncated_replies: int = 0  # learner replies cut at max_tokens
    invalid_replies: int = 0
    parked_traces: int = 0  # traces of windows that failed for good
    gate_refused: int = 0  # windows the token budget or the gate refused
    published_worse: int = 0  # versions published that answered fewer held-out tasks
    left_out: int = 0  # new bullets the gate blamed and left out of a published version
    not_served: list[LeftOutReport] = []  # the learn report's proposals not served, with text
    removes_applied: int = 0
    learn_wall_s: float = 0.0
    capacity_share: float = 0.0  # learner output tokens / (wall x parallel capacity)
    eval_wall_s: float = 0.0
    eval_tokens_out: int = 0  # the agent's output tokens for its answers
    evaluated_by: list[str] = []  # the invocations (start times) that answered its tasks
    # The arm whose answers it reuses: its playbook gave the agent that arm's very prompt (a
    # strategy that served no bullet, the base prompt), so asking again would only measure the
    # server's noise (two evaluations of one prompt differ on 5 to 8 of 100 answers).
    answers_of: str = ""


class QualityReport(Struct, kw_only=True):
    suite: str = "quality"
    simulated: bool = False
    settings: QualitySettings
    capacity: Capacity
    train_accuracy: float  # of the base agent on the training stream
    train_wall_s: float
    # The whole run, capacity measurement to report, over every invocation that did some work
    # (0: a work folder begun before it was recorded).
    wall_s: float = 0.0
    # Every output token the endpoint decoded for the run (training traces, each evaluation
    # asked, learning): at capacity.parallel_tokens_per_s, the least wall time it could take.
    tokens_out: int = 0
    results: list[PromptRow]
    combee_vs_naive: Paired | None
    targets: list[Target]
    notes: list[str]


async def measure_capacity(base_url: str, model: str, parallel: int) -> Capacity:
    """Decode throughput of the endpoint: one long completion alone, then ``parallel`` at once."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}],
        "max_tokens": 160,
        "temperature": 0,
    }

    async def one(http: httpx2.AsyncClient) -> int:
        reply = await http.post(f"{base_url}/chat/completions", json=body)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    async with httpx2.AsyncClient(timeout=600) as http:
        await one(http)  # warm the server (first request loads caches)
        started = time.monotonic()
        single = await one(http) / (time.monotonic() - started)
        counts: list[int] = []

        async def run() -> None:
            counts.append(await one(http))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(parallel):
                tg.start_soon(run)
        together = sum(counts) / (time.monotonic() - started)
    return Capacity(single_tokens_per_s=single, parallel_tokens_per_s=together, parallel=parallel)


async def training_traces(
    config: Config, tasks: list[Task], path: Path, key: str, concurrency: int
) -> tuple[float, float, int]:
    """The base agent on the training tasks, as traces in ``path``, each appended as it is
    answered (a rerun asks only the tasks it lacks); the file is rewritten in task order at the
    end, the order the stream is learned in. Returns (accuracy, wall seconds, output tokens),
    the last two of the tasks this call asked."""
    saved = {t.trace_id: t for t in _read_traces(path)}
    todo = [t for t in tasks if t.id not in saved]
    started = anyio.current_time()
    base = Prompt(key=key, text="", version=0, bullet_ids=[], source="fallback")
    limiter = anyio.CapacityLimiter(concurrency)
    tokens_out = 0
    if todo:
        with (
            path.open("ab") as sink,
            PhaseProgress("train (base agent)", len(tasks), done=len(tasks) - len(todo)) as bar,
        ):
            async with LLMClient(config.llm) as llm:
                answerer = Answerer(llm)

                async def one(task: Task) -> None:
                    nonlocal tokens_out
                    async with limiter:
                        try:
                            answer = await answerer.answer(base.text, task.question)
                        except LLMCallError:
                            bar.advance()
                            return  # no answer, no trace: nothing to learn from
                    run = RunRecorder(
                        base, task.question, trace_id=task.id, metadata={"family": task.family}
                    )
                    run.record(answer)
                    trace = run.trace(
                        output=answer.output, feedback=task_feedback(task, answer.output)
                    )
                    saved[task.id] = trace
                    sink.write(encode(trace) + b"\n")
                    sink.flush()
                    tokens_out += answer.tokens_out
                    bar.advance(tokens_out=answer.tokens_out)

                async with anyio.create_task_group() as tg:
                    for task in todo:
                        tg.start_soon(one, task)
    traces = [saved[t.id] for t in tasks if t.id in saved]
    if [t.trace_id for t in _read_traces(path)] != [t.trace_id for t in traces]:
        _write_traces(path, traces)
    accuracy = sum(bool(t.feedback.passed) for t in traces) / max(1, len(traces))
    return accuracy, anyio.current_time() - started if todo else 0.0, tokens_out


def _read_traces(path: Path) -> list[Trace]:
    if not path.is_file():
        return []
    return [decode(line, Trace) for line in path.read_bytes().splitlines() if line.strip()]


def _write_traces(path: Path, traces: list[Trace]) -> None:
    path.write_bytes(b"".join(encode(t) + b"\n" for t in traces))


@functools.cache
def _wordllama() -> Any:
    import wordllama  # the bench extra; loaded once, from the weights inside the wheel

    folder = Path(wordllama.__file__).parent
    return wordllama.WordLlama.load(cache_dir=folder, disable_download=True)


def near_duplicate_bullets(playbook: Playbook, threshold: float = NEAR_DUPLICATE_COSINE) -> int:
    """Bullets with a near duplicate elsewhere in the playbook: wordllama cosine at least
    ``threshold``. Not the learner's own measure (content words, and embeddings from the LLM
    endpoint when configured), so a filter that misses paraphrases shows here."""
    texts = [b.content for s in playbook.sections for b in s.bullets]
    if len(texts) < 2:
        return 0
    model = _wordllama()
    flagged: set[int] = set()
    for i, j in itertools.combinations(range(len(texts)), 2):
        if float(model.similarity(texts[i], texts[j])) >= threshold:
            flagged |= {i, j}
    return len(flagged)


def _row(
    prompt: str, result: EvalResult, base: EvalResult | None, evaluated_by: list[str]
) -> PromptRow:
    return PromptRow(
        prompt=prompt,
        accuracy=result.accuracy,
        ci95=result.ci95,
        correct=result.correct,
        n=result.n,
        by_family=result.by_family,
        vs_base=compare(base, result) if base is not None else None,
        eval_wall_s=result.wall_s,
        eval_tokens_out=sum(o.tokens_out for o in result.outcomes),
        evaluated_by=evaluated_by,
    )


def scored_as_tasks(config: Config, tasks: Sequence[Task]) -> Config:
    """``config`` with the gate (and so the worked-example check) scoring as this benchmark
    does, when every task has the same string scorer and the gate's own agent answers: on
    ACE's Formula rows by ACE's rule, under which an unrounded answer is wrong. The default
    "numeric" forgives 0.005: the eighteenth run's gate passed a version whose agent lost 8
    held-out tasks by not rounding (docs/benchmarks/quality_18.md)."""
    scorers = {t.scorer for t in tasks}
    if len(scorers) != 1 or config.gate.scorer == "judge" or config.gate.evaluator != "agent":
        return config
    gate = msgspec.structs.replace(config.gate, scorer=scorers.pop())
    return msgspec.structs.replace(config, gate=gate)


async def run_quality(config: Config, settings: QualitySettings, out: Path) -> QualityReport:
    await anyio.Path(out).mkdir(parents=True, exist_ok=True)
    s = settings
    train = load_tasks(s.train, limit=s.train_n)
    seen = {t.question for t in train}
    held_out = [
        t for t in load_tasks(s.held_out, limit=s.held_out_n + s.train_n) if t.question not in seen
    ]
    held_out = held_out[: s.held_out_n]
    config = scored_as_tasks(config, [*train, *held_out])
    phases = _Phases.load(out)
    invocation = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    clock = _Clock(phases, out)
    if phases.capacity is None:  # measured once per work folder, as its run began
        clock.working = True
        phases.capacity = await measure_capacity(
            config.llm.agent.base_url, config.llm.agent.model, s.concurrency
        )
        phases.save(out)
    capacity = phases.capacity

    traces_path = out / "train_traces.jsonl"
    async with anyio.create_task_group() as ticking:
        ticking.start_soon(clock.tick)
        train_accuracy, train_wall, train_tokens = await training_traces(
            config, train, traces_path, s.key, s.concurrency
        )
        if train_wall:  # the traces made by this invocation, added to the earlier ones
            clock.working = True
            phases.train_wall_s += train_wall
            phases.train_tokens_out += train_tokens
            phases.save(out)
        train_wall = phases.train_wall_s

        # One phase after the other. Learning while the evaluations ran (the base prompt while
        # the strategies learned, each playbook once learned) was measured in the twenty-sixth
        # run (2026-12-07) and gained nothing on 2 cores: one request alone gets half the
        # machine's decode throughput (11.8 of 22.9 tokens/s) and prefill is compute too, so a
        # learner alone leaves little idle; the interleaved prompts evicted each other's cached
        # prefixes (prefill tokens per request 229 against 162 in the twenty-fifth run), and
        # each window waited behind evaluation requests (combee's first took 32 minutes).
        results: dict[str, EvalResult] = {}
        runs: dict[str, list[str]] = {}
        learned: dict[str, tuple[LearnReport, Playbook]] = {}
        answered_with: dict[str, str] = {}  # the agent's system message -> the arm asked with it
        reused: dict[str, str] = {}  # an arm -> the arm whose answers are its own
        async with LLMClient(config.llm) as answers:

            async def evaluate_arm(label: str, prompt: str) -> None:
                same = answered_with.setdefault(system_message(prompt), label)
                if same != label:  # the same agent: its answers, not the server's noise again
                    results[label] = msgspec.structs.replace(results[same], label=label)
                    runs[label], reused[label] = runs[same], same
                    return
                results[label], runs[label] = await _evaluated(
                    answers, config.llm.agent.model, prompt, held_out, label, out,
                    s.concurrency, phases, invocation, clock,
                )  # fmt: skip

            await evaluate_arm("base", "")
            for strategy in s.strategies:
                learned[strategy] = await _learned_playbook(
                    config, s, strategy, traces_path, out, clock
                )
                await evaluate_arm(strategy, render(learned[strategy][1]))
        ticking.cancel_scope.cancel()
    clock.stop()

    base = results["base"]
    rows = [_row("base", base, None, runs["base"])]
    for strategy in s.strategies:
        report, playbook = learned[strategy]
        row = _row(strategy, results[strategy], base, runs[strategy])
        _learned(row, playbook, report, _updates(out / strategy), capacity)
        row.answers_of = reused.get(strategy, "")
        if row.answers_of:  # asked once, counted once
            row.eval_wall_s, row.eval_tokens_out = 0.0, 0
        rows.append(row)
    tokens_out = phases.train_tokens_out + sum(r.eval_tokens_out + r.learn_tokens_out for r in rows)
    combee_vs_naive = (
        compare(results["naive"], results["combee"])
        if {"naive", "combee"} <= set(results)
        else None
    )
    return QualityReport(
        settings=s,
        capacity=capacity,
        train_accuracy=train_accuracy,
        train_wall_s=train_wall,
        wall_s=phases.wall_s,
        tokens_out=tokens_out,
        results=rows,
        combee_vs_naive=combee_vs_naive,
        targets=_targets(rows, combee_vs_naive, phases.wall_s, tokens_out, capacity),
        notes=[*_notes(s, capacity, config.gate), _sessions_note(rows)],
    )


async def _learned_playbook(
    config: Config, s: QualitySettings, strategy: str, traces_path: Path, out: Path,
    clock: _Clock,
) -> tuple[LearnReport, Playbook]:  # fmt: skip
    """``strategy``'s playbook learned from the training traces in its folder (an interrupted
    earlier run is resumed, a finished one reused), with its learn report."""
    folder = out / strategy
    stream = traces_path
    if strategy == "sequential" and s.sequential_n:
        stream = out / f"train_traces_first{s.sequential_n}.jsonl"
        _write_traces(stream, _read_traces(traces_path)[: s.sequential_n])
    report = _finished(folder)
    if report is None:
        clock.working = True
        report = await run_learn(
            config,
            stream,
            folder,
            strategy=strategy,
            batch_size=str(s.batch_size),
            resume=await anyio.Path(folder / "history.jsonl").is_file(),
            env={**os.environ, config.gate.holdout_secret_env: _holdout_secret(out)},
        )
    history = OutputDir(folder).load_history()
    playbook = history.newest[s.key].playbook if s.key in history.newest else Playbook(key=s.key)
    return report, playbook


class _Clock:
    """The work folder's wall time (``_Phases.wall_s``): the earlier invocations' plus this
    one's, saved every half minute while it works, so a killed run loses at most that. An
    invocation that reuses every finished item adds nothing (``working`` stays false)."""

    _EVERY_S: Final = 30.0

    def __init__(self, phases: _Phases, out: Path) -> None:
        self._phases, self._out = phases, out
        self._earlier = phases.wall_s
        self._started = time.monotonic()
        self.working = False

    async def tick(self) -> None:
        while True:
            await anyio.sleep(self._EVERY_S)
            self.stop()

    def stop(self) -> None:
        if self.working:
            self._phases.wall_s = self._earlier + time.monotonic() - self._started
            self._phases.save(self._out)


class _Phases(Struct, kw_only=True):
    """What a work folder's earlier invocations measured (``phases.json``): a rerun that
    reuses their traces reports their time and the endpoint's capacity as measured then."""

    capacity: Capacity | None = None
    # The whole run's wall time, every invocation's that did some work (_Clock): what the
    # phases' times leave out (capacity, loading, reports) included.
    wall_s: float = 0.0
    train_wall_s: float = 0.0
    train_tokens_out: int = 0  # the agent's output tokens for the training traces
    eval_wall_s: dict[str, float] = {}  # by evaluation (its answers file's name)
    # By evaluation, the invocations (their start times) that answered some of its tasks. Two
    # evaluations of one prompt on llama-server with 4 slots differ on a share of answers (the
    # slots batch together and the prompt cache changes the batch sizes): 6 of 24 within one
    # server's life, 15 of 100 across sessions a day apart (2026-12-06). A pair of arms
    # evaluated by different invocations carries that drift, and the report says so.
    eval_runs: dict[str, list[str]] = {}

    @staticmethod
    def load(out: Path) -> _Phases:
        path = out / "phases.json"
        if not path.is_file():
            return _Phases()
        return msgspec.json.decode(path.read_bytes(), type=_Phases)

    def save(self, out: Path) -> None:
        (out / "phases.json").write_bytes(msgspec.json.encode(self))

    def kept(self, name: str, answers: int) -> None:
        """Square an evaluation's record with the answers its file keeps for this run: none
        (the file deleted to answer every task again, as to pair two arms in one invocation)
        starts the record afresh, since the invocations it names answered nothing reported
        now; some that no invocation recorded were answered by a version that did not."""
        if not answers:
            self.eval_wall_s.pop(name, None)
            self.eval_runs.pop(name, None)
        elif name not in self.eval_runs:
            self.eval_runs[name] = [UNRECORDED]


def _holdout_secret(out: Path) -> str:
    """The replay gate's held-out key for this work folder: generated on the first run and
    kept beside the traces, so a resumed run holds out the same tasks (and naive and combee
    are gated on the same ones)."""
    path = out / "holdout.secret"
    if not path.is_file():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


def _learned(
    row: PromptRow,
    playbook: Playbook,
    report: LearnReport,
    updates: list[PromptUpdate],
    capacity: Capacity,
) -> None:
    """What learning the row's playbook cost and did, from its report and its versions."""
    skipped: dict[str, int] = {}
    before: set[str] = set()
    for update in updates:
        for reason, count in update.stats.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
        gate = update.stats.gate
        if gate is not None and gate.accepted and gate.candidate < gate.current:
            row.published_worse += 1
        if gate is not None and gate.accepted and not gate.split:
            row.left_out += len(gate.pruned)
        now = {b.id for sec in update.playbook.sections for b in sec.bullets}
        row.removes_applied += len(before - now)  # removed, or merged by consolidation
        before = now
    row.not_served = report.left_out
    usage = report.per_role.values()
    row.bullets = sum(len(sec.bullets) for sec in playbook.sections)
    row.near_duplicates = near_duplicate_bullets(playbook)
    row.near_duplicate_share = row.near_duplicates / row.bullets if row.bullets else 0.0
    row.skipped = dict(sorted(skipped.items()))
    row.learn_traces = report.traces
    row.learn_calls = report.llm_calls
    row.learn_tokens_in = report.tokens_in
    row.learn_tokens_out = report.tokens_out
    row.learn_tokens_cached = sum(u.tokens_cached for u in usage)
    chat = {role: u for role, u in report.per_role.items() if role != EMBEDDINGS and u.tokens_in}
    row.learn_prompt_tokens = sum(u.tokens_in for u in chat.values())
    row.cache_share = (
        row.learn_tokens_cached / row.learn_prompt_tokens if row.learn_prompt_tokens else 0.0
    )
    row.cache_by_role = {role: u.tokens_cached / u.tokens_in for role, u in chat.items()}
    row.truncated_replies = sum(u.truncated_replies for u in usage)
    row.invalid_replies = sum(u.invalid_replies for u in usage)
    row.parked_traces = report.failed_traces
    row.gate_refused = report.rejected_windows
    row.learn_wall_s = report.wall_s
    row.capacity_share = (
        report.tokens_out / (report.wall_s * capacity.parallel_tokens_per_s)
        if report.wall_s and capacity.parallel_tokens_per_s
        else 0.0
    )


async def _evaluated(
    llm: LLMClient, model: str, prompt: str, tasks: list[Task], label: str, out: Path,
    concurrency: int, phases: _Phases, invocation: str, clock: _Clock,
) -> tuple[EvalResult, list[str]]:  # fmt: skip
    """One prompt on the held-out tasks, each answer appended to ``out`` as it is scored: the
    suite is long on 2 cores, and a rerun reuses every answer of the same model and prompt to
    a task it asks (one with more held-out tasks asks only the new ones). Its wall time is
    every invocation's that answered some of them (``phases.json``), not this one's only: a
    rerun that reuses a finished evaluation reports what it took. Returned with those
    invocations (``invocation`` is this one's start)."""
    # The agent's templates are part of what answered: a rerun under new ones asks again.
    identity = "\n".join([model, TEMPLATE_DIGEST, prompt])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    name = f"eval-{label}-{digest}"
    path = out / f"{name}.jsonl"
    asked = {t.id for t in tasks}
    done = [o for o in _read_outcomes(path) if o.task_id in asked]
    phases.kept(name, len(done))
    answered = {o.task_id for o in done}
    if all(t.id in answered for t in tasks):  # no call: every task is answered
        result = await evaluate(Answerer(llm), prompt, tasks, label=label, done=done)
    else:
        clock.working = True
        with (
            path.open("ab") as sink,
            PhaseProgress(f"evaluate ({label})", len(tasks), done=len(done)) as bar,
        ):

            def keep(outcome: TaskOutcome) -> None:
                sink.write(msgspec.json.encode(outcome) + b"\n")
                sink.flush()
                bar.advance(tokens_out=outcome.tokens_out)

            result = await evaluate(
                Answerer(llm), prompt, tasks, label=label, concurrency=concurrency,
                done=done, on_outcome=keep,
            )  # fmt: skip
        phases.eval_wall_s[name] = phases.eval_wall_s.get(name, 0.0) + result.wall_s
        phases.eval_runs[name] = [*phases.eval_runs.get(name, []), invocation]
        phases.save(out)
    runs = phases.eval_runs.get(name, [])
    return msgspec.structs.replace(result, wall_s=phases.eval_wall_s.get(name, 0.0)), runs


def _read_outcomes(path: Path) -> list[TaskOutcome]:
    """The answers saved so far; a line torn by a kill is dropped (its task is asked again)."""
    if not path.is_file():
        return []
    outcomes: list[TaskOutcome] = []
    for line in path.read_bytes().splitlines():
        try:
            outcomes.append(msgspec.json.decode(line, type=TaskOutcome))
        except msgspec.DecodeError:
            continue
    return outcomes


def _finished(folder: Path) -> LearnReport | None:
    """The report of a strategy an earlier run of the suite learned to the end (the suite is
    long on 2 cores: a rerun continues where it stopped)."""
    path = folder / "report.json"
    if not path.is_file():
        return None
    report = msgspec.json.decode(path.read_bytes(), type=LearnReport)
    return report if report.complete and not report.failed else None


def _updates(folder: Path) -> list[PromptUpdate]:
    path = folder / "history.jsonl"
    return [decode(line, PromptUpdate) for line in path.read_bytes().splitlines() if line.strip()]


# Issue 17's bound for the whole run (both strategies, three evaluations) on 2 cores.
RUN_MINUTES: Final = 75


def _run_time(wall_s: float, tokens_out: int, capacity: Capacity) -> str:
    """``wall_s`` against its floor: the run's output tokens at the endpoint's measured parallel
    rate. A floor, not a goal within reach: prefill (the prompt tokens no cache served) is
    compute on the same cores, and a learner's window waits for the one before it. None for a
    work folder begun before the tokens were recorded."""
    endpoint = (
        f"{capacity.parallel_tokens_per_s:.1f} output tokens/s with {capacity.parallel} "
        "requests at once"
    )
    if not tokens_out or not capacity.parallel_tokens_per_s:
        return f"{wall_s / 60:.1f} min (endpoint: {endpoint})"
    floor = tokens_out / capacity.parallel_tokens_per_s
    return (
        f"{wall_s / 60:.1f} min, {wall_s / floor:.1f} times its floor: {tokens_out:,} output "
        f"tokens take {floor / 60:.1f} min at the endpoint's {endpoint}"
    )


def _targets(
    rows: list[PromptRow], combee_vs_naive: Paired | None, wall_s: float, tokens_out: int,
    capacity: Capacity,
) -> list[Target]:  # fmt: skip
    combee = next((r for r in rows if r.prompt == "combee"), None)
    if combee is None or combee.vs_base is None:
        return []
    learned = [r for r in rows if r.prompt != "base"]
    tokens_in = sum(r.learn_prompt_tokens for r in learned)
    cached = sum(r.learn_tokens_cached for r in learned)
    targets = [
        Target(
            name="combee beats the base prompt on held-out tasks",
            target="paired 95% CI lower bound > 0",
            measured=f"{combee.vs_base.difference:+.1%} ({combee.vs_base.ci95[0]:+.1%} to "
            f"{combee.vs_base.ci95[1]:+.1%})",
            met=combee.vs_base.ci95[0] > 0,
        ),
        Target(
            name="near-duplicate bullets in the combee playbook (wordllama cosine "
            f">= {NEAR_DUPLICATE_COSINE})",
            target="< 10%",
            measured=f"{combee.near_duplicate_share:.0%} "
            f"({combee.near_duplicates} of {combee.bullets})",
            met=combee.near_duplicate_share < 0.10,
        ),
        Target(
            name="no published version answers fewer gate tasks than its parent",
            target="0",
            measured=", ".join(f"{r.prompt} {r.published_worse}" for r in learned),
            met=all(r.published_worse == 0 for r in learned),
        ),
        Target(
            name="no window parked (cut-off or invalid replies)",
            target="0 traces",
            measured=", ".join(
                f"{r.prompt} {r.parked_traces} ({r.truncated_replies} cut replies)" for r in learned
            ),
            met=all(r.parked_traces == 0 for r in learned),
        ),
        Target(
            name="learner prompt tokens served from the server's cache",
            target=">= 50%",
            measured=f"{cached / tokens_in:.0%}" if tokens_in else "n/a",
            met=bool(tokens_in) and cached / tokens_in >= 0.5,
        ),
        Target(
            name="the whole run, every arm learned and evaluated",
            target=f"<= {RUN_MINUTES} min",
            measured=_run_time(wall_s, tokens_out, capacity) if wall_s else "not recorded",
            met=0 < wall_s <= RUN_MINUTES * 60,
        ),
    ]
    if combee_vs_naive is not None:
        targets.append(
            Target(
                name="combee at least as accurate as naive (same batch size)",
                target="difference >= 0",
                measured=f"{combee_vs_naive.difference:+.1%} ({combee_vs_naive.ci95[0]:+.1%} to "
                f"{combee_vs_naive.ci95[1]:+.1%}, McNemar p = {combee_vs_naive.mcnemar_p:.2g})",
                met=combee_vs_naive.difference >= 0,
            )
        )
    return targets


def _notes(s: QualitySettings, capacity: Capacity, gate: GateConfig) -> list[str]:
    sequential = (
        f" sequential learns from the first {s.sequential_n} traces only." if s.sequential_n else ""
    )
    endpoints = "; ".join(f"{role}: {where}" for role, where in s.endpoints.items())
    return [
        f"Training stream: {s.train_n} tasks of {s.train!r}, answered once by the example agent "
        "with the base prompt (an empty playbook, the same system framing as every arm); every "
        "run is a trace with the environment's feedback (right or wrong, the reference answer, "
        "the kind of miss when it is one, and the task set's worked solution).",
        f"Held-out: {s.held_out_n} tasks of {s.held_out!r}, none of them in the training stream; "
        "each prompt answers every one of them once (temperature 0).",
        f"Learning: offline `learn` (the engine's key pipeline, synchronous windows), batch size "
        f"{s.batch_size} for naive and combee, 1 for sequential;{sequential} "
        + {"union": "union combine", "llm": "combine by one combiner call per window"}.get(
            s.combine, s.combine
        )
        + "; "
        "bullet review on; successes reflected: "
        + {
            "all": "all (ACE)",
            "cited": "only those citing bullets (the rest learned without a call)",
            "none": "none",
        }.get(s.reflect_successes, s.reflect_successes)
        + (
            f"; bullets giving the same advice merged (MiniLM cosine {s.merge_similar:g})"
            if s.merge_similar
            else ""
        )
        + f"; shuffle seed {s.seed}; "
        + (
            f"replay gate on ({gate.holdout_fraction:.0%} of the stream held out by hash; "
            f"reviews from {gate.min_samples} tasks scored by the {gate.scorer} rule, margin "
            f"{gate.margin:g}"
            + (
                ", and no candidate answering fewer of them than its parent)."
                if gate.no_worse
                else ")."
            )
            if s.gate
            else "replay gate off."
        )
        + (
            f" Lesson check on: each new bullet retried on up to {gate.lesson_tasks} of the "
            "failed training tasks it was learned from, left out when it fixed none."
            if s.check_lessons
            else ""
        )
        + (
            " Worked examples on: each new bullet learned from a failed training trace ends "
            "with that trace's worked example (learning.worked_examples), kept when the "
            "agent's calculator scores its calculation right (re-asked once)."
            if s.worked_examples
            else ""
        ),
        f"Endpoints: {endpoints}." if endpoints else "",
        f"Endpoint capacity: {capacity.single_tokens_per_s:.1f} output tokens/s for one request, "
        f"{capacity.parallel_tokens_per_s:.1f} with {capacity.parallel} at once; capacity share = "
        "the learner's output tokens / (its wall time x the parallel capacity); cache share = "
        "prompt tokens the server reported served from its prompt cache / chat prompt tokens sent "
        "(every role's but the embedding inputs: the embedder has no prompt cache).",
        "Accuracy intervals are 95% Wilson; paired differences use Newcombe's method 10 and the "
        "exact McNemar test on the tasks one prompt got right and the other wrong.",
    ]


UNRECORDED = "an unrecorded earlier one"


def _sessions_note(rows: list[PromptRow]) -> str:
    """A warning when an arm and the base were not evaluated by one invocation alone: their
    paired interval then carries the server's drift between sessions (``_Phases.eval_runs``),
    which it assumes away."""
    base = rows[0].evaluated_by
    apart = [r.prompt for r in rows[1:] if UNRECORDED in {*base, *r.evaluated_by}
             or len({*base, *r.evaluated_by}) > 1]  # fmt: skip
    if not apart:
        return ""
    when = "; ".join(f"{r.prompt} by {', '.join(r.evaluated_by)}" for r in rows)
    return (
        f"Evaluated in different invocations ({when}): the paired intervals of "
        f"{', '.join(apart)} against base assume one answer per task and prompt, but two "
        "evaluations of one prompt by this server differ on some answers (6 of 24 within one "
        "server session, 15 of 100 a day apart, measured 2026-12-06), so those intervals "
        "understate the uncertainty: evaluate the arms in one invocation (a fresh work folder "
        "with the training traces copied in) to pair them."
    )


def _per_arm(title: str, by_arm: dict[str, dict[str, Any]]) -> str:
    """One preamble line: ``title: arm: name value, ...; arm: ...``."""
    arms = "; ".join(
        f"{arm}: " + ", ".join(f"{name} {value}" for name, value in values.items())
        for arm, values in by_arm.items()
    )
    return f"{title}: {arms}."


def _not_served(rows: Sequence[PromptRow]) -> str:
    """Each arm's proposals the learner did not serve, with why and (the start of) their text:
    what the learner left out is the first thing to read when an arm misses a lesson."""
    parts = []
    for r in rows:
        if r.not_served:
            lines = [
                f"- v{n.version}, {n.by}: {shorten(n.content, _SHOWN_CHARS)}" for n in r.not_served
            ]
            parts.append(f"{r.prompt}:\n\n" + "\n".join(lines))
    if not parts:
        return ""
    return "\n\nProposals not served (by the gate's blame or the review's reason):\n\n" + (
        "\n\n".join(parts)
    )


_SHOWN_CHARS: Final = 200


def markdown(report: QualityReport) -> str:
    rows = []
    for r in report.results:
        vs = r.vs_base
        rows.append(
            [
                r.prompt,
                f"{r.accuracy:.1%}",
                f"{r.ci95[0]:.1%}-{r.ci95[1]:.1%}",
                f"+{vs.only_b} / -{vs.only_a}" if vs else "–",
                f"{vs.difference:+.1%} ({vs.ci95[0]:+.1%} to {vs.ci95[1]:+.1%})" if vs else "–",
                f"{vs.mcnemar_p:.2g}" if vs else "–",
                r.bullets,
                f"{r.near_duplicates} ({r.near_duplicate_share:.0%})"
                if r.prompt != "base"
                else "–",
                r.learn_calls,
                f"{r.learn_tokens_in:,} / {r.learn_tokens_out:,}",
                f"{r.cache_share:.0%}" if r.prompt != "base" else "–",
                f"{r.truncated_replies} / {r.parked_traces}" if r.prompt != "base" else "–",
                (f"{r.gate_refused}" + (f" ({r.left_out} bullets left out)" if r.left_out else ""))
                if r.prompt != "base"
                else "–",
                f"{r.learn_wall_s / 60:.1f}" if r.prompt != "base" else "–",
                f"{r.eval_wall_s / 60:.1f}",
                f"{r.capacity_share:.0%}" if r.prompt != "base" else "–",
            ]
        )
    body = table(
        [
            "prompt",
            "accuracy",
            "95% CI",
            "gained / lost vs base",
            "paired difference (95% CI)",
            "McNemar p",
            "bullets",
            "near-duplicates",
            "learn LLM calls",
            "learn tokens in / out",
            "cached in",
            "cut replies / parked traces",
            "windows refused",
            "learn min",
            "eval min",
            "capacity used",
        ],
        rows,
    )
    families = sorted({f for r in report.results for f in r.by_family})
    by_family = table(
        ["family", *[r.prompt for r in report.results]],
        [
            [
                f,
                *[
                    f"{r.by_family.get(f, [0, 0])[0]}/{r.by_family.get(f, [0, 0])[1]}"
                    for r in report.results
                ],
            ]
            for f in families
        ],
    )
    s = report.settings
    preamble = [
        f"Model: {s.model} (llama.cpp llama-server, {report.capacity.parallel} slots, "
        "2 CPU cores).",
        f"Base agent on the training stream: {report.train_accuracy:.1%} correct "
        f"({report.train_wall_s / 60:.1f} min).",
    ]
    if report.wall_s:
        preamble.append(
            f"Whole run: {_run_time(report.wall_s, report.tokens_out, report.capacity)}; "
            "capacity measurement to report, over every invocation that did some work."
        )
    preamble += [
        f"{r.prompt} gave the agent the {r.answers_of} prompt's very text"
        + (" (it served no bullet)" if r.answers_of == "base" else "")
        + f": its answers are the {r.answers_of} prompt's, not asked again."
        for r in report.results
        if r.answers_of
    ]
    cache = {
        r.prompt: {role: f"{share:.0%}" for role, share in r.cache_by_role.items()}
        for r in report.results
        if r.cache_by_role
    }
    if cache:
        preamble.append(_per_arm("Prompt tokens served from the server's cache, by role", cache))
    skipped = {r.prompt: r.skipped for r in report.results if r.skipped}
    if skipped:
        preamble.append(
            _per_arm(
                "Proposals the learner refused, and lessons a bullet already stated"
                " (covered_lesson, not shown to the curators), by reason",
                skipped,
            )
        )
    return document(
        "Quality: held-out accuracy of the agent, base prompt vs learned playbooks",
        preamble,
        body + "\n\nCorrect per task family:\n\n" + by_family + _not_served(report.results),
        report.targets,
        [note for note in report.notes if note],
        llm=f"Real model: {s.model}. Nothing in this table is simulated.",
    )


__all__ = [
    "DEFAULT_STRATEGIES",
    "NEAR_DUPLICATE_COSINE",
    "ROLES",
    "STRATEGIES",
    "Capacity",
    "PromptRow",
    "QualityReport",
    "QualitySettings",
    "markdown",
    "measure_capacity",
    "near_duplicate_bullets",
    "run_quality",
    "scored_as_tasks",
    "training_traces",
]
