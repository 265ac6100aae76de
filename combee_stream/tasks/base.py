"""Tasks an agent answers, and the scorers that judge its answers.

A :class:`Task` is what an agent is asked and what counts as right: the question, the reference
answer and the name of the scorer that compares them. Task sets are plain lists of tasks, made
by a generator (:mod:`combee_stream.tasks.generated`) or read from a dataset
(:mod:`combee_stream.tasks.readers`); :func:`load_tasks` turns a ``SOURCE`` string of the CLI
into one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Final, Literal

from msgspec import Struct

from combee_stream.schemas import Feedback

ScorerName = Literal["numeric", "exact", "contains", "formula", "finer"]


class Task(Struct, frozen=True, kw_only=True):
    id: str
    question: str
    answer: str  # the reference answer, as text
    scorer: ScorerName = "numeric"
    family: str = ""  # what kind of task (a formula, a convention); for reports
    metadata: dict[str, str] = {}


_NUMBER = re.compile(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?")


def parse_number(text: str) -> float | None:
    """The number an answer states: commas, currency signs and a trailing % are ignored; when
    several numbers appear, the last one counts (the conclusion of a reasoning)."""
    cleaned = text.replace(",", "").replace("$", "").strip()
    try:
        value = float(cleaned.rstrip("%").strip())
    except ValueError:
        found = _NUMBER.findall(cleaned)
        if not found:
            return None
        value = float(found[-1])
    return value if math.isfinite(value) else None


# Relative tolerance of the numeric scorer: tight enough that a convention error (monthly vs
# yearly compounding, D0 for D1, a fraction for a percentage) fails, loose enough for the last
# digit of a rounded result.
NUMERIC_RTOL: Final = 1e-3


def numeric(prediction: str, reference: str) -> bool:
    got, want = parse_number(prediction), parse_number(reference)
    if got is None or want is None:
        return prediction.strip() == reference.strip()
    return abs(got - want) <= max(NUMERIC_RTOL * abs(want), 0.005)


def exact(prediction: str, reference: str) -> bool:
    return prediction.strip().lower() == reference.strip().lower()


def contains(prediction: str, reference: str) -> bool:
    return reference.strip().lower() in prediction.lower()


def formula(prediction: str, reference: str) -> bool:
    """ACE's Formula rule: drop the commas, compare as floats; if either does not parse,
    compare the strings."""
    got, want = prediction.replace(",", "").strip(), reference.replace(",", "").strip()
    try:
        return float(got) == float(want)
    except ValueError:
        return got == want


def finer_items(prediction: str, reference: str) -> tuple[int, int]:
    """ACE's FiNER rule: split on commas, lower-case and strip each tag, truncate or pad the
    prediction to the reference's length, compare item by item; (correct, total)."""
    want = [t.strip().lower() for t in reference.split(",")]
    got = [t.strip().lower() for t in prediction.split(",")][: len(want)]
    got += [""] * (len(want) - len(got))
    return sum(g == w for g, w in zip(got, want, strict=True)), len(want)


def finer(prediction: str, reference: str) -> bool:
    """A FiNER sample is correct only when every one of its tags is."""
    correct, total = finer_items(prediction, reference)
    return correct == total


SCORERS: Final[dict[str, Callable[[str, str], bool]]] = {
    "numeric": numeric,
    "exact": exact,
    "contains": contains,
    "formula": formula,
    "finer": finer,
}


def is_correct(task: Task, prediction: str) -> bool:
    return SCORERS[task.scorer](prediction, task.answer)


_DECIMALS = re.compile(r"(\d+)\s+decimal", re.IGNORECASE)
# Factors a wrong answer can be off by for a reason a rule fixes, each with what the answer was
# when too large and when too small. The direction is named, not "one or the other": told
# "millions against full units", a 1.5B reflector's lesson on 12 operating-income traces of the
# demo (2026-12-05) was a rounding rule 6 times and "convert the units to dollars" once; told
# "in millions where full units are expected", 3 times and 8.
_FACTORS: Final = (
    (
        100,
        "it is a percentage where a decimal fraction is expected",
        "it is a decimal fraction where a percentage is expected",
    ),
    (
        1000,
        "it is in full units where thousands are expected",
        "it is in thousands where full units are expected",
    ),
    (
        1_000_000,
        "it is in full units where millions are expected",
        "it is in millions where full units are expected",
    ),
)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= NUMERIC_RTOL * abs(b)


def places_named(question: str) -> int | None:
    """The decimal places a question asks its answer rounded to ("2 decimal places")."""
    asked = _DECIMALS.search(question)
    return int(asked.group(1)) if asked else None


def places_asked(question: str, answer: str) -> int:
    """The decimal places an answer is to be rounded to: those the question names, else those
    of the reference answer."""
    named = places_named(question)
    return len(answer.partition(".")[2]) if named is None else named


def miss_kind(task: Task, prediction: str) -> str | None:
    """What kind of miss a wrong numeric answer is, when it is one a rule can fix: right but
    not rounded to the decimals asked, off by a factor of 100, 1,000 or 1,000,000, the wrong
    sign, or no number at all. None when it is none of these (a wrong formula or inputs). A
    small model's reflector turns "expected 0.49, got 0.4923" into a rule far more often when
    it is told the answer was right but unrounded."""
    if task.scorer not in ("numeric", "formula"):
        return None
    want = parse_number(task.answer)
    if want is None:
        return None
    got = parse_number(prediction)
    if got is None:
        return "the answer states no number"
    places = places_asked(task.question, task.answer)

    def same(value: float) -> bool:
        return round(value, places) == round(want, places) or _close(value, want)

    if same(got):
        return f"the value is right but not rounded to {places} decimal places as asked"
    if want == 0:  # neither a sign nor a factor can be told on zero
        return None
    if same(-got):
        return "the sign is wrong"
    for factor, too_large, too_small in _FACTORS:
        if same(got / factor):
            return (
                f"the answer is off by a factor of {factor:,}: {too_large} "
                f"(divided by {factor:,}, it is right)"
            )
        if same(got * factor):
            return (
                f"the answer is off by a factor of {factor:,}: {too_small} "
                f"(multiplied by {factor:,}, it is right)"
            )
    return None


def task_feedback(task: Task, prediction: str) -> Feedback:
    """What the environment tells the learner about one answer: right or wrong, the reference
    answer (ACE's "with ground truth" setting), and on a wrong answer what the task set knows
    beyond it: its worked reference solution (``metadata["solution"]``) and its own feedback
    text (``metadata["feedback"]``, e.g. a checker's message)."""
    ok = is_correct(task, prediction)
    if ok:
        text = f"correct: the answer {prediction!r} matches"
    else:
        text = f"incorrect: expected {task.answer}, got {prediction!r}"
        if kind := miss_kind(task, prediction):
            text += f": {kind}"
        if solution := task.metadata.get("solution", ""):
            text += f"\nreference solution: {solution}"
        if extra := task.metadata.get("feedback", ""):
            text += f"\n{extra}"
    return Feedback(passed=ok, score=1.0 if ok else 0.0, ground_truth=task.answer, text=text)


__all__ = [
    "NUMERIC_RTOL",
    "SCORERS",
    "ScorerName",
    "Task",
    "contains",
    "exact",
    "finer",
    "finer_items",
    "formula",
    "is_correct",
    "miss_kind",
    "numeric",
    "parse_number",
    "places_asked",
    "places_named",
    "task_feedback",
]
