"""The one token estimate: ``ceil(chars / 4)``.

Used for the playbook's token budget, the LLM client's rate-limit reservations and the
simulator's accounting. No tokenizer dependency: close to BPE counts for English text, and the
same number everywhere, so a budget checked at apply is the budget the rate limiter reserves.
"""

from __future__ import annotations

import math


def estimate_tokens(text: str) -> int:
    """Approximate token count of ``text``: one token per 4 characters, rounded up."""
    return math.ceil(len(text) / 4)


__all__ = ["estimate_tokens"]
