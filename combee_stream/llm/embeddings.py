"""Embeddings (semantic dedup of bullets): texts in batches, concurrently within the client's
limits, each batch retried by the transport's one loop like any call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import anyio
import openai

from combee_stream.config import EmbeddingsConfig, LLMConfig
from combee_stream.llm.breaker import Breaker
from combee_stream.llm.endpoints import Endpoints
from combee_stream.llm.transport import LLMCallError, Transport, _Again
from combee_stream.llm.types import EMBEDDINGS, RoleUsage
from combee_stream.tokens import estimate_tokens

EMBED_BATCH: Final = 128


async def embed(
    transport: Transport,
    endpoints: Endpoints,
    config: LLMConfig,
    usages: dict[str, RoleUsage],
    texts: Sequence[str],
) -> list[list[float]]:
    """Embed ``texts`` in batches of EMBED_BATCH (concurrently, within the limits), counted
    in ``usages`` under ``embeddings``."""
    if not texts:
        return []
    ec = config.embeddings
    client = endpoints.client(endpoints.endpoint(ec, "llm.embeddings"))
    batches = [list(texts[i : i + EMBED_BATCH]) for i in range(0, len(texts), EMBED_BATCH)]
    results: list[list[list[float]]] = [[] for _ in batches]
    usage = usages.setdefault(EMBEDDINGS, RoleUsage())
    started = anyio.current_time()

    failure: LLMCallError | None = None

    async def run(index: int, batch: list[str]) -> None:
        nonlocal failure
        try:
            results[index] = await _embed_batch(transport, client, ec, config, batch, usage)
        except LLMCallError as exc:
            # Raise the plain error (not an ExceptionGroup) and stop the other batches.
            failure = failure or exc
            tg.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            for index, batch in enumerate(batches):
                tg.start_soon(run, index, batch)
    finally:
        usage.latency_s += anyio.current_time() - started
    if failure is not None:
        raise failure
    return [vector for batch in results for vector in batch]


async def _embed_batch(
    transport: Transport,
    client: openai.AsyncOpenAI,
    ec: EmbeddingsConfig,
    config: LLMConfig,
    batch: list[str],
    usage: RoleUsage,
) -> list[list[float]]:
    estimate = estimate_tokens("".join(batch))

    async def send() -> Any:
        return await client.embeddings.create(model=ec.model, input=batch, timeout=config.timeout_s)

    usage.calls += 1
    breaker: Breaker = transport.breaker(client, ec.model, embeddings=True)

    async def attempt(_: int) -> list[list[float]]:
        response = await transport.send(send, estimate, breaker)
        tokens = getattr(getattr(response, "usage", None), "prompt_tokens", None)
        tokens = tokens if isinstance(tokens, int) else estimate
        transport.rate.settle(estimate, tokens)
        usage.tokens_in += tokens
        data = sorted(response.data, key=lambda item: item.index)
        if len(data) != len(batch):
            usage.invalid_replies += 1
            raise _Again(f"invalid reply: {len(data)} embeddings for {len(batch)} inputs")
        return [list(item.embedding) for item in data]

    try:
        return await transport.attempts(EMBEDDINGS, usage, breaker, attempt)
    except LLMCallError:
        usage.failed_calls += 1
        raise


__all__ = ["EMBED_BATCH", "embed"]
