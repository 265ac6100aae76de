"""Running the example agent over a task set with one prompt, and comparing two prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
from msgspec import Struct

from combee_stream.evaluation.answerer import Answerer
from combee_stream.evaluation.stats import Paired, paired, wilson
from combee_stream.llm import LLMCallError
from combee_stream.tasks.base import Task, is_correct


class TaskOutcome(Struct, frozen=True, kw_only=True):
    task_id: str
    family: str
    correct: bool
    output: str
    expected: str
    bullet_ids: list[str] = []
    expression: str = ""
    error: str = ""  # the agent's call failed for good (counted as wrong)
    tokens_out: int = 0  # the agent's output tokens for this answer (0: answers saved before)


class EvalResult(Struct, kw_only=True):
    label: str  # which prompt
    n: int
    correct: int
    accuracy: float
    ci95: tuple[float, float]
    by_family: dict[str, list[int]]  # family -> [correct, n]
    outcomes: list[TaskOutcome]
    wall_s: float
    tokens_in: int = 0
    tokens_out: int = 0
    errors: int = 0


async def evaluate(
    answerer: Answerer,
    system_prompt: str,
    tasks: Sequence[Task],
    *,
    label: str,
    concurrency: int = 4,
    done: Sequence[TaskOutcome] = (),
    on_outcome: Callable[[TaskOutcome], None] | None = None,
) -> EvalResult:
    """Every task answered once with ``system_prompt``, ``concurrency`` at a time. ``done``:
    outcomes of an earlier, interrupted run of the same prompt (their tasks are not asked
    again); ``on_outcome(outcome)`` is called as each answer is scored, so a
    caller can persist it at once."""
    started = anyio.current_time()
    earlier = {o.task_id: o for o in done}
    outcomes: list[TaskOutcome | None] = [earlier.get(t.id) for t in tasks]
    tokens = [0, 0]
    limiter = anyio.CapacityLimiter(concurrency)

    def finish(index: int, outcome: TaskOutcome) -> None:
        outcomes[index] = outcome
        if on_outcome is not None:
            on_outcome(outcome)

    async def one(index: int, task: Task) -> None:
        async with limiter:
            try:
                answer = await answerer.answer(system_prompt, task.question)
            except LLMCallError as exc:
                failed = TaskOutcome(
                    task_id=task.id, family=task.family, correct=False, output="",
                    expected=task.answer, error=str(exc),
                )  # fmt: skip
                finish(index, failed)
                return
        tokens[0] += answer.tokens_in
        tokens[1] += answer.tokens_out
        outcome = TaskOutcome(
            task_id=task.id,
            family=task.family,
            correct=is_correct(task, answer.output),
            output=answer.output,
            expected=task.answer,
            bullet_ids=answer.bullet_ids,
            expression=answer.expression,
            tokens_out=answer.tokens_out,
        )
        finish(index, outcome)

    async with anyio.create_task_group() as tg:
        for index, task in enumerate(tasks):
            if outcomes[index] is None:
                tg.start_soon(one, index, task)
    answered = [o for o in outcomes if o is not None]
    by_family: dict[str, list[int]] = {}
    for outcome in answered:
        tally = by_family.setdefault(outcome.family, [0, 0])
        tally[0] += int(outcome.correct)
        tally[1] += 1
    correct = sum(o.correct for o in answered)
    return EvalResult(
        label=label,
        n=len(answered),
        correct=correct,
        accuracy=correct / len(answered) if answered else 0.0,
        ci95=wilson(correct, len(answered)),
        by_family=dict(sorted(by_family.items())),
        outcomes=answered,
        wall_s=anyio.current_time() - started,
        tokens_in=tokens[0],
        tokens_out=tokens[1],
        errors=sum(1 for o in answered if o.error),
    )


def compare(a: EvalResult, b: EvalResult) -> Paired:
    """B against A, task by task (the same tasks, matched by id)."""
    right_a = {o.task_id: o.correct for o in a.outcomes}
    common = [o for o in b.outcomes if o.task_id in right_a]
    return paired([right_a[o.task_id] for o in common], [o.correct for o in common])


__all__ = ["EvalResult", "TaskOutcome", "compare", "evaluate"]
