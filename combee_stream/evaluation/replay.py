"""The replay gate: a candidate is published only if it answers the key's held-out tasks no
worse than the version it extends.

Each task (:mod:`combee_stream.core.holdout`) is answered under both prompts by an
:class:`Evaluator`: the engine's own single-call agent (:class:`AgentEvaluator`, the ``agent``
LLM role, scored against the trace's ground truth), or the user's (``gate.evaluator =
"module:function"``, an async callable taking the rendered prompt and a
:class:`~combee_stream.schemas.HeldOutTask` and returning a score in [0, 1], or a
:class:`Score` with the bullets the agent cited), in the manner of
GEPA's adapters: the gate does not need to know how the agent works.

The statistic (paired non-inferiority): with ``n`` tasks scored under both prompts, the
candidate is accepted when ``n >= gate.min_samples``, the one-sided lower confidence bound (at
``gate.confidence``) of the paired difference in mean score (candidate - current) is above
``-gate.margin``, and (``gate.no_worse``, on by default) its mean score is not below the
current version's: the bound forgives a loss a small sample cannot tell from noise, but a
version that did measurably worse on the tasks it was checked on is not served. (A real model
served with parallel slots is not deterministic even at temperature 0: the same prompt answered
a Formula row differently on about one task in twelve, so a candidate that changes nothing is
refused now and then; its lessons are then lost, which costs learning speed, not safety.) With
fewer than ``min_samples`` tasks the gate defers (see
:class:`~combee_stream.core.gate.Verdict`). For 0/1 scores the bound is Agresti and Min's
(2005) adjusted Wald interval for paired proportions: half a task added to each cell of the 2x2
table, so that with ``b`` tasks lost and ``c`` gained, d = (c - b) / (n + 2) and var = (b + c +
1 - (c - b)^2 / (n + 2)) / (n + 2)^2. It uses the pairing (only discordant tasks count), and,
unlike the plain Wald bound, it is not certain of anything with no discordant task: two prompts
that agree on all n tasks have a bound of -z / (n + 2), so a margin of 0.1 needs about 15 tasks
to accept a candidate that changes nothing, and one that loses one task of twenty is refused.
(Newcombe's interval, what ``combee-stream eval`` reports, was tried first: its correlation is
undefined when both prompts fail every task, as a new key's empty parent does, and it refused
every early candidate; the plain Wald bound refused a candidate that gained one task of eight
and accepted one that gained none.) For other scores it is the normal bound of the mean paired
difference.

The current version's answers are the same requests every time the key is reviewed, so the
LLM client's completion memo answers them after the first review: a review costs about one
agent call per task.
"""

from __future__ import annotations

import importlib
import math
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import anyio
from msgspec import Struct

from combee_stream.config import GateConfig
from combee_stream.core.fencing import fence
from combee_stream.core.gate import Candidate, Verdict
from combee_stream.core.holdout import covers, review_tasks, with_regressions
from combee_stream.core.playbook import render
from combee_stream.errors import ConfigError
from combee_stream.evaluation.answerer import Answerer
from combee_stream.llm import LLMCallError, LLMClient
from combee_stream.schemas import GateReport, HeldOutTask
from combee_stream.tasks.base import SCORERS


class Score(Struct, frozen=True):
    """An evaluator's verdict on one task: the score, and the playbook bullets the agent says
    it used (what a refused candidate's blame is computed from)."""

    value: float
    cited: list[str] = []


Evaluator = Callable[[str, HeldOutTask], Awaitable[float | Score]]
NAME: Final = "replay"


JUDGE: Final = """\
Decide whether an answer to a task is correct, given the reference answer. The answer is \
correct when it states the same result as the reference (other wording, units written out, or \
rounding within the precision the reference shows are fine); it is wrong when it states another \
result, several conflicting ones, or none.

<task>
{task}
</task>

<reference>
{reference}
</reference>

<judged_answer>
{answer}
</judged_answer>

Answer with one JSON object: "reasoning" (briefly, why) and "correct" (true or false)."""


class JudgeOutput(Struct, forbid_unknown_fields=False):
    reasoning: str
    correct: bool


