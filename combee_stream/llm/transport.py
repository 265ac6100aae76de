"""Transport: every request of a client goes through here, whatever its kind (chat, embeddings,
a breaker's probe), under the concurrency limit, the rate limits and its endpoint's circuit
breaker; and every call's attempts run in the one retry loop, :meth:`Transport.attempts`.

Transport failures (429, 5xx, timeouts, connection errors) are retried with exponential backoff
and full jitter (the one :class:`~combee_stream.retry.RetryPolicy`); a reply the call cannot use
(it does not validate, it was cut) spends an attempt too, and all of them share one
``llm.max_attempts`` budget. A failure every call would meet alike is an outage (see
:func:`~combee_stream.llm.status.status_kind`): the endpoint's circuit breaker
(:mod:`~combee_stream.llm.breaker`) makes callers wait for it instead of spending attempts.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Final, NoReturn, TypeVar

import anyio
import openai

from combee_stream.config import LLMConfig
from combee_stream.errors import CombeeError
from combee_stream.llm.breaker import Breaker
from combee_stream.llm.ratelimit import RateLimiter
from combee_stream.llm.status import _Fatal, _Transient, retry_after, short, status_kind
from combee_stream.llm.types import RoleUsage
from combee_stream.logs import get_logger
from combee_stream.retry import RetryPolicy

log = get_logger(__name__)

R = TypeVar("R")

PROBE_TEXT: Final = "ping"  # the breaker's probe: a 1-token request for the same model


class LLMCallError(CombeeError):
    """An LLM call failed for good: attempts exhausted, or a non-retryable HTTP error."""

    def __init__(self, role: str, reason: str, attempts: int) -> None:
        super().__init__(f"LLM call for role {role!r} failed after {attempts} attempt(s): {reason}")
        self.role = role
        self.reason = reason
        self.attempts = attempts


class _Again(Exception):
    """An attempt's reply the call cannot use (invalid, cut at its cap): the next attempt, at
    once (the server answered; backing off would not change the reply)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _GiveUp(_Again):
    """An attempt's reply after which another attempt cannot succeed: the call fails now."""


