"""The reflector, curator, combiner, consolidator and exemplifier prompts, in one place,
versioned and overridable.

The wording lives in
``combee_stream/core/prompts/{reflector,curator,combiner,consolidator,exemplifier}.md``
(package data). A template has a system part and a user part, split by the lines
``<!-- system -->`` and ``<!-- user -->`` (a file without them is all user message), and
``{placeholders}``:

- reflector: ``{bullets_used}``, ``{trace}`` (and optionally ``{playbook}``)
- curator: ``{playbook}``, ``{reflections}``, ``{progress}``, ``{stats}``, ``{token_budget}``
- combiner: ``{playbook}``, ``{partial_updates}``, ``{token_budget}``
- consolidator: ``{section}``, ``{section_bullets}`` (one section of a playbook near its budget)
- exemplifier: ``{lesson}``, ``{trace}`` (a new bullet and a failed trace it came from, for its
  worked example: ``learning.worked_examples``)

Layout (prefix caching): every template is stable first and variable last: instructions and the
answer format, then the playbook, then what changes per call (window lines, records, the trace).
A server's prompt cache (llama-server per slot, a hosted API's prompt caching, which bills cached
input at a fraction) reuses the longest common prefix of consecutive requests, so the calls of
one window share everything up to their records, and consecutive windows share the instructions
and the playbook up to its first changed bullet. The reflector is shown only the bullets the
trace cited (as ACE's is), not the playbook: its prompt then depends on the trace alone, and
a trace reflected for two strategies or in a retried window is one request.

Only these names are substituted (one pass, so a value containing ``{x}`` is left alone, and JSON
examples in a template need no escaping). ``LearningConfig.prompts_dir`` points to a folder whose
files of the same names replace the defaults (read by :func:`combee_stream.wiring.load_prompts`:
the learning core reads no files, its prompts are given to it); every template is checked when
loaded for its required placeholders and its tagged blocks (each tag alone on its line), which
delimit the playbook and the untrusted trace text from the instructions.

Decision (Combee notes §8.5, what a reflection record carries): the curator sees, per
reflection, its trace id, the task (cut to ``TASK_CHARS``) and the reflection fields; not the
trajectory, which is multiplied by p·√n per call and was already distilled by the reflector.
Passing traces are reflected and curated too (ACE tags bullets on successes and they can carry
lessons). The trajectory given to the reflector is capped at ``STEPS_CHARS`` characters; the
feedback is never cut.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import msgspec
from msgspec import Struct

from combee_stream.core.fencing import fence
from combee_stream.core.hygiene import instance, quoted_spans
from combee_stream.core.playbook import PlaybookStats, find_bullet, render, stats
from combee_stream.errors import UserError
from combee_stream.llm import ChatMessage
from combee_stream.schemas import Delta, HeldOutTask, Playbook, Reflection, Section, Trace, encode

PROMPTS_VERSION: Final = "v1"
TASK_CHARS: Final = 600
STEPS_CHARS: Final = 20_000

PromptRole = Literal["reflector", "curator", "combiner", "consolidator", "exemplifier"]
PROMPT_ROLES: Final[tuple[PromptRole, ...]] = (
    "reflector", "curator", "combiner", "consolidator", "exemplifier"
)  # fmt: skip
_SYSTEM_MARK: Final = "<!-- system -->"
_USER_MARK: Final = "<!-- user -->"
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")

# Placeholders and tagged blocks each template must carry.
_REQUIRED: Final[dict[PromptRole, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "reflector": (("bullets_used", "trace"), ("bullets_used", "trace")),
    "curator": (
        ("playbook", "reflections", "progress", "stats", "token_budget"),
        ("playbook", "reflections"),
    ),
    "combiner": (("playbook", "partial_updates", "token_budget"), ("playbook", "partial_updates")),
    "consolidator": (("section", "section_bullets"), ("section_bullets",)),
    "exemplifier": (("lesson", "trace"), ("lesson", "failed_trace")),
}


class ReflectionRecord(Struct, frozen=True):
    """One item of a curator's input: a reflection and the task it is about."""

    reflection: Reflection
    task: str = ""
    quoted: tuple[str, ...] = ()  # spans its trace quoted (core.hygiene.quoted_spans)
    # The trace's reference answer, for the bullet review only (core.hygiene.instance): a
    # bullet may not carry it. Not rendered (the reflection's fields are what a curator reads).
    answer: str = ""
    # Whether its trace may have failed (its feedback does not say it passed): a new bullet's
    # lesson check (evaluation/lessons.py) retries such tasks with the bullet. Not rendered.
    failed: bool = False
    # The failed trace as the exemplifier reads it (render_failure), kept only for a trace that
    # may have failed and has a reference answer, when the learner writes worked examples
    # (learning.worked_examples). Not rendered for the curators.
    trace: str = ""
    # Kept with ``trace``: the agent's last tool call on it, the calculation its answer came
    # from. The learner's fallback when the exemplifier answers with results (outputs.py,
    # is_calculation). Not rendered.
    calculation: str = ""

    @classmethod
    def of(
        cls, trace: Trace, reflection: Reflection, *, keep_trace: bool = False
    ) -> ReflectionRecord:
        """The record of ``trace``'s reflection: its task, the spans its feedback quoted from
        it, its reference answer (and, ``keep_trace``, the trace itself when it may have failed
        and has a reference answer)."""
        feedback = trace.feedback
        record = cls(
            reflection=reflection,
            task=trace.task,
            quoted=tuple(quoted_spans(trace.task, feedback.text or "")),
            answer=feedback.ground_truth or "",
            failed=feedback.passed is not True
            and not (feedback.score is not None and feedback.score >= 1),
        )
        if keep_trace and record.retry is not None:
            calls = tool_calls(trace)
            record = msgspec.structs.replace(
                record, trace=render_failure(trace), calculation=calls[-1] if calls else ""
            )
        return record

    @property
    def retry(self) -> HeldOutTask | None:
        """Its task to retry, when its trace may have failed and has a reference answer."""
        if not (self.failed and self.task and self.answer):
            return None
        source = self.reflection.source
        return HeldOutTask(trace_id=source.trace_id, task=self.task, answer=self.answer, rank=0)

    @property
    def reviewed(self) -> str:
        """What the bullet review compares a bullet from this record with."""
        return instance(self.task, self.answer)


