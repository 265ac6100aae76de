"""The client's rate limits: requests and tokens per minute, and the server's Retry-After."""

from __future__ import annotations

import anyio


class RateLimiter:
    """Requests- and tokens-per-minute token buckets plus a shared Retry-After barrier.

    Callers queue on a fair lock, so admission is FIFO. A 429 with Retry-After moves the barrier
    and every caller, queued or arriving later, waits until that moment.
    """

    def __init__(self, requests_per_minute: int, tokens_per_minute: int) -> None:
        self._rpm = float(requests_per_minute)
        self._tpm = float(tokens_per_minute)
        self._requests = self._rpm
        self._tokens = self._tpm
        self._stamp: float | None = None  # set on first use: the clock needs a running loop
        self._blocked_until = 0.0
        self._lock = anyio.Lock()

    def block_until(self, moment: float) -> None:
        self._blocked_until = max(self._blocked_until, moment)

    def settle(self, estimated: int, actual: int) -> None:
        """Correct a reservation with the tokens the server reported (may go into debt)."""
        if self._tpm:
            self._refill()
            self._tokens = min(self._tpm, self._tokens + estimated - actual)

    async def acquire(self, tokens: int) -> None:
        async with self._lock:
            while True:
                now = anyio.current_time()
                if now < self._blocked_until:
                    await anyio.sleep(self._blocked_until - now)
                    continue
                self._refill()
                # A request larger than the whole bucket is admitted when the bucket is full.
                need_tokens = min(float(tokens), self._tpm)
                wait = 0.0
                if self._rpm and self._requests < 1:
                    wait = max(wait, (1 - self._requests) * 60.0 / self._rpm)
                if self._tpm and self._tokens < need_tokens:
                    wait = max(wait, (need_tokens - self._tokens) * 60.0 / self._tpm)
                if wait <= 0:
                    if self._rpm:
                        self._requests -= 1
                    if self._tpm:
                        self._tokens -= need_tokens
                    return
                await anyio.sleep(wait)

    def _refill(self) -> None:
        now = anyio.current_time()
        elapsed = 0.0 if self._stamp is None else now - self._stamp
        self._stamp = now
        if self._rpm:
            self._requests = min(self._rpm, self._requests + elapsed * self._rpm / 60.0)
        if self._tpm:
            self._tokens = min(self._tpm, self._tokens + elapsed * self._tpm / 60.0)


__all__ = ["RateLimiter"]
