"""Recording one run of an agent as a ``Trace``: the prompt version it ran with and the session
it was served to, its steps, the bullets it cited, its answer and the feedback."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Protocol

from combee_stream.agent.prompts import Prompt
from combee_stream.kafka.producer import TraceProducer
from combee_stream.schemas import Feedback, Step, Trace, utcnow


class Answered(Protocol):
    """What :meth:`RunRecorder.record` reads from an agent's answer: the shape of the example
    agent's (:class:`combee_stream.evaluation.Answer`), or any other with these fields."""

    @property
    def reasoning(self) -> str: ...
    @property
    def expression(self) -> str: ...  # a calculator call ("" for none)
    @property
    def calculator(self) -> str: ...  # its result
    @property
    def output(self) -> str: ...
    @property
    def bullet_ids(self) -> Sequence[str]: ...


class RunRecorder:
    """``run = RunRecorder(prompt, task)``, then ``run.thought(...)``, ``run.tool_call(...)``,
    ``run.observation(...)``, ``run.cite(...)``, and ``await run.send(producer, output=...,
    feedback=...)``. Only cited ids the prompt really carries are kept: a model that invents an
    id cannot credit or blame a bullet it never saw."""

    def __init__(
        self,
        prompt: Prompt,
        task: str,
        *,
        trace_id: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.prompt = prompt
        self.task = task
        self.trace_id = trace_id or uuid.uuid4().hex
        self.metadata = dict(metadata or {})
        self.steps: list[Step] = []
        self.cited: list[str] = []
        self.started_at = utcnow()

    def thought(self, text: str) -> None:
        self.steps.append(Step(kind="thought", content=text))

    def tool_call(self, name: str, arguments: str) -> None:
        self.steps.append(Step(kind="tool_call", name=name, content=arguments))

    def observation(self, name: str, text: str) -> None:
        self.steps.append(Step(kind="observation", name=name, content=text))

    def message(self, text: str) -> None:
        self.steps.append(Step(kind="message", content=text))

    def cite(self, *bullet_ids: str) -> None:
        known = set(self.prompt.bullet_ids)
        for bullet_id in bullet_ids:
            if bullet_id in known and bullet_id not in self.cited:
                self.cited.append(bullet_id)

    def record(self, answer: Answered) -> None:
        """The steps of an answer shaped like the example agent's (reasoning, calculator,
        answer) and the bullets it cited."""
        if answer.reasoning:
            self.thought(answer.reasoning)
        if answer.expression:
            self.tool_call("calculator", answer.expression)
            self.observation("calculator", answer.calculator)
        self.message(answer.output)
        self.cite(*answer.bullet_ids)

    def trace(self, *, output: str, feedback: Feedback) -> Trace:
        return Trace(
            key=self.prompt.key,
            trace_id=self.trace_id,
            task=self.task,
            feedback=feedback,
            output=output,
            steps=list(self.steps),
            # A fallback prompt (-1) is what the key's version 0 means: nothing learned yet.
            prompt_version=max(0, self.prompt.version),
            session=self.prompt.session,
            bullet_ids=list(self.cited),
            started_at=self.started_at,
            finished_at=utcnow(),
            metadata=self.metadata,
        )

    async def send(self, producer: TraceProducer, *, output: str, feedback: Feedback) -> Trace:
        trace = self.trace(output=output, feedback=feedback)
        await producer.send(trace)
        return trace


__all__ = ["Answered", "RunRecorder"]