class Transport:
    """The limits, the breakers and the retry loop of one client's calls."""

    def __init__(self, config: LLMConfig, retry: RetryPolicy, rng: random.Random) -> None:
        self._config = config
        self._retry = retry
        self._rng = rng
        self._limiter = anyio.CapacityLimiter(config.concurrency)
        self.rate = RateLimiter(config.requests_per_minute, config.tokens_per_minute)
        # One per endpoint client and model (a removed model is an outage of its calls only),
        # with the probe that finds it back.
        self.breakers: dict[tuple[object, str], Breaker] = {}
        self._probes: dict[Breaker, Callable[[], Awaitable[object]]] = {}

    # ---------------------------------------------------------------- breakers

    def breaker(self, client: openai.AsyncOpenAI, model: str, embeddings: bool = False) -> Breaker:
        breaker = self.breakers.get((client, model))
        if breaker is None:
            breaker = self.breakers[client, model] = Breaker(self._config.breaker_threshold)
            timeout = self._config.timeout_s

            # A tiny request for the same model with the same key: what every call needs. (The
            # model list would not do: it answers while a removed model's calls all fail.)
            async def probe() -> object:
                if embeddings:
                    return await client.embeddings.create(
                        model=model, input=[PROBE_TEXT], timeout=timeout
                    )
                return await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": PROBE_TEXT}],
                    max_tokens=1,
                    timeout=timeout,
                )

            self._probes[breaker] = probe
        return breaker

    @property
    def outage(self) -> bool:
        """Whether an endpoint is down (its circuit breaker is open)."""
        return any(b.open for b in self.breakers.values())

    async def probe(self) -> None:
        """Probe each endpoint whose breaker is open, at its next probe slot (see
        :meth:`combee_stream.llm.client.LLMClient.probe`)."""
        for breaker in list(self.breakers.values()):
            if breaker.open and await breaker.admit():
                await self._probe(breaker)

    async def _probe(self, breaker: Breaker) -> None:
        """Send the breaker's probe (this caller holds its probe slot) and report the outcome.
        A probe, not the caller's own request: a huge request that times out would keep the
        breaker open however healthy the endpoint is."""
        started = anyio.current_time()
        try:
            await self._send_once(self._probes[breaker], 1)
        except _Transient as exc:
            if exc.outage:
                breaker.failed(exc.reason, since=started)
                return
        except _Fatal:
            pass  # an answer: the endpoint is up (a server may refuse max_tokens=1, say)
        except BaseException:
            breaker.abandoned()
            raise
        breaker.answered()

    # ---------------------------------------------------------------- one request

    async def send(self, send: Callable[[], Awaitable[R]], estimate: int, breaker: Breaker) -> R:
        """Run one request under the endpoint's circuit breaker, the concurrency and rate
        limits; classify its failure (:class:`_Transient` or :class:`_Fatal`)."""
        while await breaker.admit():  # waits while the endpoint is down (not holding a slot)
            await self._probe(breaker)  # this caller's turn to probe it
        started = anyio.current_time()
        try:
            result = await self._send_once(send, estimate)
        except _Transient as exc:
            if exc.outage:
                breaker.failed(exc.reason, since=started)
            else:
                breaker.answered()
            raise
        except _Fatal:
            breaker.answered()
            raise
        breaker.answered()
        return result

    async def _send_once(self, send: Callable[[], Awaitable[R]], estimate: int) -> R:
        async with self._limiter:
            await self.rate.acquire(estimate)
            try:
                # The openai timeout bounds each socket phase; this bounds the whole request.
                with anyio.fail_after(self._config.timeout_s):
                    return await send()
            except TimeoutError:
                raise _Transient(
                    f"timeout after {self._config.timeout_s:g}s", outage=True
                ) from None
            except openai.APITimeoutError:
                raise _Transient(
                    f"timeout after {self._config.timeout_s:g}s", outage=True
                ) from None
            except openai.APIConnectionError as exc:
                raise _Transient(f"connection error: {exc}", outage=True) from None
            except openai.APIStatusError as exc:
                self.rate.settle(estimate, 0)
                status = exc.status_code
                detail = f"HTTP {status}: {short(exc.message)}"
                kind = status_kind(status, exc.code)
                if kind == "fail":
                    raise _Fatal(detail) from None
                after = retry_after(exc.response)
                if after is not None:
                    self.rate.block_until(anyio.current_time() + after)
                raise _Transient(detail, after, outage=kind == "outage") from None
            except openai.APIError as exc:
                # e.g. a 200 whose body is not JSON: the server misbehaved, try again.
                raise _Transient(f"bad response: {short(str(exc))}") from None

    # ---------------------------------------------------------------- the retry loop

    async def attempts(
        self,
        role: str,
        usage: RoleUsage,
        breaker: Breaker,
        attempt: Callable[[int], Awaitable[R]],
    ) -> R:
        """Run ``attempt(n)`` (its requests through :meth:`send`, to ``breaker``'s endpoint)
        until it returns, within ``llm.max_attempts``. A transient failure backs off first,
        unless it is an outage and the breaker is open: then it spends no attempt (the call
        waited it out). ``_Again`` (an unusable reply) spends one, ``_GiveUp`` and a ``_Fatal``
        failure end the call. Raises :class:`LLMCallError` with the last reason."""
        reason = ""
        n = 0
        while n < self._config.max_attempts:
            n += 1
            if n > 1:
                usage.retries += 1
            try:
                return await attempt(n)
            except _Transient as exc:
                reason = exc.reason
                if exc.outage and breaker.open:
                    n -= 1  # an outage spends no attempt: the call waits it out
                elif n < self._config.max_attempts:
                    await self._backoff(role, n, exc)
            except _Fatal as exc:
                self.fail(role, exc.reason, n)
            except _GiveUp as exc:
                reason = exc.reason
                break
            except _Again as exc:
                reason = exc.reason
        self.fail(role, reason, n)

    async def _backoff(self, role: str, attempt: int, exc: _Transient) -> None:
        delay = self._retry.delay(attempt, self._rng)
        log.warning(
            "llm.retry",
            role=role,
            attempt=attempt,
            reason=exc.reason,
            retry_after_s=exc.retry_after,
            backoff_s=round(delay, 3),
        )
        # A Retry-After moment is enforced by the rate limiter for every caller; the jitter
        # spreads the retries that were all released at that moment.
        await anyio.sleep(delay)

    @staticmethod
    def fail(role: str, reason: str, attempts: int) -> NoReturn:
        log.error("llm.call_failed", role=role, attempts=attempts, reason=reason)
        raise LLMCallError(role, reason, attempts)


__all__ = ["PROBE_TEXT", "LLMCallError", "Transport"]
