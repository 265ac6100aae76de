"""Agent side of OpenTelemetry ingest: stamp the prompt an agent serves on every span it starts.

``combee-stream ingest otel`` keys a trace by ``combee.prompt.key`` and learns it as feedback on
``combee.prompt.version`` (see :mod:`combee_stream.formats.genai`). Add the processor to the
agent's tracer provider, following the prompt it serves::

    provider.add_span_processor(PromptSpanProcessor.following(prompt_client))

or with a fixed key and a version callable: ``PromptSpanProcessor("support-bot", lambda: v)``.
The bullets the agent used on a task are best set on its root span, once it knows them:
``span.set_attribute(BULLET_IDS_ATTRIBUTE, answer.bullet_ids)``.

Needs ``opentelemetry-sdk`` (``pip install 'combee-stream[otel]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Protocol

try:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace import Span as SdkSpan
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "combee_stream.otel needs the OpenTelemetry SDK: pip install 'combee-stream[otel]' "
        "(or opentelemetry-sdk)"
    ) from exc

KEY_ATTRIBUTE: Final = "combee.prompt.key"
VERSION_ATTRIBUTE: Final = "combee.prompt.version"
SESSION_ATTRIBUTE: Final = "combee.session.id"
BULLET_IDS_ATTRIBUTE: Final = "combee.bullet_ids"


class _Prompt(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def version(self) -> int: ...


class _Follows(Protocol):
    """What ``PromptClient`` offers: the prompt it serves now."""

    def current(self) -> _Prompt: ...


class PromptSpanProcessor(SpanProcessor):
    """Sets ``combee.prompt.key`` and ``combee.prompt.version`` (read when the span starts, so a
    span names the version that was served then), ``combee.session.id`` when a session is given
    (the live canary counts a trace only for the version its session was served), and
    ``combee.bullet_ids`` when a ``bullet_ids`` callable is given and returns some, on every
    span started."""

    def __init__(
        self,
        key: str,
        version: Callable[[], int] | int = 0,
        *,
        bullet_ids: Callable[[], Sequence[str]] | None = None,
        session: str | None = None,
    ) -> None:
        if not key:
            raise ValueError("the prompt key must not be empty")
        self.key = key
        self._version = version if callable(version) else (lambda: version)
        self._bullet_ids = bullet_ids
        self._session = session

    @classmethod
    def following(cls, client: _Follows) -> PromptSpanProcessor:
        """Stamp the key, version and session that ``client.current()`` (a ``PromptClient``)
        serves."""
        served = client.current()
        session = getattr(served, "session", None)  # (a Prompt has it; a stand-in may not)
        return cls(served.key, lambda: client.current().version, session=session)

    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        span.set_attribute(KEY_ATTRIBUTE, self.key)
        span.set_attribute(VERSION_ATTRIBUTE, self._version())
        if self._session:
            span.set_attribute(SESSION_ATTRIBUTE, self._session)
        if self._bullet_ids is not None and (ids := list(self._bullet_ids())):
            span.set_attribute(BULLET_IDS_ATTRIBUTE, ids)

    def on_end(self, span: ReadableSpan) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


__all__ = [
    "BULLET_IDS_ATTRIBUTE",
    "KEY_ATTRIBUTE",
    "SESSION_ATTRIBUTE",
    "VERSION_ATTRIBUTE",
    "PromptSpanProcessor",
]
