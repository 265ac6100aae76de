"""A seeded generator of financial word problems with exact answers.

Every family is a formula plus a convention that models get wrong, and that one reusable lesson
fixes: compounding periods, percent against fraction, what an NPV subtracts, which dividend a
growth model discounts, monthly rates and terms, and counting a partial payment. The answer is
computed here from the drawn numbers (not from the question's wording), and
``tests/test_tasks.py`` checks every family against a second, independent computation.

Same seed and count, same tasks; a different seed gives a disjoint set (held-out evaluation).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Final

from combee_stream.tasks.base import Task

KEY: Final = "finance"  # the prompt key generated traces teach


def _money(x: float) -> str:
    return f"${x:,.2f}"


def compound_interest(rng: random.Random) -> tuple[str, float]:
    principal = rng.randrange(10, 500) * 100
    rate = rng.randrange(20, 90) / 10
    years = rng.randint(2, 20)
    name, periods = rng.choice([("monthly", 12), ("quarterly", 4), ("semi-annually", 2)])
    question = (
        f"An account starts with {_money(principal)} and earns {rate}% annual interest, "
        f"compounded {name}. What is the balance after {years} years? Round to the cent."
    )
    return question, principal * (1 + rate / 100 / periods) ** (periods * years)


def ratio_percent(rng: random.Random) -> tuple[str, float]:
    revenue = rng.randrange(200, 2000) * 1_000
    cost = round(revenue * rng.uniform(0.35, 0.85), -3)
    margin = (revenue - cost) / revenue
    if rng.random() < 0.5:
        question = (
            f"A retailer had revenue of {_money(revenue)} and cost of goods sold of "
            f"{_money(cost)}. What is its gross margin, in percent? Round to two decimals."
        )
        return question, margin * 100
    question = (
        f"A retailer had revenue of {_money(revenue)} and cost of goods sold of "
        f"{_money(cost)}. What is its gross margin ratio (as a decimal fraction)? Round to "
        "four decimals."
    )
    return question, margin


def npv(rng: random.Random) -> tuple[str, float]:
    investment = rng.randrange(10, 200) * 1_000
    years = rng.randint(3, 5)
    flows = [round(investment * rng.uniform(0.2, 0.45), -2) for _ in range(years)]
    rate = rng.randint(4, 14)
    listed = ", ".join(_money(f) for f in flows)
    question = (
        f"A project costs {_money(investment)} today and returns {listed} at the end of years "
        f"1 to {years}. At a discount rate of {rate}%, what is its net present value? Round to "
        "the cent."
    )
    value = -investment + sum(f / (1 + rate / 100) ** t for t, f in enumerate(flows, 1))
    return question, value


def dividend_discount(rng: random.Random) -> tuple[str, float]:
    dividend = rng.randrange(50, 500) / 100
    growth = rng.randrange(2, 13) / 2
    required = growth + rng.randrange(6, 19) / 2
    question = (
        f"A company just paid a dividend of {_money(dividend)} per share. Dividends grow "
        f"{growth}% a year forever and investors require a {required}% return. What is the "
        "share's value today under the constant-growth dividend discount model? Round to the "
        "cent."
    )
    return question, dividend * (1 + growth / 100) / ((required - growth) / 100)


def loan_payment(rng: random.Random) -> tuple[str, float]:
    principal = rng.randrange(10, 400) * 1_000
    rate = rng.randrange(25, 90) / 10
    years = rng.choice([2, 3, 4, 5, 7, 10, 15, 20, 25, 30])
    question = (
        f"A loan of {_money(principal)} at {rate}% annual interest is repaid in equal monthly "
        f"payments over {years} years. What is the monthly payment? Round to the cent."
    )
    i, n = rate / 100 / 12, years * 12
    return question, principal * i / (1 - (1 + i) ** -n)


def payments_needed(rng: random.Random) -> tuple[str, float]:
    debt = rng.randrange(20, 400) * 25 + rng.randrange(1, 24)
    payment = rng.randrange(4, 30) * 10
    question = (
        f"A debt of {_money(debt)} is paid off with payments of {_money(payment)}; the last "
        "payment may be smaller. How many payments are needed? (Ignore interest.)"
    )
    return question, float(math.ceil(debt / payment))


FAMILIES: Final[dict[str, Callable[[random.Random], tuple[str, float]]]] = {
    "compound_interest": compound_interest,
    "ratio_percent": ratio_percent,
    "npv": npv,
    "dividend_discount": dividend_discount,
    "loan_payment": loan_payment,
    "payments_needed": payments_needed,
}


def generate_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks, the families in turn (so any prefix is balanced), numbers drawn from
    ``random.Random(seed)``."""
    rng = random.Random(f"combee-finance:{seed}")
    names = list(FAMILIES)
    tasks = []
    for index in range(n):
        family = names[index % len(names)]
        question, value = FAMILIES[family](rng)
        tasks.append(
            Task(
                id=f"gen-{seed}-{index:05d}",
                question=question,
                answer=f"{value:.4f}",
                scorer="numeric",
                family=family,
            )
        )
    return tasks


__all__ = ["FAMILIES", "KEY", "generate_tasks"]
