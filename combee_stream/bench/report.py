"""What every suite reports: a typed result, a Markdown rendering, targets checked honestly."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from msgspec import Struct

from combee_stream.sim import LatencyModel

SIMULATED = "Simulated LLM (the combee-stream simulator, not a real model)."


class Target(Struct, kw_only=True):
    """One target of issue 5: what it asks, what was measured, whether it was met."""

    name: str
    target: str
    measured: str
    met: bool


class Report(Protocol):
    suite: str
    simulated: bool
    notes: list[str]
    targets: list[Target]


def describe_latency(model: LatencyModel) -> str:
    return (
        f"{model.base_s:g} s + {model.per_input_token_s:g} s/input token + "
        f"{model.per_output_token_s:g} s/output token, jitter ±{model.jitter:.0%}"
    )


def fmt(value: object) -> str:
    """A table cell: floats to 3 significant digits (no scientific notation below 1e6)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        digits = max(0, 2 - math.floor(math.log10(abs(value))))
        return f"{value:.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def document(
    title: str,
    preamble: Sequence[str],
    body: str,
    targets: Sequence[Target],
    notes: Sequence[str],
    *,
    llm: str = SIMULATED,
) -> str:
    """The Markdown of one suite: title, which LLM (the simulator unless ``llm`` says which real
    model), settings, table, targets."""
    parts = [f"## {title}", "", f"**{llm}**", ""]
    parts += [f"- {line}" for line in preamble]
    parts += ["", body, ""]
    if targets:
        parts += [
            "Targets:",
            "",
            table(
                ["target", "wanted", "measured", "met"],
                [[t.name, t.target, t.measured, t.met] for t in targets],
            ),
            "",
        ]
    parts += [f"- {note}" for note in notes]
    return "\n".join(parts).rstrip() + "\n"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


__all__ = [
    "SIMULATED",
    "Report",
    "Target",
    "describe_latency",
    "document",
    "fmt",
    "percentile",
    "table",
]