@dataclass(frozen=True, slots=True)
class Template:
    role: PromptRole
    system: str
    user: str
    origin: str  # where it was loaded from, for error messages

    def fill(self, values: Mapping[str, str]) -> list[ChatMessage]:
        def sub(text: str) -> str:
            return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)

        messages: list[ChatMessage] = []
        if self.system:
            messages.append({"role": "system", "content": sub(self.system)})
        messages.append({"role": "user", "content": sub(self.user)})
        return messages


@dataclass(frozen=True, slots=True)
class Prompts:
    reflector: Template
    curator: Template
    combiner: Template
    consolidator: Template
    exemplifier: Template
    version: str = PROMPTS_VERSION


def parse_template(role: PromptRole, text: str, origin: str) -> Template:
    """Split and check one template; raise UserError naming ``origin`` if it is unusable."""
    system, user = "", text
    if _USER_MARK in text:
        head, _, user = text.partition(_USER_MARK)
        system = head.replace(_SYSTEM_MARK, "", 1)
    template = Template(role=role, system=system.strip(), user=user.strip() + "\n", origin=origin)
    placeholders, tags = _REQUIRED[role]
    problems = [
        f"missing placeholder {{{name}}}"
        for name in placeholders
        if f"{{{name}}}" not in template.user
    ]
    for tag in tags:
        for line in (f"<{tag}>", f"</{tag}>"):
            if not re.search(rf"^[ \t]*{re.escape(line)}[ \t]*$", template.user, re.MULTILINE):
                problems.append(f"the user part needs the line {line}")
    if problems:
        raise UserError(f"prompt template {origin}: " + "; ".join(problems))
    return template


