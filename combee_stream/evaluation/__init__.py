"""Does a prompt make the agent better? Accuracy on held-out tasks with a 95% interval, and
paired comparisons (``combee-stream eval``, the quality benchmark)."""

from combee_stream.evaluation.run import EvalResult, TaskOutcome, compare, evaluate
from combee_stream.evaluation.stats import Paired, mcnemar_exact, paired, wilson

__all__ = [
    "EvalResult",
    "Paired",
    "TaskOutcome",
    "compare",
    "evaluate",
    "mcnemar_exact",
    "paired",
    "wilson",
]
