"""The lesson check: a new bullet is kept only if it fixes a failure it was learned from.

Each new bullet of a candidate is tried alone (the parent's playbook plus that bullet) on up to
``gate.lesson_tasks`` of the tasks its curator group learned from whose traces may have failed
and carry a reference answer, those that share most words with the bullet first; the tasks the
parent itself still answers wrong are the test. A bullet that fixes none of them is blamed, and
the learner's blame-prune reviews the candidate without it. A bullet with no such task to try
(lessons from traces without a reference answer, an earlier window's waiting lesson, a merged
bullet whose text is new) is not judged and stays. When several new bullets each fixed a
failure alone, they are then joined one at a time, most fixes first (on a tie, one with a
worked example before a rule alone), on all the window's failures the parent still fails: a
bullet that adds no fix beside those kept before it is blamed too (a small agent can follow
each of two rules alone and neither beside the other).

Why (a choice the paper leaves open): ACE and Combee keep whatever the curator writes, and a
real 1.5B curator writes rules that sound right and change nothing: "use the correct formula
with decimal fractions instead of percentages" without the formula, a rounding rule that
contradicts the task's decimals, a formula the reflector invented (docs/demo-runs.md). Such a
bullet then also hides the lesson that would have worked: the next windows' lessons are judged
already stated by it and never reach a curator. GEPA accepts a candidate prompt only if it does
better on the minibatch it was proposed from; this is that test, per bullet, on the window's
own failures: cheap (the parent's answers are one request per task, shared by all bullets and
memoised by the LLM client) and about the bullet's own claim. It is a filter, not a measure:
one fixed task of four can be the agent's nondeterminism (about one answer in twelve changes
between two identical requests on a parallel-slot server), so it keeps some bullets that fix
nothing; whether a version helps is the replay gate's question, on held-out tasks.

Measured with a small agent, it filters little: in a window of a real Qwen2.5-Coder-1.5B run
(2026-12-06, docs/benchmarks/quality-runs.md, the fourteenth run), each of 6 new bullets, tried
on all 7 failures the parent answered wrong, "fixed" 2 to 4 of them, a wrong DDM formula 4 and
an unrelated placebo bullet ("When a question gives a number in words, write it in digits.")
1; one task was fixed by all seven prompts. An agent that moves that much with any change of
its prompt cannot show which rule fixed what on a handful of tasks, so it is off by default;
it is for agents whose answers a prompt change does not move by chance (a larger model, tools
that decide the answer), or tasks the agent misses every time by one convention: the real-model
demo's, where it is on (``demo/live.py`` has what it did there).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final

import anyio

from combee_stream.config import GateConfig
from combee_stream.core.commit import without
from combee_stream.core.gate import Candidate, Verdict
from combee_stream.core.holdout import gated
from combee_stream.core.hygiene import EXAMPLE_MARK, content_words
from combee_stream.core.playbook import find_bullet, normalize, render
from combee_stream.evaluation.replay import Evaluator, Score, evaluator_from_config
from combee_stream.llm import LLMCallError, LLMClient
from combee_stream.logs import get_logger
from combee_stream.schemas import GateReport, HeldOutTask

NAME: Final = "lessons"
log = get_logger(__name__)


def relevant(content: str, tasks: Sequence[HeldOutTask], limit: int) -> list[HeldOutTask]:
    """The ``limit`` tasks sharing most content words with a bullet (in their order on ties)."""
    words = set(content_words(content))
    ranked = sorted(
        enumerate(tasks), key=lambda it: (-len(words & set(content_words(it[1].task))), it[0])
    )
    return [task for _, task in ranked[:limit]]


class LessonGate:
    """:class:`~combee_stream.core.gate.PublishGate` that retries each new bullet on the
    failures it was learned from (see the module's docstring)."""

    name = NAME

    def __init__(self, config: GateConfig, evaluate: Evaluator) -> None:
        self._config = config
        self._evaluate = evaluate

    @classmethod
    def from_config(cls, config: GateConfig, llm: LLMClient) -> LessonGate:
        return cls(config, evaluator_from_config(config, llm))

    async def review(self, candidate: Candidate) -> Verdict:
        if not gated(self._config, candidate.key):
            return Verdict(accepted=True)
        old = {b.id for s in candidate.parent.sections for b in s.bullets}
        new = [b.id for s in candidate.playbook.sections for b in s.bullets if b.id not in old]
        # As for held-out tasks, a task too long to answer cheaply is not retried.
        limit = self._config.max_task_chars
        retries = {
            t.trace_id: t
            for t in candidate.retries
            if len(t.task) <= limit and len(t.answer) <= limit
        }
        plan: dict[str, list[HeldOutTask]] = {}
        for bullet_id in new:
            bullet = find_bullet(candidate.playbook, bullet_id)
            assert bullet is not None
            sources = candidate.add_traces.get(normalize(bullet.content), [])
            tasks = [retries[i] for i in dict.fromkeys(sources) if i in retries]
            if tasks:
                plan[bullet_id] = relevant(bullet.content, tasks, self._config.lesson_tasks)
        if not plan:
            return Verdict(accepted=True)
        parent = render(candidate.parent)
        prompts = {b: render(without(candidate.playbook, set(new) - {b})) for b in plan}
        limiter = anyio.CapacityLimiter(self._config.concurrency)
        after: dict[str, dict[str, float]] = {}  # bullet -> its score on each task tried

        async def score(prompt: str, task: HeldOutTask) -> float:
            async with limiter:
                found = await self._evaluate(prompt, task)
            return found.value if isinstance(found, Score) else float(found)

        async def scores(prompt: str, tasks: Iterable[HeldOutTask]) -> dict[str, float]:
            """One prompt's score on each of ``tasks``, by trace id."""
            found: dict[str, float] = {}

            async def one(task: HeldOutTask) -> None:
                found[task.trace_id] = await score(prompt, task)

            async with anyio.create_task_group() as tg:
                for task in tasks:
                    tg.start_soon(one, task)
            return found

        async def under_bullet(bullet_id: str) -> None:
            tasks = [t for t in plan[bullet_id] if before[t.trace_id] < 1.0]
            after[bullet_id] = await scores(prompts[bullet_id], tasks)

        distinct = {t.trace_id: t for tasks in plan.values() for t in tasks}
        failure: list[BaseException] = []
        before: dict[str, float] = {}
        try:
            before = await scores(parent, distinct.values())
            async with anyio.create_task_group() as tg:
                for bullet_id in plan:
                    tg.start_soon(under_bullet, bullet_id)
        except* LLMCallError as group:
            failure.extend(group.exceptions)
        if failure:
            return Verdict(accepted=False, reason=f"lesson check failed: {failure[0]}")
        # Only the tasks the parent still fails test a bullet: one it answers right already
        # (the trace's failure was the agent's chance, or came under an older version) cannot
        # show a fix.
        tried = {b: [t for t in tasks if t.trace_id in after[b]] for b, tasks in plan.items()}
        fixed = {b: [t for t in tried[b] if after[b][t.trace_id] >= 1.0] for b in plan}
        blame = [b for b in plan if tried[b] and not fixed[b]]
        failing = [t for t in distinct.values() if before[t.trace_id] < 1.0]
        n = len(distinct)
        mended = len({t.trace_id for b in plan for t in fixed[b]})
        # Most fixes first; on a tie, a bullet with a worked example before a rule alone. The
        # example's calculation passed the agent's own calculator and scorer for its task (the
        # rule's text was checked by nothing), and a small agent copies an example's shape
        # where it ignores a rule. In the twenty-second real run (2026-12-07) a DDM rule
        # showing "round(0.75 / (0.15 - 0.06), 2)" and an APR rule saying "round to 2 decimal
        # places" each fixed 2 failures; the rule, first in the playbook, was kept, and the
        # example crowded out. Naive's learner kept the same example, and with it the agent
        # rounded 98 of 100 held-out answers.
        helped = sorted(
            (b for b in plan if fixed[b]),
            key=lambda b: (-len(fixed[b]), EXAMPLE_MARK not in _text(candidate, b)),
        )
        joined = helped
        if len(helped) > 1:
            try:
                joined, mended = await self._joined(candidate, set(new), helped, failing, scores)
            except* LLMCallError as group:
                failure.extend(group.exceptions)
            if failure:
                return Verdict(accepted=False, reason=f"lesson check failed: {failure[0]}")
        crowded = [b for b in helped if b not in joined]
        report = GateReport(
            gate=NAME,
            accepted=True,
            n=n,
            current=round((n - len(failing)) / n, 4),
            candidate=round((n - len(failing) + mended) / n, 4),
            # No interval: a filter of bullets, not a test of the version (the replay gate's).
            lower=0.0,
        )
        log.info(
            "lesson check",
            key=candidate.key,
            bullets=len(plan),
            tasks=n,
            parent_right=n - len(failing),
            fixed={b: len(fixed[b]) for b in plan},
            blamed=blame,
            crowded=crowded,
            # What was left out is in no version: the log is the one place an operator reads it.
            left_out={b: _text(candidate, b)[:200] for b in blame + crowded},
        )
        reasons = []
        if blame:
            reasons.append(
                f"{len(blame)} new bullet(s) fixed none of the failures they were learned from: "
                + ", ".join(f"{b} (0 of {len(tried[b])})" for b in blame)
            )
        if crowded:
            reasons.append(
                f"{len(crowded)} fixed failures alone but none more beside "
                + ", ".join(joined)
                + ": "
                + ", ".join(f"{b} ({len(fixed[b])} of {len(tried[b])} alone)" for b in crowded)
            )
        return Verdict(
            accepted=True, reason="; ".join(reasons), report=report, blame=blame + crowded
        )

    async def _joined(
        self,
        candidate: Candidate,
        new: set[str],
        order: Sequence[str],
        failing: Sequence[HeldOutTask],
        scores: Callable[[str, Sequence[HeldOutTask]], Awaitable[dict[str, float]]],
    ) -> tuple[list[str], int]:
        """The bullets that fixed failures alone, joined one at a time (most fixes first): a
        bullet stays only if the agent with it and those kept before it fixes more of the
        window's failures than without it; with how many the kept ones fix together.

        Why: a small agent can follow each of two rules alone and neither beside the other. In
        the real-model demo of 2026-12-06 (seed 656269), an operating-income bullet alone took
        9 of its 10 held-out tasks, a CAPM bullet alone 2 of 10, and the two together 0 of 20:
        beside the CAPM rule the agent scaled only one input of the subtraction by a million
        (``48.8 - (29.1 * 1,000,000)``). Each bullet had passed the check alone. One more
        answer per failure for each bullet joined (the first one's own tasks are asked again,
        answered from the LLM client's memo); bullets without tasks of their own, which the
        check does not judge, are left out of these prompts as of the single ones."""

        async def fixes(kept: Sequence[str]) -> int:
            prompt = render(without(candidate.playbook, new - set(kept)))
            return sum(value >= 1.0 for value in (await scores(prompt, failing)).values())

        kept = [order[0]]
        best = await fixes(kept)
        for bullet_id in order[1:]:
            together = await fixes([*kept, bullet_id])
            if together > best:
                kept, best = [*kept, bullet_id], together
        return kept, best


def _text(candidate: Candidate, bullet_id: str) -> str:
    bullet = find_bullet(candidate.playbook, bullet_id)
    return bullet.content if bullet is not None else ""


__all__ = ["NAME", "LessonGate", "relevant"]
