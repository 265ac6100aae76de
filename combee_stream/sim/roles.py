"""Scripted behaviour of the three simulated LLM roles, as pure functions of the prompt they see.

The role is identified by which block the user message carries: ``<partial_updates>`` (combiner),
``<reflections>`` (curator) or ``<trace>`` (reflector); each tag sits on its own line.
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

import msgspec

from combee_stream.core.outputs import CuratorOutput, ReflectorOutput
from combee_stream.schemas import AddOp, BulletTag, Operation
from combee_stream.sim.markers import Lesson, distinct, find_lessons, mentions

Role = Literal["reflector", "curator", "combiner"]
CURATOR_SECTION = "STRATEGIES & INSIGHTS"

# Checked in this order: a curator prompt never carries <partial_updates>, a reflector prompt
# never carries <reflections>.
_ROLE_TAGS: tuple[tuple[str, Role], ...] = (
    ("partial_updates", "combiner"),
    ("reflections", "curator"),
    ("trace", "reflector"),
)
_PASSED_TRUE = re.compile(r"^[ \t]*passed:[ \t]*true[ \t]*$", re.MULTILINE | re.IGNORECASE)
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


def reflect(prompt: str) -> ReflectorOutput:
    """Copy every lesson marker of the trace into ``key_insight``; tag each cited bullet helpful
    if the trace passed, harmful otherwise."""
    trace = block(prompt, "trace") or ""
    lessons = find_lessons(trace)
    passed = _PASSED_TRUE.search(trace) is not None
    used = _BULLET_REF.findall(block(prompt, "bullets_used") or "")
    tag: Literal["helpful", "harmful"] = "helpful" if passed else "harmful"
    outcome = "succeeded" if passed else "did not succeed"
    return ReflectorOutput(
        reasoning=f"Simulated reflector: the trace {outcome}; {len(lessons)} lesson marker(s).",
        error_identification="none" if passed else "the agent's answer was judged incorrect",
        root_cause_analysis="see the feedback of the trace",
        correct_approach="apply the lessons below" if lessons else "no lesson recorded",
        key_insight="\n".join(lesson.line for lesson in lessons),
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


def curate(prompt: str, *, seed: int, capacity: int | None) -> CuratorOutput:
    """One ADD per distinct lesson of the reflections that the playbook does not yet carry,
    thinned by the overload model (kept lessons chosen by sha256(seed, id), order preserved)."""
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
    limit = "unlimited" if capacity is None else str(capacity)
    return CuratorOutput(
        reasoning=(
            f"Simulated curator: {len(new)} new lesson(s), kept {len(kept)} (capacity {limit})."
        ),
        operations=[AddOp(section=CURATOR_SECTION, content=lesson.line) for lesson in kept],
    )


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
    return CuratorOutput(
        reasoning=f"Simulated combiner: union of {len(ops)} distinct operation(s).",
        operations=list(ops),
    )


def respond(role: Role, prompt: str, *, seed: int, capacity: int | None) -> bytes:
    """The JSON content the role answers with."""
    output: ReflectorOutput | CuratorOutput
    if role == "reflector":
        output = reflect(prompt)
    elif role == "curator":
        output = curate(prompt, seed=seed, capacity=capacity)
    else:
        output = combine(prompt)
    return msgspec.json.encode(output)


__all__ = [
    "CURATOR_SECTION",
    "Role",
    "block",
    "combine",
    "curate",
    "identify_role",
    "overload_keep",
    "reflect",
    "respond",
]
