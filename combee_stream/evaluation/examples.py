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

Why only for the gate's own agent (``gate.evaluator = "agent"``): that agent and its
calculator are the only agent the engine can run; a user's evaluator (``module:function``)
answers with tools the engine does not know, and the judge scorer would make a check an LLM
call. Which scorer matters: ``numeric`` forgives 0.005, so 0.4923 passes for 0.49; ``formula``
(ACE's rule, which ``bench quality`` gives the gate on ACE's rows) does not.
"""

from __future__ import annotations

from combee_stream.config import GateConfig
from combee_stream.core.learner import ExampleCheck
from combee_stream.evaluation.answerer import calculate
from combee_stream.evaluation.calculator import CalculatorError
from combee_stream.schemas import HeldOutTask
from combee_stream.tasks.base import SCORERS


def example_check(config: GateConfig) -> ExampleCheck | None:
    """The check of the gate's own agent (its calculator, ``gate.scorer``); None when the gate
    scores with another evaluator or the judge."""
    score = SCORERS.get(config.scorer)
    if config.evaluator != "agent" or score is None:
        return None

    def check(calculation: str, task: HeldOutTask) -> str | None:
        try:
            answer = calculate(calculation)
        except CalculatorError as exc:
            return (
                f"the calculator cannot evaluate {calculation} ({exc}), and the reference answer "
                f"is {task.answer}"
            )
        if score(answer, task.answer):
            return None
        return f"{calculation} gives {answer}, and the reference answer is {task.answer}"

    return check


__all__ = ["example_check"]
