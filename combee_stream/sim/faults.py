"""Deterministic fault decisions and the corrupted replies of content faults.

A decision depends only on (seed, request hash, attempt): rerunning the same requests with the
same seed injects the same faults, and distinct requests are independent draws at the configured
rates. ``attempt`` counts how often the server saw this exact request before.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from combee_stream.sim.settings import FaultModel

FaultKind = Literal["429", "500", "timeout", "malformed", "schema_violation"]
FAULT_KINDS: tuple[FaultKind, ...] = ("429", "500", "timeout", "malformed", "schema_violation")
HTTP_FAULTS: frozenset[FaultKind] = frozenset({"429", "500", "timeout"})


def unit(seed: int, *parts: object) -> float:
    """A deterministic uniform draw in [0, 1) from the seed and the parts."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def decide_fault(model: FaultModel, seed: int, request_hash: str, attempt: int) -> FaultKind | None:
    """The fault of this attempt, or None. The kinds occupy consecutive intervals of [0, 1) of
    length equal to their rates, so each kind occurs at exactly its rate in expectation."""
    if attempt >= model.max_faults_per_request:
        return None
    draw = unit(seed, "fault", request_hash, attempt)
    edge = 0.0
    rates = model.rates()
    for kind in FAULT_KINDS:
        edge += rates[kind]
        if draw < edge:
            return kind
    return None


def malformed(content: bytes) -> bytes:
    """Truncated JSON: the first half of the reply, which no JSON parser accepts."""
    return content[: max(1, len(content) // 2)]


def schema_violation(content: bytes) -> bytes:
    """Valid JSON object without the fields every role output requires."""
    data = msgspec.json.decode(content)
    kept = {"reasoning": data.get("reasoning", "")} if isinstance(data, dict) else {}
    return msgspec.json.encode(kept)


__all__ = [
    "FAULT_KINDS",
    "HTTP_FAULTS",
    "FaultKind",
    "decide_fault",
    "malformed",
    "schema_violation",
    "unit",
]