# --------------------------------------------------------------------------- rendering


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]} [... {len(text) - limit} chars cut]"


def render_trace(trace: Trace) -> str:
    """Task, output, steps, then the feedback lines. Every untrusted value is fenced
    (:func:`~combee_stream.core.fencing.fence`): it can end neither its field nor the block."""
    lines = [f"task: {fence(trace.task)}"]
    if trace.output:
        lines.append(f"output: {fence(trace.output)}")
    if trace.steps:
        steps: list[str] = []
        for i, step in enumerate(trace.steps, 1):
            name = f" {fence(step.name)}" if step.name else ""
            steps.append(f"  {i}. [{step.kind}{name}] {fence(step.content)}")
        lines.append("steps:\n" + _cut("\n".join(steps), STEPS_CHARS))
    fb = trace.feedback
    if fb.passed is not None:
        lines.append(f"passed: {'true' if fb.passed else 'false'}")
    if fb.score is not None:
        lines.append(f"score: {fb.score:g}")
    if fb.ground_truth:
        lines.append(f"ground_truth: {fence(fb.ground_truth)}")
    if fb.text:
        lines.append(f"feedback: {fence(fb.text)}")
    return "\n".join(lines)


def tool_calls(trace: Trace) -> list[str]:
    """What the agent sent its tools on ``trace``, in order (on the example agent, the
    calculations its answer came from)."""
    return [step.content for step in trace.steps if step.kind == "tool_call"]


def render_failure(trace: Trace) -> str:
    """A failed trace as the exemplifier reads it: the task, what the agent wrote (its tool
    calls, its answer) and the feedback. Not the ground truth alone: shown it, a 1.5B model
    gives the result where the calculation is asked for."""
    lines = [f"task: {fence(trace.task)}"]
    calls = tool_calls(trace)
    if calls:
        joined = " | ".join(fence(c) for c in calls)
        lines.append(f"the agent's calculation: {_cut(joined, STEPS_CHARS)}")
    elif trace.output:
        lines.append(f"the agent's answer: {fence(trace.output)}")
    lines.append(f"feedback: {fence(trace.feedback.text or '')}")
    return "\n".join(lines)


def render_bullets_used(playbook: Playbook, trace: Trace) -> str:
    lines = []
    for bullet_id in dict.fromkeys(trace.bullet_ids):
        bullet = find_bullet(playbook, bullet_id)
        content = fence(bullet.content) if bullet else "(not in the playbook)"
        lines.append(f"[{fence(bullet_id)}] {content}")
    return "\n".join(lines)


def render_reflections(records: Sequence[ReflectionRecord]) -> str:
    blocks = []
    for i, record in enumerate(records, 1):
        r = record.reflection
        fields = [f"[Reflection {i}]", f"trace_id: {fence(r.source.trace_id)}"]
        if record.task:
            fields.append(f"task: {fence(_cut(record.task, TASK_CHARS))}")
        fields += [
            f"error_identification: {fence(r.error_identification)}",
            f"root_cause: {fence(r.root_cause)}",
            f"correct_approach: {fence(r.correct_approach)}",
            f"key_insight: {fence(r.key_insight)}",
        ]
        blocks.append("\n".join(fields))
    return "\n---\n".join(blocks)


def render_partial_updates(partials: Sequence[Delta]) -> str:
    blocks = []
    for i, delta in enumerate(partials, 1):
        # JSON escapes \n but not U+2028 nor a block tag: the ops carry untrusted text.
        ops = [fence(encode(op).decode()) for op in delta.operations]
        blocks.append("\n".join([f"[Update {i}]", *ops]))
    return "\n".join(blocks)


