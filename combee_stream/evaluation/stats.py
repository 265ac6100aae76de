"""The statistics of an evaluation: accuracy with a Wilson interval, and a paired comparison of
two prompts on the same tasks (Newcombe's interval for the difference, exact McNemar test).

Decisions: Wilson (not Wald) because it behaves at accuracies near 0 or 1 and small n;
Newcombe's method 10 (hybrid score, no continuity correction) for the paired difference
because it uses the pairing (a paired test on 100 tasks sees what two independent intervals
would hide); the exact binomial McNemar test on the discordant pairs, two-sided.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from msgspec import Struct

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion; (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denominator = 1 + z * z / n
    low = 0.0 if successes == 0 else (centre - margin) / denominator  # exact at the edges
    high = 1.0 if successes == n else (centre + margin) / denominator
    return max(0.0, low), min(1.0, high)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (b: only A right, c: only B
    right): twice the binomial(b + c, 1/2) tail of the smaller count, capped at 1."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


class Paired(Struct, frozen=True, kw_only=True):
    """B against A on the same n tasks."""

    n: int
    both: int  # right under both
    only_a: int  # right under A only (B lost it)
    only_b: int  # right under B only (B gained it)
    neither: int
    difference: float  # accuracy of B - accuracy of A
    ci95: tuple[float, float]  # Newcombe's interval of the difference
    mcnemar_p: float


def paired(a: Sequence[bool], b: Sequence[bool]) -> Paired:
    if len(a) != len(b):
        raise ValueError(f"paired results need the same tasks: {len(a)} vs {len(b)}")
    n = len(a)
    both = sum(x and y for x, y in zip(a, b, strict=True))
    only_a = sum(x and not y for x, y in zip(a, b, strict=True))
    only_b = sum(y and not x for x, y in zip(a, b, strict=True))
    neither = n - both - only_a - only_b
    if n == 0:
        return Paired(
            n=0, both=0, only_a=0, only_b=0, neither=0, difference=0.0, ci95=(-1.0, 1.0),
            mcnemar_p=1.0,
        )  # fmt: skip
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    l1, u1 = wilson(both + only_a, n)
    l2, u2 = wilson(both + only_b, n)
    # Newcombe (1998), method 10: phi is the correlation of the two outcomes.
    r1, r2, s1, s2 = both + only_a, neither + only_b, both + only_b, neither + only_a
    denominator = math.sqrt(r1 * r2 * s1 * s2)
    phi = (both * neither - only_a * only_b) / denominator if denominator else 0.0
    d = p2 - p1
    delta = math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    eps = math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    return Paired(
        n=n,
        both=both,
        only_a=only_a,
        only_b=only_b,
        neither=neither,
        difference=d,
        ci95=(max(-1.0, d - delta), min(1.0, d + eps)),
        mcnemar_p=mcnemar_exact(only_a, only_b),
    )


__all__ = ["Z95", "Paired", "mcnemar_exact", "paired", "wilson"]
