"""The learner's LLM calls, each counted in its window's stats by the kind of prompt it sends.

The reflector, the curators, the combiner, the consolidator and the exemplifier all go through
one :class:`LearnerCalls`, so a window's ``WindowStats`` says what every kind cost (calls,
memo hits, tokens) whichever step of the learner made them. The consolidator and the
exemplifier have no endpoint of their own: they are calls to the curator's (a team that gives
the curator a stronger model gives it to them too).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

from combee_stream.config import LearningConfig
from combee_stream.core.prompts import PromptRole, Prompts
from combee_stream.core.results import WindowStats
from combee_stream.llm import ChatMessage, Completion, Role

T = TypeVar("T")


class LLM(Protocol):
    """What the learner needs from :class:`combee_stream.llm.LLMClient`."""

    async def complete(
        self, role: Role, messages: list[ChatMessage], output_type: type[T]
    ) -> Completion[T]: ...


# The WindowStats counter of each kind of learner call.
_COUNTERS: Final[dict[PromptRole, str]] = {
    "reflector": "reflector_calls",
    "curator": "curator_calls",
    "combiner": "combiner_calls",
    "consolidator": "consolidator_calls",
    "exemplifier": "example_calls",
}


class LearnerCalls:
    """``await calls(kind, messages, OutputType, stats)``: one structured call, counted."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    async def __call__(
        self,
        kind: PromptRole,
        messages: list[ChatMessage],
        output_type: type[T],
        stats: WindowStats,
    ) -> T:
        stats.llm_calls += 1
        counter = _COUNTERS[kind]
        setattr(stats, counter, getattr(stats, counter) + 1)
        role: Role = kind if kind in ("reflector", "curator", "combiner") else "curator"
        completion = await self._llm.complete(role, messages, output_type)
        stats.cached_calls += int(completion.cached)
        stats.tokens_in += completion.tokens_in
        stats.tokens_out += completion.tokens_out
        return completion.value


@dataclass(frozen=True, slots=True)
class CurationContext:
    """What the steps that call the curator's endpoint besides the curators work with (the
    exemplifier, the consolidator): the counted calls, the learner's settings and prompts, its
    content policy, and the longest string the curator's reply grammar allows (0: none)."""

    calls: LearnerCalls
    learning: LearningConfig
    prompts: Prompts
    policy: Sequence[re.Pattern[str]]
    bound: int = 0


__all__ = ["LLM", "CurationContext", "LearnerCalls"]
