"""Lesson markers ``LESSON[<id>]: <text>``: how simulated traces carry lessons in their feedback
text, and how the simulator (from the trace text it is shown) and the scorer recognise them. The
product's prompts know nothing of them."""

from __future__ import annotations

import re
from collections.abc import Iterable

from msgspec import Struct

from combee_stream.schemas import Playbook

# The text runs to the end of the line; ``[ \t]`` (not ``\s``) so it never crosses a newline.
_MARKER = re.compile(r"LESSON\[([A-Za-z0-9_.-]+)\]:[ \t]*([^\r\n]*)")
_MENTION = re.compile(r"LESSON\[([A-Za-z0-9_.-]+)\]")


class Lesson(Struct, frozen=True):
    id: str
    text: str

    @property
    def line(self) -> str:
        return marker_line(self.id, self.text)


def marker_line(lesson_id: str, text: str) -> str:
    return f"LESSON[{lesson_id}]: {text}"


def find_lessons(text: str) -> list[Lesson]:
    """Every marker in ``text``, in order (duplicates kept)."""
    return [Lesson(m.group(1), m.group(2).rstrip()) for m in _MARKER.finditer(text)]


def distinct(lessons: Iterable[Lesson]) -> list[Lesson]:
    """First occurrence of each lesson id, in order."""
    seen: dict[str, Lesson] = {}
    for lesson in lessons:
        seen.setdefault(lesson.id, lesson)
    return list(seen.values())


def mentions(text: str, lesson_id: str) -> bool:
    """Whether ``text`` carries the marker of ``lesson_id`` (bracketed, so k0-l1 != k0-l10)."""
    return f"LESSON[{lesson_id}]" in text


VARIANT = ".v"  # ``<lesson>.v<n>``: the same lesson worded another way (a near-duplicate)


def base_id(lesson_id: str) -> str:
    """The lesson a variant id words (the id itself when it is no variant)."""
    head, sep, tail = lesson_id.rpartition(VARIANT)
    return head if sep and tail.isdigit() else lesson_id


def mentions_lesson(text: str, lesson_id: str) -> bool:
    """Whether ``text`` carries ``lesson_id`` or one of its variants."""
    return mentions(text, lesson_id) or f"LESSON[{lesson_id}{VARIANT}" in text


def retained_ids(playbook: Playbook) -> set[str]:
    """Ids of the lessons a playbook retains: those whose marker occurs in one of its bullets."""
    return {
        match.group(1)
        for section in playbook.sections
        for bullet in section.bullets
        for match in _MENTION.finditer(bullet.content)
    }


__all__ = [
    "VARIANT",
    "Lesson",
    "base_id",
    "distinct",
    "find_lessons",
    "marker_line",
    "mentions",
    "mentions_lesson",
    "retained_ids",
]
