"""Scripted behaviour of the simulated LLM roles, as pure functions of the prompt they see.

The role is identified by which block the user message carries: ``<failed_trace>``
(exemplifier), ``<partial_updates>`` (combiner), ``<reflections>`` (curator), ``<trace>``
(reflector) or ``<question>`` (the agent), among others; each tag sits on its own line. The
roles work from the text they are shown: the lesson markers of simulated traces
(:mod:`combee_stream.sim.markers`), never an instruction in the product's prompts. The
:class:`~combee_stream.sim.settings.RealismModel` makes them err as real models do.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final, Literal

import msgspec

from combee_stream.core.outputs import (
    ConsolidatorOutput,
    CuratorOutput,
    Merge,
    ReflectorOutput,
    WorkedExample,
)
from combee_stream.evaluation.answerer import AgentOutput
from combee_stream.evaluation.replay import JudgeOutput
from combee_stream.schemas import AddOp, BulletTag, Operation
from combee_stream.sim.faults import unit
from combee_stream.sim.markers import (
    Lesson,
    base_id,
    distinct,
    find_lessons,
    marker_line,
    mentions,
    mentions_lesson,
)
from combee_stream.sim.settings import RealismModel
from combee_stream.sim.tasks import poison_of, task_code, task_lesson, wrong_code
from combee_stream.tasks.base import parse_number

Role = Literal["reflector", "curator", "combiner", "agent", "consolidator", "judge", "exemplifier"]
CURATOR_SECTION = "STRATEGIES & INSIGHTS"

# Checked in this order: a curator prompt never carries <partial_updates>, a reflector prompt
# never carries <reflections>.
_ROLE_TAGS: tuple[tuple[str, Role], ...] = (
    ("judged_answer", "judge"),
    ("failed_trace", "exemplifier"),
    ("section_bullets", "consolidator"),
    ("partial_updates", "combiner"),
    ("reflections", "curator"),
    ("trace", "reflector"),
    ("question", "agent"),
)
_PASSED_TRUE = re.compile(r"^[ \t]*passed:[ \t]*true[ \t]*$", re.MULTILINE | re.IGNORECASE)
_PLAIN_INSIGHT = re.compile(r"^key_insight:[ \t]*(.*)$", re.MULTILINE)
_BULLET_REF = re.compile(r"^[ \t]*\[([^\]\s]+)\]", re.MULTILINE)
_operation_decoder = msgspec.json.Decoder(Operation)


def block(text: str, tag: str) -> str | None:
    """Content between ``<tag>`` and ``</tag>``, each on its own line; None if there is no block.
    An unclosed block runs to the end of the text."""
    match = re.search(
        rf"^[ \t]*<{tag}>[ \t]*$\n?(.*?)(?:^[ \t]*</{tag}>[ \t]*$|\Z)",
        text,
        re.MULTILINE | re.DOTALL,
    )
    return None if match is None else match.group(1)


def identify_role(prompt: str) -> Role | None:
    for tag, role in _ROLE_TAGS:
        if block(prompt, tag) is not None:
            return role
    return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_VAGUE = ("Be careful.", "Double-check the work.", "Read the task again.")


def reflect(prompt: str, *, seed: int = 0, realism: RealismModel | None = None) -> ReflectorOutput:
    """Copy every lesson marker of the trace into ``key_insight``; tag each cited bullet helpful
    if the trace passed, harmful otherwise. With ``realism``: miss lessons, invent a vague one,
    tag a bullet id the agent did not cite."""
    realism = realism or RealismModel()
    trace = block(prompt, "trace") or ""
    here = _digest(trace)
    lessons = [
        lesson
        for lesson in find_lessons(trace)
        if unit(seed, "miss", lesson.id, here) >= realism.miss
    ]
    # An invented lesson is plain text, first in the key insight, as a real model writes it.
    invented = (
        [_VAGUE[int(unit(seed, "vague", here) * len(_VAGUE))]]
        if unit(seed, "invent", here) < realism.invent
        else []
    )
    passed = _PASSED_TRUE.search(trace) is not None
    used = _BULLET_REF.findall(block(prompt, "bullets_used") or "")
    if used and unit(seed, "uncited", here) < realism.uncited_tags:
        # Shown only the cited bullets, a real reflector still tags ids it never saw: the next
        # id of a cited one's section, say (an invented, plausible id).
        cited = used[int(unit(seed, "which", here) * len(used))]
        prefix, _, number = cited.rpartition("-")
        invented_id = f"{prefix}-{int(number) + 1:0{len(number)}d}" if number.isdigit() else "x-1"
        if invented_id not in used:
            used = [*used, invented_id]
    tag: Literal["helpful", "harmful"] = "helpful" if passed else "harmful"
    return ReflectorOutput(
        error_identification="none" if passed else "the agent's answer was judged incorrect",
        root_cause_analysis="see the feedback of the trace",
        correct_approach="apply the lessons below" if lessons else "no lesson recorded",
        key_insight="\n".join([*invented, *(lesson.line for lesson in lessons)]),
        bullet_tags=[BulletTag(bullet_id=bullet_id, tag=tag) for bullet_id in dict.fromkeys(used)],
    )


def overload_keep(n: int, capacity: int | None) -> int:
    """How many of ``n`` distinct lessons an overloaded curator keeps: all up to its capacity C,
    beyond it only max(1, floor(C*C/n)): the more it is given, the less it keeps."""
    if capacity is None or n <= capacity:
        return n
    return max(1, capacity * capacity // n)


def _lesson_rank(seed: int, lesson_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:{lesson_id}".encode()).digest()


_SYNONYMS: Final = {
    "recompute": "recalculate",
    "ask": "check",
    "follow": "walk",
    "merge": "join",
    "infer": "deduce",
    "retry": "repeat",
    "read": "parse",
    "answer": "reply",
    "narrow": "restrict",
    "report": "flag",
    "track": "monitor",
    "log": "record",
    "cite": "quote",
    "confirm": "verify",
}


def paraphrase(lesson: Lesson) -> Lesson:
    """The same lesson with its first verb that has a synonym swapped (one word changed)."""
    words = lesson.text.split(" ")
    for i, word in enumerate(words):
        if word in _SYNONYMS:
            words[i] = _SYNONYMS[word]
            break
    return Lesson(lesson.id, " ".join(words))


def curate(
    prompt: str, *, seed: int, capacity: int | None, realism: RealismModel | None = None
) -> CuratorOutput:
    """One ADD per distinct lesson of the reflections that the playbook does not yet carry,
    thinned by the overload model (kept lessons chosen by sha256(seed, id), order preserved);
    with ``realism.paraphrase``, some ADDs are reworded."""
    realism = realism or RealismModel()
    playbook = block(prompt, "playbook") or ""
    reflections = block(prompt, "reflections") or ""
    new = [
        lesson
        for lesson in distinct(find_lessons(reflections))
        if not mentions(playbook, lesson.id)
    ]
    keep = overload_keep(len(new), capacity)
    chosen = {lesson.id for lesson in sorted(new, key=lambda x: _lesson_rank(seed, x.id))[:keep]}
    kept: list[Lesson] = [lesson for lesson in new if lesson.id in chosen]
    adds: list[Operation] = [
        AddOp(
            section=CURATOR_SECTION,
            content=(
                paraphrase(lesson)
                if unit(seed, "paraphrase", lesson.id, _digest(reflections)) < realism.paraphrase
                else lesson
            ).line,
        )
        for lesson in kept
    ]
    # Plain insights (no lesson marker) are copied as they are: a curator cannot tell an
    # invented lesson from a real one, only the learner's review can.
    plain = dict.fromkeys(
        match.group(1).strip()
        for match in _PLAIN_INSIGHT.finditer(reflections)
        if not find_lessons(match.group(1))
    )
    adds += [AddOp(section=CURATOR_SECTION, content=text) for text in plain if text]
    return CuratorOutput(operations=adds)


def combine(prompt: str) -> CuratorOutput:
    """Union of the operations (one JSON object per line) of the partial updates, exact
    duplicates removed, first-seen order kept; lines that are not an operation are skipped."""
    ops: dict[Operation, None] = {}
    for line in (block(prompt, "partial_updates") or "").splitlines():
        stripped = line.strip()
        if not stripped.startswith("{"):
            continue
        try:
            ops.setdefault(_operation_decoder.decode(stripped))
        except msgspec.DecodeError:  # ValidationError is a subclass
            continue
    return CuratorOutput(operations=list(ops))


def answer(system: str, prompt: str, *, seed: int) -> AgentOutput:
    """The agent of simulated tasks (:mod:`combee_stream.sim.tasks`): right if and only if its
    system prompt carries the lesson the task needs and no poison for it; it cites the bullets
    that carry them."""
    question = block(prompt, "question") or ""
    lesson_id = task_lesson(question)
    if lesson_id is None:
        return AgentOutput(
            reasoning="Simulated agent: not a simulated task.",
            bullet_ids=[],
            expression="",
            final_answer="unknown",
        )
    carriers = [
        line.split("]", 1)[0].lstrip("[")
        for line in system.splitlines()
        if line.startswith("[") and mentions_lesson(line, lesson_id)
    ]
    knows = bool(carriers) or mentions_lesson(system, lesson_id)
    code = task_code(seed, lesson_id)
    poison = poison_of(lesson_id)
    if mentions(system, poison):  # a wrong rule for the case overrides the right one
        misled = [
            line.split("]", 1)[0].lstrip("[")
            for line in system.splitlines()
            if line.startswith("[") and mentions(line, poison)
        ]
        return AgentOutput(
            reasoning=f"Simulated agent: the prompt carries {poison}.",
            bullet_ids=misled,
            expression="",
            final_answer=str(wrong_code(code)),
        )
    return AgentOutput(
        reasoning=f"Simulated agent: the prompt {'carries' if knows else 'lacks'} {lesson_id}.",
        bullet_ids=carriers,
        expression="",
        final_answer=str(code if knows else wrong_code(code)),
    )


def consolidate(prompt: str) -> ConsolidatorOutput:
    """Merge the bullets that carry one lesson (its variants, :data:`~combee_stream.sim.markers.
    VARIANT`, are near-duplicates) into one bullet with the lesson's first wording under its
    base id; bullets carrying no lesson, or a lesson alone, are left out (kept as they are)."""
    groups: dict[str, list[tuple[str, Lesson]]] = {}
    for line in (block(prompt, "section_bullets") or "").splitlines():
        found = _BULLET_REF.match(line)
        lessons = find_lessons(line)
        if found is None or len(lessons) != 1:
            continue
        groups.setdefault(base_id(lessons[0].id), []).append((found.group(1), lessons[0]))
    merges = [
        Merge(
            bullet_ids=[bullet for bullet, _ in group], content=marker_line(base, group[0][1].text)
        )
        for base, group in groups.items()
        if len(group) > 1
    ]
    return ConsolidatorOutput(merges=merges)


_FIELD = r"^{}:[ \t]*(.*)$"


_TOLD = re.compile(r"the reference answer is (-?\d[\d,]*(?:\.\d+)?)")


def exemplify(prompt: str) -> WorkedExample:
    """The answer the trace's lesson gives against the agent's, as a model copying the trace's
    lines writes them; re-asked with the reference answer (the learner's example check), that
    answer, as a model told it copies it."""
    trace = block(prompt, "failed_trace") or ""
    lessons = find_lessons(trace)
    wrong = re.search(_FIELD.format("the agent's answer"), trace, re.MULTILINE)
    if not lessons or wrong is None:
        return WorkedExample(right="none", wrong="")
    told = _TOLD.search(prompt[prompt.find("</failed_trace>") :])
    right = told.group(1) if told else f"the answer {lessons[0].id} gives"
    return WorkedExample(right=right, wrong=wrong.group(1).strip())


def judge(prompt: str) -> JudgeOutput:
    """Right when the answer's last number equals the reference's (text answers: the same
    words, case and spacing aside), as a careful judge of these tasks would rule."""
    answer = (block(prompt, "judged_answer") or "").strip()
    reference = (block(prompt, "reference") or "").strip()
    got, want = parse_number(answer), parse_number(reference)
    same = (
        got == want if got is not None and want is not None else answer.lower() == reference.lower()
    )
    return JudgeOutput(
        reasoning=f"Simulated judge: {'same' if same else 'another'} result.", correct=same
    )


def respond(
    role: Role,
    prompt: str,
    *,
    seed: int,
    capacity: int | None,
    realism: RealismModel | None = None,
    system: str = "",
) -> bytes:
    """The JSON content the role answers with."""
    output: (
        ReflectorOutput | CuratorOutput | AgentOutput | ConsolidatorOutput | JudgeOutput
        | WorkedExample
    )  # fmt: skip
    if role == "judge":
        output = judge(prompt)
    elif role == "exemplifier":
        output = exemplify(prompt)
    elif role == "consolidator":
        output = consolidate(prompt)
    elif role == "reflector":
        output = reflect(prompt, seed=seed, realism=realism)
    elif role == "curator":
        output = curate(prompt, seed=seed, capacity=capacity, realism=realism)
    elif role == "agent":
        output = answer(system, prompt, seed=seed)
    else:
        output = combine(prompt)
    return msgspec.json.encode(output)


__all__ = [
    "CURATOR_SECTION",
    "Role",
    "block",
    "combine",
    "consolidate",
    "curate",
    "exemplify",
    "identify_role",
    "judge",
    "overload_keep",
    "reflect",
    "respond",
]
