"""The LLM layer: typed, rate-limited, retried, memoized calls to OpenAI-compatible endpoints.

One ``openai.AsyncOpenAI`` per endpoint, model and endpoint per role. The modules, each with
one job:

- ``client``: :class:`LLMClient`, the facade (``complete``, ``embed``, ``check``, ``usage``);
- ``structured``: the JSON Schema of a reply per endpoint mode, its bounds and token cap, and
  reading a reply back; ``chat``: one structured call, attempt by attempt;
- ``transport``: every request under the limits and its endpoint's breaker, and the one retry
  loop; ``status``: what an HTTP failure means (the status table); ``ratelimit``: requests and
  tokens per minute, Retry-After; ``breaker``: the circuit breaker per endpoint and model;
- ``checks``: the start checks; ``embeddings``: batched embeddings; ``endpoints``: where each
  role's calls go; ``memo``: the completion memo; ``types``: roles, messages, replies, usage.
"""

from combee_stream.llm.client import LLMClient
from combee_stream.llm.endpoints import MissingEndpointError
from combee_stream.llm.transport import LLMCallError
from combee_stream.llm.types import EMBEDDINGS, ROLES, ChatMessage, Completion, Role, RoleUsage

__all__ = [
    "EMBEDDINGS",
    "ROLES",
    "ChatMessage",
    "Completion",
    "LLMCallError",
    "LLMClient",
    "MissingEndpointError",
    "Role",
    "RoleUsage",
]