class AgentEvaluator:
    """The engine's own agent: one structured call per task through the ``agent`` role,
    scored 1 or 0 against the task's ground truth by a string rule, or by the ``judge`` role
    (``gate.scorer = "judge"``: one more call per answer)."""

    def __init__(self, llm: LLMClient, scorer: str) -> None:
        self._llm = llm
        self._answerer = Answerer(llm)
        self._score = SCORERS.get(scorer)  # None: the judge

    async def __call__(self, prompt: str, task: HeldOutTask) -> Score:
        answer = await self._answerer.answer(prompt, task.task)
        if self._score is not None:
            right = self._score(answer.output, task.answer)
        else:
            right = await self.judge(task, answer.output)
        return Score(1.0 if right else 0.0, answer.bullet_ids)

    async def judge(self, task: HeldOutTask, answer: str) -> bool:
        text = JUDGE.format(
            task=fence(task.task), reference=fence(task.answer), answer=fence(answer)
        )
        completion = await self._llm.complete(
            "judge", [{"role": "user", "content": text}], JudgeOutput
        )
        return completion.value.correct


def load_evaluator(spec: str) -> Evaluator:
    """``module:function`` -> the async callable it names."""
    module_name, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"gate.evaluator: cannot load {spec!r}: {exc}") from None
    if not callable(found):
        raise ConfigError(f"gate.evaluator: {spec!r} is not callable")
    return found  # type: ignore[no-any-return]


def evaluator_from_config(config: GateConfig, llm: LLMClient) -> Evaluator:
    """The evaluator ``gate.evaluator`` names: the engine's agent, or the user's callable."""
    if config.evaluator == "agent":
        llm.require("agent")
        if config.scorer == "judge":
            llm.require("judge")
        return AgentEvaluator(llm, config.scorer)
    return load_evaluator(config.evaluator)


def lower_bound(current: Sequence[float], candidate: Sequence[float], confidence: float) -> float:
    """One-sided lower confidence bound of mean(candidate) - mean(current), paired."""
    n = len(current)
    if n == 0:
        return -1.0
    z = statistics.NormalDist().inv_cdf(confidence)
    if all(s in (0.0, 1.0) for s in [*current, *candidate]):
        lost = sum(1 for a, b in zip(current, candidate, strict=True) if a > b)
        gained = sum(1 for a, b in zip(current, candidate, strict=True) if b > a)
        m = n + 2  # Agresti-Min: 0.5 added to each of the four cells
        d = (gained - lost) / m
        var = (lost + gained + 1 - (gained - lost) ** 2 / m) / m**2
        return d - z * math.sqrt(max(0.0, var))
    diffs = [b - a for a, b in zip(current, candidate, strict=True)]
    mean = sum(diffs) / n
    sd = statistics.stdev(diffs) if n > 1 else 0.0
    return mean - z * sd / math.sqrt(n)


