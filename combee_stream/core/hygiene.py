"""Which proposed bullets do not earn a place in the playbook, before they are applied.

A real model's curator (Qwen2.5-Coder at 0.5B, on ACE's Formula tasks) writes bullets that
restate the task they came from ("To calculate the WACC, the agent should have applied the
formula ...", with the task's own numbers), repeat one sentence across sections with a word
changed, or say nothing reusable ("Be careful."). Exact dedup catches none of them; these
checks run on every ADD of every window, in both drivers, with no LLM call, and each rejection
is counted by reason in the version's stats (``UpdateStats.skipped``):

- ``near_duplicate``: its content words and those of an existing bullet (or of an earlier ADD
  of the same delta) differ by at most ``NEAR_DUPLICATE_WORDS`` (one word substituted, or two
  added or dropped), whatever their order. Two lessons that differ in a clause, or in a number
  ("monthly ... 12" against "quarterly ... 4"), stay apart; the optional embedding dedup
  catches rewordings beyond that.
- ``restates_task``: most of the bullet's words come from one of the window's tasks
  (``RESTATED`` of its content words) or it repeats a number of four digits or more that the
  task gave: an instance, not a lesson.
- ``too_long``: longer than ``learning.max_bullet_chars`` (a lesson is a rule, not a document:
  one trace must not fill the prompt of every agent of its key).
- ``policy``: it matches a pattern of ``learning.content_policy`` (links, e-mail addresses,
  instructions to ignore rules...: a trace is untrusted, a bullet reaches every agent).
- ``no_lesson``: fewer than ``MIN_WORDS`` content words, or only words of generic advice
  (``GENERIC``: "always double-check the formula and the conventions" teaches nothing a model
  did not already try to do).

The thresholds are the module's constants; a rejected ADD is reported, never silently lost.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from combee_stream.core.playbook import SkipReason, normalize
from combee_stream.schemas import AddOp, Delta, Playbook

NEAR_DUPLICATE_WORDS: Final = 2
RESTATED: Final = 0.75
MIN_WORDS: Final = 4

_STOP: Final = frozenset(
    "a an and are as at be by for from has have if in is it its of on or so that the this to "
    "was were when which with you your should must agent".split()
)
GENERIC: Final = frozenset(
    "always double check checking careful carefully make sure ensure correct correctly right "
    "properly proper formula formulas approach verify reusable lesson accurate accuracy attention "
    "pay read reread task question again work steps step calculation calculations calculate "
    "result results answer appropriate important use using used follow instructions mistake "
    "mistakes avoid error errors convention conventions units data information given problem "
    "solution method methods values value all any each every before after carefully".split()
)
_BIG_NUMBER = re.compile(r"\d[\d,]{3,}(?:\.\d+)?")


def content_words(text: str) -> list[str]:
    return [w for w in normalize(text).split() if w not in _STOP]


def near_duplicates(a: frozenset[str], b: frozenset[str]) -> bool:
    """Whether two bullets' content-word sets differ by at most NEAR_DUPLICATE_WORDS."""
    return len(a ^ b) <= NEAR_DUPLICATE_WORDS


def _numbers(text: str) -> set[str]:
    return {m.replace(",", "") for m in _BIG_NUMBER.findall(text)}


def compile_policy(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    return [re.compile(p, re.IGNORECASE) for p in patterns]


def violates(text: str, policy: Sequence[re.Pattern[str]]) -> bool:
    return any(pattern.search(text) for pattern in policy)


def review_adds(
    playbook: Playbook,
    delta: Delta,
    tasks: Sequence[str],
    *,
    max_chars: int = 2000,
    policy: Sequence[re.Pattern[str]] = (),
) -> dict[int, SkipReason]:
    """Index (among the delta's ADDs) -> why it is rejected, for the ADDs that are."""
    adds = [op for op in delta.operations if isinstance(op, AddOp)]
    existing = [b.content for s in playbook.sections for b in s.bullets]
    exact = {normalize(text) for text in existing}
    kept = [frozenset(content_words(text)) for text in existing]
    task_words = [set(content_words(t)) for t in tasks]
    task_numbers = [_numbers(t) for t in tasks]
    rejected: dict[int, SkipReason] = {}
    for i, add in enumerate(adds):
        if len(add.content) > max_chars:
            rejected[i] = "too_long"
            continue
        if violates(add.content, policy):
            rejected[i] = "policy"
            continue
        norm = normalize(add.content)
        words = content_words(add.content)
        if len(words) < MIN_WORDS or all(w in GENERIC for w in words):
            rejected[i] = "no_lesson"
            continue
        numbers = _numbers(add.content)
        for known_words, known_numbers in zip(task_words, task_numbers, strict=True):
            overlap = sum(1 for w in words if w in known_words) / len(words)
            if overlap >= RESTATED or numbers & known_numbers:
                rejected[i] = "restates_task"
                break
        if i in rejected:
            continue
        if norm in exact:
            continue  # an exact duplicate: apply skips it as such
        bag = frozenset(words)
        if any(near_duplicates(bag, other) for other in kept):
            rejected[i] = "near_duplicate"
            continue
        exact.add(norm)
        kept.append(bag)
    return rejected


__all__ = [
    "GENERIC",
    "MIN_WORDS",
    "NEAR_DUPLICATE_WORDS",
    "RESTATED",
    "compile_policy",
    "content_words",
    "near_duplicates",
    "review_adds",
    "violates",
]
