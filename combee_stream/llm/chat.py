"""One structured chat call, attempt by attempt: the request in the role's mode, the reply read
and validated, and what a reply the call cannot use leads to.

A reply that does not validate is re-asked with the model's own bad reply and the error. A reply
cut at ``max_tokens`` (``finish_reason`` "length") is its own outcome: it is not re-asked as an
invalid reply with the same cap (that would only be cut again), but sent once more with twice
the cap; a second cut fails the call. A request that failed for good and is asked again (a
retried window) is sent at a higher temperature and another seed: identical requests would only
fail identically.
"""

from __future__ import annotations

from typing import Any, Final, Generic, TypeVar, cast

import msgspec
import openai
from openai.types.chat import ChatCompletionMessageParam

from combee_stream.config import RoleConfig
from combee_stream.llm.structured import (
    _InvalidReply,
    decode_reply,
    extract_json,
    max_tokens_for,
    reask,
    response_format,
    schema_instruction,
    with_instruction,
)
from combee_stream.llm.transport import Transport, _Again, _GiveUp
from combee_stream.llm.types import ChatMessage, RoleUsage
from combee_stream.logs import get_logger
from combee_stream.tokens import estimate_tokens

log = get_logger(__name__)

T = TypeVar("T")

# Added to a role's temperature each time the very same request failed for good before.
RETRY_WARMING: Final = 0.3


class Sampling(msgspec.Struct, frozen=True):
    temperature: float
    seed: int | None
    max_tokens: int | None  # None: no cap sent (an unbounded schema)


class Reply(msgspec.Struct, frozen=True):
    text: str
    finish_reason: str
    tokens_in: int
    tokens_out: int
    tokens_cached: int


class Sent(msgspec.Struct):
    """A validated value and what every attempt of its call paid."""

    value: Any
    tokens_in: int
    tokens_out: int
    tokens_cached: int
    attempts: int


class ChatCall(Generic[T]):
    """The attempts of one call of ``role`` for a reply of ``output_type`` (its ``schema``):
    :meth:`attempt` is what :meth:`Transport.attempts` runs. ``retry``: how often this very
    request already failed for good (it is then sent warmer and with another seed)."""

    def __init__(
        self,
        transport: Transport,
        client: openai.AsyncOpenAI,
        role: str,
        rc: RoleConfig,
        messages: list[ChatMessage],
        output_type: type[T],
        schema: dict[str, Any],
        usage: RoleUsage,
        *,
        timeout_s: float,
        retry: int = 0,
    ) -> None:
        self._transport = transport
        self._client = client
        self._role = role
        self._rc = rc
        self._output_type = output_type
        self._usage = usage
        self._timeout_s = timeout_s
        self.breaker = transport.breaker(client, rc.model)
        self._request = list(messages)
        self._format = response_format(rc.mode, output_type.__name__, schema)
        if self._format is None:
            self._request = with_instruction(self._request, schema_instruction(schema))
        self._sampling = Sampling(
            temperature=min(1.0, rc.temperature + RETRY_WARMING * retry),
            seed=retry or None,
            max_tokens=max_tokens_for(rc, schema),
        )
        self._conversation = self._request
        self._spent = Sent(value=None, tokens_in=0, tokens_out=0, tokens_cached=0, attempts=0)
        self._widened = False

    async def attempt(self, attempt: int) -> Sent:
        rc, usage, sampling = self._rc, self._usage, self._sampling
        reply = await self._send()
        spent = self._spent
        spent.tokens_in += reply.tokens_in
        spent.tokens_out += reply.tokens_out
        spent.tokens_cached += reply.tokens_cached
        usage.tokens_in += reply.tokens_in
        usage.tokens_out += reply.tokens_out
        usage.tokens_cached += reply.tokens_cached
        usage.cost_usd += (reply.tokens_in * rc.price_in + reply.tokens_out * rc.price_out) / 1e6
        if reply.finish_reason == "length":
            # Cut at the cap: the same request would be cut again. Once more with twice
            # the room; a reply that does not fit that either fails the call.
            usage.truncated_replies += 1
            log.warning(
                "llm.reply_cut", role=self._role, attempt=attempt, max_tokens=sampling.max_tokens
            )
            reason = f"reply cut at max_tokens={sampling.max_tokens}"
            if self._widened or sampling.max_tokens is None:  # None: the server's own limit
                raise _GiveUp(reason)
            self._widened = True
            self._sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens * 2)
            raise _Again(reason)
        try:
            text = extract_json(reply.text) if rc.mode == "text" else reply.text
            value = decode_reply(text, self._output_type)
        except (_InvalidReply, msgspec.DecodeError) as exc:
            usage.invalid_replies += 1
            log.warning("llm.invalid_reply", role=self._role, attempt=attempt, error=str(exc)[:300])
            # Keep only the latest bad reply so the conversation does not grow per attempt.
            self._conversation = [
                *self._request,
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": reask(str(exc))},
            ]
            raise _Again(f"invalid reply: {exc}") from None
        return Sent(
            value=value,
            tokens_in=spent.tokens_in,
            tokens_out=spent.tokens_out,
            tokens_cached=spent.tokens_cached,
            attempts=attempt,
        )

    async def _send(self) -> Reply:
        """One HTTP request and what it returned."""
        client, rc, sampling = self._client, self._rc, self._sampling
        conversation = self._conversation
        estimate = estimate_tokens("".join(m.get("content", "") for m in conversation))
        extra_body = {"response_format": self._format} if self._format else None

        async def send() -> Any:
            return await client.chat.completions.create(
                model=rc.model,
                messages=cast("list[ChatCompletionMessageParam]", conversation),
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens if sampling.max_tokens is not None else openai.omit,
                seed=sampling.seed if sampling.seed is not None else openai.omit,
                extra_body=extra_body,
                timeout=self._timeout_s,
            )

        response = await self._transport.send(send, estimate, self.breaker)
        usage = getattr(response, "usage", None)
        choices = getattr(response, "choices", None) or []
        message = getattr(choices[0], "message", None) if choices else None
        finish = getattr(choices[0], "finish_reason", None) if choices else None
        reply = getattr(message, "content", None)
        if not isinstance(reply, str):
            reply = ""
        tokens_in = getattr(usage, "prompt_tokens", None)
        tokens_out = getattr(usage, "completion_tokens", None)
        tokens_in = tokens_in if isinstance(tokens_in, int) else estimate
        tokens_out = tokens_out if isinstance(tokens_out, int) else estimate_tokens(reply)
        cached = cached_tokens(response, usage)
        self._transport.rate.settle(estimate, tokens_in + tokens_out)
        return Reply(
            text=reply,
            finish_reason=finish if isinstance(finish, str) else "",
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            tokens_cached=min(cached, tokens_in) if isinstance(cached, int) else 0,
        )


def cached_tokens(response: object, usage: object) -> int | None:
    """Prompt tokens the server served from its cache: OpenAI's (and newer llama-server's)
    ``usage.prompt_tokens_details.cached_tokens``, else llama-server's own ``timings.cache_n``
    (an extra field the SDK keeps)."""
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    if isinstance(cached, int):
        return cached
    timings = (getattr(response, "model_extra", None) or {}).get("timings")
    cached = timings.get("cache_n") if isinstance(timings, dict) else None
    return cached if isinstance(cached, int) else None


__all__ = ["RETRY_WARMING", "ChatCall", "Reply", "Sampling", "Sent", "cached_tokens"]
