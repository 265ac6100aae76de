"""Worked examples (``learning.worked_examples``): a new bullet learned from a failed trace
ends with the calculation the agent should have written there, beside the one it wrote.

A small agent copies an example's shape far more than it follows a rule (the real-model runs
of docs/benchmarks/quality-runs.md: with "Example: write round(0.75 / (0.15 - 0.06), 2), not
P_0 = 0.75 / (0.15 - 0.06)" in its playbook a 1.5B agent wrapped 94 to 99 of 100 held-out
answers in ``round(...)``, against 9 with the base prompt). So each ADD a curator proposes is
shown to the exemplifier (a call to the curator's endpoint) with the failed trace of its group
that shares most words with it, and the reply joins the rule after ``EXAMPLE_MARK``. With an
example check (the gate's own agent's calculator and scorer, given by the wiring), the
calculation must be right for its task, or the exemplifier is re-asked once with what it gives;
an example that is still wrong, cut, or refused by the review's text checks is left off, and
the rule goes on alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import msgspec

from combee_stream.core.calls import CurationContext
from combee_stream.core.hygiene import (
    EXAMPLE_MARK,
    NO_LESSON,
    content_words,
    text_problem,
)
from combee_stream.core.outputs import ExampleCheck, WorkedExample, is_calculation
from combee_stream.core.playbook import has_formula, normalize
from combee_stream.core.prompts import (
    ReflectionRecord,
    exemplifier_messages,
    exemplifier_retry,
)
from combee_stream.core.results import WindowStats
from combee_stream.llm import LLMCallError
from combee_stream.logs import get_logger
from combee_stream.schemas import AddOp, HeldOutTask, Operation

log = get_logger(__name__)


class Exemplifier:
    """``await exemplifier.exemplified(operations, group, stats)``: a curator's operations with
    a worked example on each ADD that earns one."""

    def __init__(self, context: CurationContext, *, check: ExampleCheck | None = None) -> None:
        self._context = context
        self._check = check

    async def exemplified(
        self, operations: list[Operation], group: Sequence[ReflectionRecord], stats: WindowStats
    ) -> tuple[list[Operation], dict[str, str]]:
        """The curator's ADDs, each with a worked example from the failed trace of its group
        that shares most words with it, and, per normalised new content, the trace id its
        example came from. An ADD keeps its rule alone when the group has no failed trace with
        a reference answer, when the call fails, or when the example is empty, cut by the
        reply's length bound, longer than ``max_bullet_chars`` allows, or breaks the content
        policy, carries playbook markup or forwards what a trace only quoted (its task is
        untrusted text): the review would refuse the bullet whole. With the check, also when
        its calculation is still wrong for its task after one re-ask that says what it gives
        (``stats.wrong_examples``); a calculation the check rounds as its task asks is shown
        rounded, and a reply of results alone gives way to the agent's own calculation when
        that is right once rounded (:func:`own_example`)."""
        failures = [rec for rec in group if rec.trace]
        out = list(operations)
        shown: dict[str, str] = {}
        if not failures:
            return out, shown
        quoted = [span for rec in group for span in rec.quoted]

        async def one(i: int, op: AddOp) -> None:
            words = set(content_words(op.content))
            record = max(failures, key=lambda rec: len(words & set(content_words(rec.task))))
            reply = await self._checked_reply(op.content, record, stats)
            if reply is None:
                return
            content = self._bullet(op.content, reply, quoted)
            if content is None:
                return
            out[i] = msgspec.structs.replace(op, content=content)
            shown[normalize(content)] = record.reflection.source.trace_id
            stats.examples += 1

        async with anyio.create_task_group() as tg:
            for i, op in enumerate(operations):
                if isinstance(op, AddOp):
                    tg.start_soon(one, i, op)
        return out, shown

    async def _checked_reply(
        self, rule: str, record: ReflectionRecord, stats: WindowStats
    ) -> WorkedExample | None:
        """The exemplifier's example of ``rule`` on ``record``'s trace, checked (re-asked once)
        when there is a check and the trace has a task to check it on; None when the call
        fails or the example is still wrong."""
        messages = exemplifier_messages(self._context.prompts, rule, record)
        task = record.retry
        # Checked before the text checks: "write X, not X" is most often the agent's own
        # calculation, right but unrounded, and told what it gives the exemplifier rounds.
        for asked in range(2):
            try:
                reply = await self._context.calls("exemplifier", messages, WorkedExample, stats)
            except LLMCallError as exc:
                log.warning("worked example failed", error=str(exc))
                return None
            if self._check is None or task is None:
                return reply
            own = own_example(reply, record, task, self._check)
            if own is not None:
                return own
            checked = self._check(reply.calculations()[0], task)
            if checked.problem is None:
                return msgspec.structs.replace(reply, right=checked.calculation)
            if asked:
                stats.wrong_examples += 1
                return None
            messages = exemplifier_retry(messages, reply, checked.problem)
        return None

    def _bullet(self, rule: str, reply: WorkedExample, quoted: Sequence[str]) -> str | None:
        """The bullet with ``reply``'s example, or None when a text check refuses it."""
        right, wrong = reply.calculations()
        content = f"{rule.rstrip()}{EXAMPLE_MARK}{reply.text()}"
        # A field the grammar's bound stopped was cut mid-calculation.
        cut = (
            self._context.bound
            and max(len(reply.right), len(reply.wrong)) >= self._context.bound - 2
        )
        if (
            cut
            or normalize(right) in NO_LESSON
            or not wrong
            # "write X, not X": on ACE's Formula rows the agent's calculation was often right
            # and its answer wrong for another reason (unrounded, a unit), and a 1.5B
            # exemplifier then gives the same calculation twice.
            or right.replace(" ", "") == wrong.replace(" ", "")
            # The agent's mistake was a calculation: a bare result shows nothing of it.
            or (has_formula(wrong) and not has_formula(right))
            # The review's own text checks (length, policy, markup, quoted spans): they would
            # refuse the whole bullet, and the rule alone may still pass.
            or text_problem(
                content, self._context.learning.max_bullet_chars, self._context.policy, quoted
            )
        ):
            return None
        return content


def own_example(
    reply: WorkedExample, record: ReflectionRecord, task: HeldOutTask, check: ExampleCheck
) -> WorkedExample | None:
    """The agent's own calculation, rounded as its task asks, as the example, when the
    exemplifier answered with a result and the agent's calculation was right but unrounded.
    Shown "(300000/500000) * 0.04 + (200000/500000) * 0.035 * (1 - 0.26)" (a WACC row of ACE,
    right to 0.03436 where 0.03 was asked), a real 1.5B exemplifier wrote "write 0.03, not
    0.03436" (the twenty-fourth run, docs/benchmarks/quality_24.md): served, that example had
    the agent round 56 of 100 held-out answers, where the runs whose example showed
    ``round(<calculation>, 2)`` had it round 94 to 99. What it should have shown is what the
    check builds from the agent's calculation; an agent right without rounding failed for some
    other reason, and then nothing is built."""
    if is_calculation(reply.calculations()[0]) or not is_calculation(record.calculation):
        return None
    checked = check(record.calculation, task)
    if checked.problem is not None or checked.calculation == record.calculation:
        return None
    return WorkedExample(wrong=record.calculation, right=checked.calculation)


__all__ = ["Exemplifier", "own_example"]
