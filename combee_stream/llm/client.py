"""The LLM client: typed, rate-limited, retried, memoized calls to OpenAI-compatible endpoints.

``LLMClient.complete(role, messages, OutputType)`` sends one chat request with the role's model
and endpoint, asks for JSON matching ``msgspec.json.schema(OutputType)`` (per role ``mode``:
:mod:`~combee_stream.llm.structured`), validates the reply with msgspec and re-asks the model
with its own bad reply and the error when it does not validate (:mod:`~combee_stream.llm.chat`).
Every request goes through the :mod:`~combee_stream.llm.transport` (limits, breakers, the one
retry loop); :meth:`LLMClient.check` runs the start checks (:mod:`~combee_stream.llm.checks`),
:meth:`LLMClient.embed` the embeddings (:mod:`~combee_stream.llm.embeddings`). Every finished
call is stored in a ``CompletionMemo``, so the same request is never paid twice.

``max_tokens`` 0 (the default) is derived from the schema's bounds
(:func:`~combee_stream.llm.structured.schema_token_bound`), so a bounded role's worst case
always fits.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Literal, Self, TypeVar

import anyio
import httpx2
import msgspec

from combee_stream.config import LLMConfig
from combee_stream.llm import checks
from combee_stream.llm.chat import ChatCall
from combee_stream.llm.embeddings import embed
from combee_stream.llm.endpoints import Endpoints
from combee_stream.llm.memo import CompletionMemo, MemoEntry, endpoint_identity, request_key
from combee_stream.llm.structured import bound_schema, output_schema
from combee_stream.llm.transport import LLMCallError, Transport
from combee_stream.llm.types import ROLES, ChatMessage, Completion, Role, RoleUsage
from combee_stream.retry import RetryPolicy

T = TypeVar("T")

_MAX_FAILED_KEYS: Final = 10_000


class LLMClient:
    """One client for all roles; safe to share between concurrent tasks of one event loop."""

    def __init__(
        self,
        config: LLMConfig,
        *,
        http_client: httpx2.AsyncClient | None = None,
        env: Mapping[str, str] | None = None,
        memo: CompletionMemo | None = None,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._endpoints = Endpoints(config, os.environ if env is None else env, http_client)
        self._owns_memo = memo is None
        self._memo = (
            memo
            if memo is not None
            else CompletionMemo(config.memo_path or None, max_entries=config.memo_max_entries)
        )
        self._transport = Transport(config, retry or RetryPolicy(), rng or random.Random())
        self._usage: dict[str, RoleUsage] = {role: RoleUsage() for role in ROLES}
        self._schemas: dict[type[Any], dict[str, Any]] = {}  # msgspec's schema costs ~0.3 ms
        self._failed: dict[str, int] = {}  # request key -> times it failed for good
        self._closed = False

    @property
    def outage(self) -> bool:
        """Whether an endpoint of this client is down (its circuit breaker is open)."""
        return self._transport.outage

    async def probe(self) -> None:
        """Probe each endpoint whose breaker is open, at its next probe slot: an answer that is
        not an outage failure closes it. Callers waiting in the breaker probe it themselves;
        this is for when none is left. The engine calls it while intake is paused for an
        outage: once the calls that saw the endpoint down are gone (cancelled with a revoked
        partition, or all timed out at once in a process frozen and thawed), nothing else would
        ever find out that it is back."""
        await self._transport.probe()

    @property
    def memo(self) -> CompletionMemo:
        return self._memo

    def require(self, *roles: Role | Literal["embeddings"]) -> None:
        """Fail fast (MissingEndpointError) if any of ``roles`` has no endpoint."""
        checks.require(self._endpoints, self._config, roles)

    async def check(self, *roles: Role | Literal["embeddings"]) -> None:
        """Before any real work: every endpoint of ``roles`` answers, accepts its key and
        serves its model. Raises UserError with one line naming the setting to fix (a mistyped
        base_url or an unset key variable would otherwise fail every trace, one by one)."""
        await checks.check(self._endpoints, self._config, roles)

    # ---------------------------------------------------------------- calls

    async def complete(
        self, role: Role, messages: list[ChatMessage], output_type: type[T]
    ) -> Completion[T]:
        """One structured call; raises LLMCallError when it cannot get a valid reply."""
        rc = self._endpoints.role_config(role)
        endpoint = self._endpoints.endpoint(rc, f"llm.{role}")
        schema = self._schemas.get(output_type)
        if schema is None:
            schema = self._schemas[output_type] = output_schema(output_type)
        if rc.max_string_chars or rc.max_list_items:
            schema = bound_schema(schema, rc.max_string_chars, rc.max_list_items)
        key = request_key(
            {
                "role": role,
                "model": rc.model,
                "base_url": endpoint_identity(endpoint.base_url),
                "temperature": rc.temperature,
                "max_tokens": rc.max_tokens,
                "mode": rc.mode,
                "messages": messages,
                "schema": schema,
            }
        )
        usage = self._usage[role]
        started = anyio.current_time()
        attempts = 0
        cached_tokens = 0
        # A request that already failed for good in this client (a retried window) is varied:
        # the same request would only fail the same way (temperature 0 is deterministic).
        retry = self._failed.get(key, 0)

        async def compute() -> MemoEntry:
            nonlocal attempts, cached_tokens
            call = ChatCall(
                self._transport, self._endpoints.client(endpoint), role, rc, messages,
                output_type, schema, usage, timeout_s=self._config.timeout_s, retry=retry,
            )  # fmt: skip
            sent = await self._transport.attempts(role, usage, call.breaker, call.attempt)
            attempts, cached_tokens = sent.attempts, sent.tokens_cached
            return MemoEntry(
                key=key,
                role=role,
                model=rc.model,
                value=msgspec.Raw(msgspec.json.encode(sent.value)),
                tokens_in=sent.tokens_in,
                tokens_out=sent.tokens_out,
            )

        try:
            entry, hit = await self._memo.get_or_compute(key, compute)
        except LLMCallError:
            self._failed[key] = retry + 1
            if len(self._failed) > _MAX_FAILED_KEYS:  # parked for good: forget the oldest
                del self._failed[next(iter(self._failed))]
            usage.calls += 1
            usage.failed_calls += 1
            usage.latency_s += anyio.current_time() - started
            raise
        self._failed.pop(key, None)
        latency = anyio.current_time() - started
        usage.calls += 1
        usage.latency_s += latency
        if hit:
            usage.cached_calls += 1
        value = msgspec.json.decode(entry.value, type=output_type)
        return Completion(
            value=value,
            tokens_in=0 if hit else entry.tokens_in,
            tokens_out=0 if hit else entry.tokens_out,
            cached=hit,
            tokens_cached=0 if hit else cached_tokens,
            attempts=0 if hit else attempts,
            latency_s=latency,
        )

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Embed ``texts`` in batches (concurrently, within the limits)."""
        if not texts:
            return []
        return await embed(self._transport, self._endpoints, self._config, self._usage, texts)

    # ---------------------------------------------------------------- accounting, lifecycle

    def usage(self) -> dict[str, RoleUsage]:
        """A snapshot per role (plus ``embeddings`` once used); safe to keep and serialize."""
        return {name: msgspec.structs.replace(u) for name, u in self._usage.items()}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._endpoints.aclose()
        if self._owns_memo:
            self._memo.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


__all__ = ["LLMClient"]
