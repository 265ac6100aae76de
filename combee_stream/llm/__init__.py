"""The LLM layer: typed, rate-limited, retried, memoized calls to OpenAI-compatible endpoints.
Import its modules directly (``llm.client`` is the facade)."""

__all__: list[str] = []
