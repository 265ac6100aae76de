"""Does a prompt make the agent better? The example agent (:class:`Answerer`, with its
calculator), accuracy on held-out tasks with a 95% interval, and paired comparisons
(``combee-stream eval``, the quality benchmark, the demo)."""

from combee_stream.evaluation.answerer import Answer, Answerer
from combee_stream.evaluation.run import EvalResult, TaskOutcome, compare, evaluate
from combee_stream.evaluation.stats import Paired, mcnemar_exact, paired, wilson

__all__ = [
    "Answer",
    "Answerer",
    "EvalResult",
    "Paired",
    "TaskOutcome",
    "compare",
    "evaluate",
    "mcnemar_exact",
    "paired",
    "wilson",
]