def render_stats(s: PlaybookStats) -> str:
    lines = [
        f"bullets: {s.bullets} (high-performing: {s.high_performing}, "
        f"problematic: {s.problematic}, unused: {s.unused}); about {s.tokens} tokens"
    ]
    lines += [
        f"- {x.name}: {x.bullets} bullets, helpful {x.helpful}, harmful {x.harmful}"
        for x in s.sections
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- messages


def reflector_messages(prompts: Prompts, playbook: Playbook, trace: Trace) -> list[ChatMessage]:
    values = {
        "bullets_used": render_bullets_used(playbook, trace),
        "trace": render_trace(trace),
    }
    if "{playbook}" in prompts.reflector.user:  # an overriding template that asks for it
        values["playbook"] = render(playbook, empty_sections=True, counters=True).strip()
    return prompts.reflector.fill(values)


def curator_messages(
    prompts: Prompts,
    playbook: Playbook,
    records: Sequence[ReflectionRecord],
    *,
    progress: str,
    token_budget: int,
    playbook_stats: PlaybookStats | None = None,
) -> list[ChatMessage]:
    s = playbook_stats or stats(playbook)
    return prompts.curator.fill(
        {
            "playbook": render(playbook, empty_sections=True, counters=True).strip(),
            "reflections": render_reflections(records),
            "progress": progress or "not given",
            "stats": render_stats(s),
            "token_budget": f"{token_budget} tokens (the playbook uses about {s.tokens})",
        }
    )


def combiner_messages(
    prompts: Prompts, playbook: Playbook, partials: Sequence[Delta], *, token_budget: int
) -> list[ChatMessage]:
    return prompts.combiner.fill(
        {
            "playbook": render(playbook, empty_sections=True, counters=True).strip(),
            "partial_updates": render_partial_updates(partials),
            "token_budget": f"{token_budget} tokens",
        }
    )


def consolidator_messages(
    prompts: Prompts, section: Section, limit_chars: int
) -> list[ChatMessage]:
    """One section of a playbook near its budget, for the consolidator (same endpoint as the
    curator): its bullets as ``[id] helpful=h harmful=r :: text`` lines."""
    lines = [
        f"[{b.id}] helpful={b.helpful} harmful={b.harmful} :: {fence(b.content)}"
        for b in section.bullets
    ]
    return prompts.consolidator.fill(
        {
            "section": f"{section.name} (a merged bullet may have up to {limit_chars} characters)",
            "section_bullets": "\n".join(lines),
        }
    )


def exemplifier_messages(
    prompts: Prompts, lesson: str, record: ReflectionRecord
) -> list[ChatMessage]:
    """A new bullet and a failed trace it came from (its record kept the trace), for the
    bullet's worked example (same endpoint as the curator)."""
    return prompts.exemplifier.fill({"lesson": fence(lesson), "trace": record.trace})


# Said after an exemplifier's reply whose "right" calculation the agent's tool does not score
# right: what it gives, and the two ways a real 1.5B exemplifier got there (the reference
# solution's calculation, unrounded; percentages written with "%").
EXAMPLE_RETRY: Final = (
    'Checked with the agent\'s calculator, your "right" calculation is not the reference answer: '
    '{problem}. Reply again in the same JSON: "right" must be a calculation that gives exactly '
    "the reference answer: numbers and operators only (percentages as decimal fractions with no "
    '% sign, no names or "="), rounded as the task asks.'
)


def exemplifier_retry(
    messages: list[ChatMessage], reply: Struct, problem: str
) -> list[ChatMessage]:
    """The exemplifier's conversation again, its reply and what is wrong with it added."""
    return [
        *messages,
        {"role": "assistant", "content": encode(reply).decode()},
        {"role": "user", "content": EXAMPLE_RETRY.format(problem=problem)},
    ]


__all__ = [
    "PROMPTS_VERSION",
    "PROMPT_ROLES",
    "Prompts",
    "ReflectionRecord",
    "Template",
    "combiner_messages",
    "consolidator_messages",
    "curator_messages",
    "exemplifier_messages",
    "exemplifier_retry",
    "parse_template",
    "reflector_messages",
    "render_bullets_used",
    "render_failure",
    "render_partial_updates",
    "render_reflections",
    "render_stats",
    "render_trace",
]
