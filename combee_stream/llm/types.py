"""The LLM layer's vocabulary: the roles, a chat message, a validated reply and what the calls of
a role cost."""

from __future__ import annotations

from typing import Final, Generic, Literal, TypeVar

import msgspec

T = TypeVar("T")

Role = Literal["reflector", "curator", "combiner", "agent", "judge"]

ROLES: Final[tuple[Role, ...]] = ("reflector", "curator", "combiner", "agent", "judge")

EMBEDDINGS: Final = "embeddings"  # the usage() entry for embedding calls

ChatMessage = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}


class Completion(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """A validated reply. Tokens are what *this* call paid: 0 when served from the memo."""

    value: T
    tokens_in: int
    tokens_out: int
    cached: bool  # served from the memo (no request)
    tokens_cached: int = 0  # of tokens_in, served from the server's prompt cache
    attempts: int  # HTTP requests made by this call (0 when cached)
    latency_s: float


class RoleUsage(msgspec.Struct, kw_only=True):
    """Per role accounting. ``calls`` counts complete() calls; cached and failed are subsets."""

    calls: int = 0
    cached_calls: int = 0
    failed_calls: int = 0
    retries: int = 0  # attempts beyond the first, for any reason
    invalid_replies: int = 0  # replies that did not validate against the schema
    truncated_replies: int = 0  # replies cut at max_tokens (finish_reason "length")
    tokens_in: int = 0
    # Prompt tokens the server served from its prompt cache (usage.prompt_tokens_details.
    # cached_tokens, which OpenAI and llama-server fill): a subset of tokens_in.
    tokens_cached: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0  # summed wall time of the calls, waits included


__all__ = ["EMBEDDINGS", "ROLES", "ChatMessage", "Completion", "Role", "RoleUsage"]
