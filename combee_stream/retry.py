"""The one retry policy: capped exponential backoff with full jitter.

The LLM client uses it between attempts of one call; the engine uses it while the broker cannot
be written (publishing, DLQ writes, restores), where it retries for as long as it owns the
partition or until its deadline, never giving up silently.
"""

from __future__ import annotations

import random

from msgspec import Struct


class RetryPolicy(Struct, frozen=True, kw_only=True):
    """Before attempt ``n + 1`` sleep ``uniform(0, min(max_s, base_s * 2**(n - 1)))``.

    Full jitter spreads the retries of many callers released at the same moment (a Retry-After,
    a broker coming back)."""

    base_s: float = 0.5
    max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.max_s < self.base_s:
            raise ValueError(f"need 0 < base_s <= max_s, got {self.base_s} and {self.max_s}")

    def ceiling(self, attempt: int) -> float:
        """The longest sleep after failed attempt ``attempt`` (1-based)."""
        return float(min(self.max_s, self.base_s * 2.0 ** max(0, attempt - 1)))

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, self.ceiling(attempt))


__all__ = ["RetryPolicy"]
