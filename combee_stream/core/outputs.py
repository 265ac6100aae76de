"""What each LLM role must return: msgspec Structs whose JSON Schema is sent as the response
format and against which every reply is validated (and re-asked on failure).

Every field is used: none asks for free-form "reasoning" that would be decoded and dropped.
Output tokens are the slow part of a CPU-served model (a few per second per slot), and the
reflector's diagnosis fields already are its reasoning, written before its key insight."""

from __future__ import annotations

import re
from collections.abc import Callable

from msgspec import Struct

from combee_stream.schemas import BulletTag, HeldOutTask, Operation


class ReflectorOutput(Struct, forbid_unknown_fields=False):
    """Diagnosis of one trace (ACE's reflector output, without its free-form reasoning)."""

    error_identification: str
    root_cause_analysis: str
    correct_approach: str
    key_insight: str
    bullet_tags: list[BulletTag] = []


class ReflectorOutputNoTags(Struct, forbid_unknown_fields=False):
    """The reflector's output for a trace that cited no bullet: nothing to tag, so the schema
    does not ask for tags (small models otherwise fill the list with invented ids)."""

    error_identification: str
    root_cause_analysis: str
    correct_approach: str
    key_insight: str


class CuratorOutput(Struct, forbid_unknown_fields=False):
    """Playbook operations proposed by a curator (level-1 node) or a combiner (level-2 node)."""

    operations: list[Operation]


class Merge(Struct, forbid_unknown_fields=False):
    """Bullets of one section that say the same thing, and the one bullet replacing them."""

    bullet_ids: list[str]
    content: str


class ConsolidatorOutput(Struct, forbid_unknown_fields=False):
    """What the consolidator proposes for one section near the budget: merges only."""

    merges: list[Merge] = []


_RESULT = re.compile(r"\s*=\s*-?[\d.,]+\s*$")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_OPERATOR = re.compile(r"[-+*/^]")


def is_calculation(text: str) -> bool:
    """Whether ``text`` computes from numbers (two numbers and an operator), not a bare
    result."""
    return len(_NUMBER.findall(text)) >= 2 and bool(_OPERATOR.search(text))


def _computed(chain: str) -> str:
    """The calculation of a chain of equalities: its first side that computes from numbers.
    Reference solutions write "P_0 = 2 / (0.09 - 0.05) = 2 / 0.04 = 50"; a real 1.5B
    exemplifier copied such a chain into "write P_0 = 2 / (0.09 - 0.05) = 2 / 0.04, not ...",
    which teaches the agent to put names and "=" in its expression (ACE's Formula run,
    2026-12-06). The name before the first "=" and the simplifications after the calculation
    are dropped; a chain with no such side is left as it is."""
    for side in chain.split("="):
        if is_calculation(side):
            return side.strip()
    return chain


class WorkedExample(Struct, forbid_unknown_fields=False):
    """One worked example of a new bullet, from a failed trace it came from
    (``learning.worked_examples``)."""

    # Two fields, not one sentence: asked for "for <inputs>, write <calculation>, not <its
    # calculation>", a 1.5B model wrote the results ("write 13000000, not 13") or copied the
    # placeholders; asked for its own calculation first and then the reference solution's, it
    # gave both on 10 of 10 failed demo traces (and 8 of 10 in a looser wording, the other two
    # a result: the learner drops an example whose calculation is a bare result).
    wrong: str  # what it wrote (asked first: copying it, the model then writes the other)
    right: str  # what the agent should have written (the reference solution's calculation)

    def calculations(self) -> tuple[str, str]:
        """(right, wrong), each on one line and without a trailing "= <its result>"; the right
        one is the calculation alone. The wrong one is kept as the agent wrote it: a name and
        "=" in its expression may be its mistake."""
        right, wrong = (_RESULT.sub("", " ".join(t.split())) for t in (self.right, self.wrong))
        return _computed(right), wrong

    def text(self) -> str:
        right, wrong = self.calculations()
        return f"write {right}, not {wrong}"


class CheckedExample(Struct, frozen=True):
    """A worked example's calculation as checked against the task it came from."""

    calculation: str  # as the example shows it (a check may round it as its task asks)
    problem: str | None = None  # what is still wrong with it for its task; None: nothing


# What the agent would be scored on a worked example's calculation for its task. The learner
# knows no agent; the wiring gives the gate's own agent's check (evaluation/examples.py).
ExampleCheck = Callable[[str, HeldOutTask], CheckedExample]


ROLE_OUTPUTS: dict[str, type[Struct]] = {
    "reflector": ReflectorOutput,
    "curator": CuratorOutput,
    "combiner": CuratorOutput,
}


__all__ = [
    "ROLE_OUTPUTS",
    "CheckedExample",
    "ConsolidatorOutput",
    "CuratorOutput",
    "ExampleCheck",
    "Merge",
    "ReflectorOutput",
    "ReflectorOutputNoTags",
    "WorkedExample",
    "is_calculation",
]
