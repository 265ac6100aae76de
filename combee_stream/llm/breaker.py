"""The LLM client's circuit breaker: an endpoint that is down is an outage, not bad traces.

Without it, every call in flight when an endpoint goes away spends its attempts in seconds and
its trace is parked in the DLQ: a 60-second outage dead-letters the stream. With it,
``threshold`` consecutive outage failures open the breaker: callers then wait in
:meth:`Breaker.admit` instead of failing, and their attempts are not spent; one probe at a time is
let through after a capped backoff (the one retry policy); the first probe that is answered
(anything but an outage failure) closes it. A trace that fails while others succeed still
fails, and is parked.

What an outage failure is (``llm.status``'s table): no answer (connection refused, a
timeout) or an answer that every call would get alike: HTTP 5xx, a key refused (401/403), the
model or the path gone (404), an exhausted quota (429 ``insufficient_quota``). Not a rate limit,
not a 400 about the request itself (context too long), not an invalid reply. And a failure
counts only when no other call of the endpoint was answered while it was in flight: a huge
prompt that times out while the other calls succeed is that trace's problem, not an outage (if
such calls hold every concurrency slot, nothing else is answered and the breaker opens; the
probe, a tiny request, closes it and the huge call spends its attempts and is parked).
"""

from __future__ import annotations

import random

import anyio

from combee_stream.logs import get_logger
from combee_stream.retry import RetryPolicy

log = get_logger(__name__)

PROBE_BACKOFF = RetryPolicy(base_s=1.0, max_s=30.0)


class Breaker:
    def __init__(self, threshold: int = 5, retry: RetryPolicy = PROBE_BACKOFF) -> None:
        self.threshold = threshold
        self._retry = retry
        self._rng = random.Random()
        self._consecutive = 0
        self.open = False
        self.opened_at = 0.0
        self._answered_at = -1.0
        self._probes = 0
        self._probing = False
        self._next_probe = 0.0
        self._changed = anyio.Event()

    async def admit(self) -> bool:
        """Wait until a request may be sent: False at once while closed (send it); True while
        open, when this caller holds the probe slot (send a probe, then report it with
        failed(), answered() or abandoned(), and call admit() again)."""
        while self.open:
            now = anyio.current_time()
            if not self._probing and now >= self._next_probe:
                self._probing = True
                return True
            changed = self._changed
            wait = max(0.05, self._next_probe - now) if not self._probing else 60.0
            with anyio.move_on_after(wait):
                await changed.wait()
        return False

    def failed(self, reason: str = "", *, since: float | None = None) -> bool:
        """An outage failure of a request sent at ``since``. Returns whether the breaker is open
        now: then the caller's attempt does not count, and it waits in admit()."""
        if self.open:
            self._probes += 1
            self._probing = False
            self._next_probe = anyio.current_time() + self._retry.delay(self._probes, self._rng)
            self._notify()
            return True
        if since is not None and self._answered_at > since:
            return False  # another call was answered meanwhile: the endpoint is up
        self._consecutive += 1
        if self._consecutive >= self.threshold:
            self.open = True
            self.opened_at = anyio.current_time()
            self._probes = 1
            self._next_probe = self.opened_at + self._retry.delay(1, self._rng)
            log.error(
                "llm endpoint outage: calls wait for it instead of failing",
                consecutive_failures=self._consecutive,
                reason=reason,
            )
            self._notify()
            return True
        return False

    def answered(self) -> None:
        """The endpoint answered (anything but an outage failure): it is up."""
        self._consecutive = 0
        self._answered_at = anyio.current_time()
        if self.open:
            log.info(
                "llm endpoint back: calls resume",
                outage_s=round(anyio.current_time() - self.opened_at, 1),
            )
            self.open = False
            self._probing = False
            self._notify()

    def abandoned(self) -> None:
        """The probe was cancelled before it had an outcome: let the next caller probe."""
        if self._probing:
            self._probing = False
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


__all__ = ["PROBE_BACKOFF", "Breaker"]
