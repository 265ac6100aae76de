"""The example agent: answers a task with the playbook as its system prompt, as ACE's generator
does. It reasons first, names the playbook bullets it used, and writes an arithmetic expression
that its calculator evaluates (the answer is the expression's value; when it writes none, its
own final answer). One structured LLM call per task, through any OpenAI-compatible endpoint
(the ``agent`` role of the LLM layer).
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from msgspec import Struct

from combee_stream.core.fencing import fence
from combee_stream.evaluation.calculator import CalculatorError, evaluate
from combee_stream.llm import ChatMessage, LLMClient

# Every arm sends this same system message, the playbook empty or not: with no system message
# a chat template adds its own default one (Qwen's does), and the base arm would then differ
# from the learned arms in more than the playbook.
# Stable first, variable last (issue 17): the instructions come before the playbook and the
# question comes alone in the user turn, so a prompt cache (llama-server's slots and host cache,
# a hosted API's prompt caching) reuses the instructions across playbooks: the lesson check and
# the replay gate ask the same tasks under several playbooks at once. With the instructions
# after the playbook (as before 2026-12-07), only about 30 tokens of each agent prompt came
# before the first byte that differs between two playbooks.
SYSTEM: Final = """\
You answer questions exactly, with a calculator. Your playbook holds lessons learned from \
earlier tasks of this kind: use them where they apply.

For each question:
1. In "reasoning", work out step by step which formula and which conventions apply (units, \
percent or fraction, periods, signs, rounding), and how the playbook's lessons apply.
2. In "bullet_ids", list the ids of the playbook bullets you used (such as "calc-00012"); an \
empty list if none.
3. In "expression", write one arithmetic expression that computes the answer, using numbers, \
+ - * / ** ( ) and round, abs, min, max, ceil, floor, sqrt, log, exp. A calculator evaluates \
it exactly: do not compute it yourself. Leave it empty when the answer is not a number.
4. In "final_answer", give the answer itself (the number, or the text asked for).

<playbook>
{playbook}
</playbook>"""
EMPTY_PLAYBOOK: Final = "(empty: no lessons learned yet)"

QUESTION: Final = """\
Answer this question.

<question>
{question}
</question>"""

# Names the templates above: answers saved by a benchmark under other templates are not reused.
TEMPLATE_DIGEST: Final = hashlib.sha256(f"{SYSTEM}\n{QUESTION}".encode()).hexdigest()[:12]


class AgentOutput(Struct):
    """What the agent must return (its JSON Schema is sent as the response format)."""

    reasoning: str
    bullet_ids: list[str]
    expression: str
    final_answer: str


class Answer(Struct, frozen=True, kw_only=True):
    output: str  # the answer the agent gives (the calculator's result when it wrote one)
    reasoning: str
    bullet_ids: list[str]  # cited bullets that the prompt really carries
    expression: str = ""
    calculator: str = ""  # the calculator's result, or its error
    tokens_in: int = 0
    tokens_out: int = 0


_BULLET_ID = re.compile(r"^\[([^\]\s]+)\]", re.MULTILINE)


def bullet_ids_of(prompt: str) -> set[str]:
    """Ids of the bullets a rendered prompt carries (``[id] helpful=... :: text`` lines)."""
    return set(_BULLET_ID.findall(prompt))


def system_message(system_prompt: str) -> str:
    """The agent's system message for a rendered playbook: two prompts with the same one are
    the same agent (an empty playbook's is the base prompt's)."""
    return SYSTEM.format(playbook=system_prompt.strip() or EMPTY_PLAYBOOK)


def calculate(expression: str) -> str:
    """The answer the agent gives for ``expression``: the calculator's value, as the scorers
    read it. CalculatorError when the calculator refuses it."""
    return f"{evaluate(expression):.10g}"


class Answerer:
    """``await Answerer(llm).answer(system_prompt, question)``."""

    def __init__(self, llm: LLMClient) -> None:
        self._llm = llm

    def messages(self, system_prompt: str, question: str) -> list[ChatMessage]:
        # The question is untrusted text too: it cannot end its block.
        return [
            {"role": "system", "content": system_message(system_prompt)},
            {"role": "user", "content": QUESTION.format(question=fence(question))},
        ]

    async def answer(self, system_prompt: str, question: str) -> Answer:
        completion = await self._llm.complete(
            "agent", self.messages(system_prompt, question), AgentOutput
        )
        out = completion.value
        known = bullet_ids_of(system_prompt)
        cited = [b for b in dict.fromkeys(out.bullet_ids) if b in known]
        result, output = "", out.final_answer.strip()
        if out.expression.strip():
            try:
                result = output = calculate(out.expression)
            except CalculatorError as exc:
                result = f"error: {exc}"
        return Answer(
            output=output,
            reasoning=out.reasoning,
            bullet_ids=cited,
            expression=out.expression,
            calculator=result,
            tokens_in=completion.tokens_in,
            tokens_out=completion.tokens_out,
        )


__all__ = [
    "EMPTY_PLAYBOOK",
    "QUESTION",
    "SYSTEM",
    "TEMPLATE_DIGEST",
    "AgentOutput",
    "Answer",
    "Answerer",
    "bullet_ids_of",
    "calculate",
    "system_message",
]
