"""The worked-example check (``learning.worked_examples``): is an example's calculation right
for the task it came from, as the gate's own agent would be scored writing it?

The learner asks the exemplifier for the calculation the agent should have written, and the
agent copies an example's shape far more faithfully than it follows a rule. So an example that
is itself wrong teaches the mistake: in a real Qwen2.5-Coder-1.5B run (the eighteenth,
docs/benchmarks/quality_18.md) the one example the learner kept, "(500/(500+500))*7% + ...",
neither rounded as its task asked nor kept "%" out of the expression (the calculator reads it
as modulo), and 8 of the 15 held-out tasks the agent lost were right but unrounded. Here the
calculation goes through the same calculator and the same scorer as the replay gate's agent
(``gate.scorer``); the learner re-asks once with what it gives, then keeps the rule alone.

A calculation that is right once rounded to the places its question names ("2 decimal
places") is shown as ``round(<calculation>, places)``:
the exemplifier copies the reference solution's calculation, which does not round, and a
1.5B exemplifier told so wrote it unrounded again (the nineteenth run: the CAPM and WACC
examples, each re-asked). What the agent missed most was that rounding; the example then shows
it, "write round(0.01 + 1.5 * 0.03, 2), not 0.01 + 1.5 * 0.03".

Why only for the gate's own agent (``gate.evaluator = "agent"``): that agent and its
calculator are the only agent the engine can run; a user's evaluator (``module:function``)
answers with tools the engine does not know, and the judge scorer would make a check an LLM
call. Which scorer matters: ``numeric`` forgives 0.005, so 0.4923 passes for 0.49; ``formula``
(ACE's rule, which ``bench quality`` gives the gate on ACE's rows) does not.
"""

from __future__ import annotations

from combee_stream.config import GateConfig
from combee_stream.core.outputs import CheckedExample, ExampleCheck
from combee_stream.evaluation.answerer import calculate
from combee_stream.evaluation.calculator import CalculatorError
from combee_stream.schemas import HeldOutTask
from combee_stream.tasks.base import SCORERS, places_named


def example_check(config: GateConfig) -> ExampleCheck | None:
    """The check of the gate's own agent (its calculator, ``gate.scorer``); None when the gate
    scores with another evaluator or the judge."""
    score = SCORERS.get(config.scorer)
    if config.evaluator != "agent" or score is None:
        return None

    def check(calculation: str, task: HeldOutTask) -> CheckedExample:
        try:
            answer = calculate(calculation)
        except CalculatorError as exc:
            problem = f"the calculator cannot evaluate {calculation} ({exc})"
            return CheckedExample(
                calculation, f"{problem}, and the reference answer is {task.answer}"
            )
        if score(answer, task.answer):
            return CheckedExample(calculation)
        # Only to places the question names: rounded to the reference answer's own decimals,
        # 5.3 would pass for "5", and a wrong calculation would be shown as a right one.
        places = places_named(task.task)
        if places is not None:
            rounded = f"round({calculation}, {places})"
            if score(calculate(rounded), task.answer):
                return CheckedExample(rounded)
        problem = f"{calculation} gives {answer}, and the reference answer is {task.answer}"
        return CheckedExample(calculation, problem)

    return check


__all__ = ["example_check"]