class ReplayGate:
    """:class:`~combee_stream.core.gate.PublishGate` that replays held-out tasks."""

    name = NAME

    def __init__(self, config: GateConfig, evaluate: Evaluator) -> None:
        self._config = config
        self._evaluate = evaluate

    @classmethod
    def from_config(cls, config: GateConfig, llm: LLMClient) -> ReplayGate:
        return cls(config, evaluator_from_config(config, llm))

    async def review(self, candidate: Candidate) -> Verdict:
        if not covers(self._config, candidate.key):
            return Verdict(accepted=True)
        tasks = review_tasks(candidate.holdout)
        cfg = self._config
        if len(tasks) < cfg.min_samples:
            # Too few tasks to judge: nothing unverified is published, and nothing is thrown
            # away either (a new key's first windows would otherwise lose their lessons).
            return Verdict(
                accepted=False,
                deferred=True,
                reason=f"{len(tasks)} held-out task(s), fewer than gate.min_samples = "
                f"{cfg.min_samples}: the window's lessons wait for the next review",
            )
        before, after = render(candidate.parent), render(candidate.playbook)
        scores: dict[tuple[int, int], Score] = {}
        limiter = anyio.CapacityLimiter(cfg.concurrency)

        async def score(index: int, which: int, prompt: str) -> None:
            async with limiter:
                found = await self._evaluate(prompt, tasks[index])
            if not isinstance(found, Score):
                found = Score(float(found))
            scores[index, which] = Score(min(1.0, max(0.0, found.value)), found.cited)

        failure: list[BaseException] = []
        try:
            async with anyio.create_task_group() as tg:
                for index in range(len(tasks)):
                    tg.start_soon(score, index, 0, before)
                    tg.start_soon(score, index, 1, after)
        except* LLMCallError as group:
            failure.extend(group.exceptions)
        if failure:
            # The gate cannot judge: refused like a failed test (the agent endpoint's outage
            # is the LLM client's to report).
            return Verdict(accepted=False, reason=f"evaluation failed: {failure[0]}")
        current = [scores[i, 0].value for i in range(len(tasks))]
        new = [scores[i, 1].value for i in range(len(tasks))]
        lower = lower_bound(current, new, cfg.confidence)
        # The bound forgives what a small sample cannot tell from noise; a measured loss is
        # not forgiven (gate.no_worse): agents are never served a version that did worse on
        # the very tasks it was checked on.
        worse = sum(new) < sum(current)
        accepted = lower > -cfg.margin and not (cfg.no_worse and worse)
        broke = [t.trace_id for t, a, b in zip(tasks, current, new, strict=True) if b < a]
        n = len(tasks)
        report = GateReport(
            gate=NAME,
            accepted=accepted,
            n=n,
            current=round(sum(current) / n, 4),
            candidate=round(sum(new) / n, 4),
            lower=round(lower, 4),
            broke=broke,
        )
        why = (
            f"lower bound {lower:+.3f} <= -{cfg.margin:g}"
            if lower <= -cfg.margin
            else "fewer right than the version it extends (gate.no_worse)"
        )
        reason = (
            ""
            if accepted
            else f"worse on held-out tasks: accuracy {report.candidate:.3f} vs "
            f"{report.current:.3f} (n={n}), {why}; broke {len(broke)} task(s)"
        )
        holdout = candidate.holdout
        if not accepted and holdout is not None and cfg.regression_size:
            holdout = with_regressions(holdout, broke, cfg.regression_size)
        # Credit assignment: the candidate's new bullets that the agent relied on and failed
        # with. A bullet is blamed when the candidate's accuracy on the tasks that cite it is
        # below one half and below its accuracy on the whole sample: the agent does worse
        # where it relies on the bullet than elsewhere (a wrong rule, or one that does not do
        # what it claims for its tasks). Comparing with the parent task by task cannot see a
        # bad new rule for tasks the parent fails too; this can. One half alone is not the
        # bar: with a small model right on fewer than half the tasks, a general rule ("round
        # to the decimals asked") cited everywhere is right exactly as often as the agent, and
        # that bar pruned all four rules of a real 1.5B window whose candidate scored as its
        # parent did (0.4 and 0.4), on tasks it broke none of.
        # A bullet is also blamed when it broke more of the tasks the parent answered right
        # than it kept right: those tasks' ground truth is corroborated by the parent, while
        # a "fixed" task's may be a producer's (held-out traces carrying forged answers make a
        # poisoned rule look right on them, and counting those let a poisoned bullet through).
        # The learner tries the candidate once more without them.
        old = {b.id for s in candidate.parent.sections for b in s.bullets}
        bar = min(0.5, sum(new) / n)
        wrong: Counter[str] = Counter()
        right: Counter[str] = Counter()
        broken: Counter[str] = Counter()
        kept: Counter[str] = Counter()
        for i, (a, c) in enumerate(zip(current, new, strict=True)):
            cited = [b for b in dict.fromkeys(scores[i, 1].cited) if b not in old]
            (right if c >= 1.0 else wrong).update(cited)
            if a >= 1.0:
                (kept if c >= 1.0 else broken).update(cited)
        # (a broken task is a wrong one: every bullet in broken is in wrong)
        blame = [b for b in wrong if right[b] < bar * (right[b] + wrong[b]) or broken[b] > kept[b]]
        return Verdict(
            accepted=accepted, reason=reason, report=report, holdout=holdout, blame=blame
        )


__all__ = [
    "NAME",
    "AgentEvaluator",
    "Evaluator",
    "ReplayGate",
    "Score",
    "evaluator_from_config",
    "load_evaluator",
    "lower_bound",
]
