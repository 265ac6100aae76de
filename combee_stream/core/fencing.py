"""Fencing untrusted text before it goes into a prompt.

Trace fields, bullets and reflections are untrusted: they come from agents, their users and
their tools, and they end up in LLM prompts (and, learned, in other agents' system prompts).
The prompts delimit them with blocks whose tags sit alone on a line (``<trace>`` ...
``</trace>``) and with ``field: value`` lines. :func:`fence` makes sure a value can end neither:

- every one of the prompts' block tags inside the text becomes ``‹tag›`` (it can no longer
  open or close a block, and reads the same to a model);
- every line of the text after its first is indented with ``  | ``, so no line of it can stand
  alone as a tag or pass for a field of its own (``passed: true``, ``ground_truth: ...``).
  A line ends where ``str.splitlines()`` ends one (``\r``, ``\v``, ``\f``, U+0085, U+2028,
  U+2029, ...): a model, an editor or a log viewer may break there; each becomes ``\n``.
"""

from __future__ import annotations

import re
from typing import Final

BLOCKS: Final = (
    "playbook",
    "bullets_used",
    "trace",
    "reflections",
    "partial_updates",
    "question",
    "section_bullets",
    "task",
    "reference",
    "judged_answer",
)
CONTINUATION: Final = "  | "
_TAG = re.compile(r"<\s*(/?)\s*(" + "|".join(BLOCKS) + r")\s*>", re.IGNORECASE)
# What str.splitlines() splits on (it drops a final break, which must stay fenced too).
_LINE_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def fence(text: str) -> str:
    """``text`` made safe to put inside a block or after a ``field:`` of a prompt."""
    text = _TAG.sub(lambda m: f"‹{m.group(1)}{m.group(2)}›", text)
    lines = _LINE_BREAK.split(text)
    return "\n".join([lines[0], *(CONTINUATION + line for line in lines[1:])])


__all__ = ["BLOCKS", "CONTINUATION", "fence"]
