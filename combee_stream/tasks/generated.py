"""A seeded generator of financial word problems with exact answers.

Every family is a formula plus a convention that models get wrong, and that one reusable lesson
fixes: compounding periods, percent against fraction, what an NPV subtracts, which dividend a
growth model discounts, monthly rates and terms, counting a partial payment, amounts given in
millions asked in dollars, and a rate asked as a decimal fraction (the last two are misses ACE's
Formula rows show in a real 1.5B agent's traces: 4 and 3 of its 34 failures). The answer is
computed here from the drawn numbers (not from the question's wording), and
``tests/test_tasks.py`` checks every family against a second, independent computation.

Every task also carries the worked reference solution (``metadata["solution"]``), as GSM8K's
answers do: the environment's feedback on a wrong answer shows it, which is what lets a small
reflector see *why* the agent was wrong, not only that it was. The agent never sees it.

Same seed and count, same tasks; a different seed gives a disjoint set (held-out evaluation).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Final

from combee_stream.tasks.base import Task

KEY: Final = "finance"  # the prompt key generated traces teach


def _money(x: float) -> str:
    return f"${x:,.2f}"


Problem = tuple[str, float, str]  # question, answer, worked solution


def compound_interest(rng: random.Random) -> Problem:
    principal = rng.randrange(10, 500) * 100
    rate = rng.randrange(20, 90) / 10
    years = rng.randint(2, 20)
    name, periods = rng.choice([("monthly", 12), ("quarterly", 4), ("semi-annually", 2)])
    question = (
        f"An account starts with {_money(principal)} and earns {rate}% annual interest, "
        f"compounded {name}. What is the balance after {years} years? Round to the cent."
    )
    value = principal * (1 + rate / 100 / periods) ** (periods * years)
    solution = (
        f"compounded {name} means {periods} periods a year: balance = P * (1 + r/{periods}) ** "
        f"({periods} * years) = {principal} * (1 + {rate / 100:g}/{periods}) ** ({periods} * "
        f"{years}) = {value:.2f}"
    )
    return question, value, solution


def ratio_percent(rng: random.Random) -> Problem:
    revenue = rng.randrange(200, 2000) * 1_000
    cost = round(revenue * rng.uniform(0.35, 0.85), -3)
    margin = (revenue - cost) / revenue
    if rng.random() < 0.5:
        question = (
            f"A retailer had revenue of {_money(revenue)} and cost of goods sold of "
            f"{_money(cost)}. What is its gross margin, in percent? Round to two decimals."
        )
        solution = (
            f"gross margin = (revenue - cost) / revenue = {margin:.6f}; asked in percent, so "
            f"multiply by 100: {margin * 100:.2f}"
        )
        return question, margin * 100, solution
    question = (
        f"A retailer had revenue of {_money(revenue)} and cost of goods sold of "
        f"{_money(cost)}. What is its gross margin ratio (as a decimal fraction)? Round to "
        "four decimals."
    )
    solution = (
        f"gross margin = (revenue - cost) / revenue = {margin:.4f}; a ratio is the decimal "
        "fraction, not a percentage"
    )
    return question, margin, solution


def npv(rng: random.Random) -> Problem:
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
    terms = " + ".join(f"{f:g} / (1 + {rate / 100:g}) ** {t}" for t, f in enumerate(flows, 1))
    solution = (
        f"NPV = -initial cost + sum of discounted cash flows = -{investment} + {terms} = "
        f"{value:.2f} (the cost paid today is subtracted, undiscounted)"
    )
    return question, value, solution


def dividend_discount(rng: random.Random) -> Problem:
    dividend = rng.randrange(50, 500) / 100
    growth = rng.randrange(2, 13) / 2
    required = growth + rng.randrange(6, 19) / 2
    question = (
        f"A company just paid a dividend of {_money(dividend)} per share. Dividends grow "
        f"{growth}% a year forever and investors require a {required}% return. What is the "
        "share's value today under the constant-growth dividend discount model? Round to the "
        "cent."
    )
    value = dividend * (1 + growth / 100) / ((required - growth) / 100)
    solution = (
        f"the dividend just paid is D0 = {dividend}; the model discounts next year's "
        f"D1 = D0 * (1 + g) = {dividend} * (1 + {growth / 100:g}); value = D1 / (k - g) = "
        f"{dividend * (1 + growth / 100):.4f} / ({required / 100:g} - {growth / 100:g}) = "
        f"{value:.2f}"
    )
    return question, value, solution


def loan_payment(rng: random.Random) -> Problem:
    principal = rng.randrange(10, 400) * 1_000
    rate = rng.randrange(25, 90) / 10
    years = rng.choice([2, 3, 4, 5, 7, 10, 15, 20, 25, 30])
    question = (
        f"A loan of {_money(principal)} at {rate}% annual interest is repaid in equal monthly "
        f"payments over {years} years. What is the monthly payment? Round to the cent."
    )
    i, n = rate / 100 / 12, years * 12
    value = principal * i / (1 - (1 + i) ** -n)
    solution = (
        f"monthly rate i = {rate / 100:g} / 12, number of payments n = {years} * 12 = {n}; "
        f"payment = P * i / (1 - (1 + i) ** -n) = {principal} * i / (1 - (1 + i) ** -{n}) = "
        f"{value:.2f}"
    )
    return question, value, solution


def payments_needed(rng: random.Random) -> Problem:
    debt = rng.randrange(20, 400) * 25 + rng.randrange(1, 24)
    payment = rng.randrange(4, 30) * 10
    question = (
        f"A debt of {_money(debt)} is paid off with payments of {_money(payment)}; the last "
        "payment may be smaller. How many payments are needed? (Ignore interest.)"
    )
    count = math.ceil(debt / payment)
    solution = (
        f"{debt} / {payment} = {debt / payment:.3f}; a partial last payment still counts, so "
        f"round up: ceil({debt} / {payment}) = {count} (no interest is involved)"
    )
    return question, float(count), solution


def operating_income(rng: random.Random) -> Problem:
    revenue = rng.randrange(200, 900) / 10
    expenses = round(revenue * rng.uniform(0.45, 0.85), 1)
    question = (
        f"A company reports revenue of ${revenue} million and operating expenses of "
        f"${expenses} million. What is its operating income, in dollars?"
    )
    value = (revenue - expenses) * 1_000_000
    solution = (
        f"operating income = revenue - operating expenses = {revenue} million - {expenses} "
        f"million; in dollars, a million is 1000000: ({revenue} - {expenses}) * 1000000 = "
        f"{value:.0f}"
    )
    return question, value, solution


def capm_return(rng: random.Random) -> Problem:
    free = rng.randrange(10, 50) / 10
    market = free + rng.randrange(30, 80) / 10
    beta = rng.randrange(50, 200) / 100
    question = (
        f"The risk-free rate is {free}%, the expected market return is {market:.1f}% and a "
        f"stock's beta is {beta}. What is the stock's expected return under CAPM, as a decimal? "
        "Round to four decimals."
    )
    value = free / 100 + beta * (market - free) / 100
    solution = (
        f"CAPM: r = rf + beta * (rm - rf) with the rates as decimal fractions: {free / 100:g} + "
        f"{beta} * ({market / 100:g} - {free / 100:g}) = {value:.4f}"
    )
    return question, value, solution


FAMILIES: Final[dict[str, Callable[[random.Random], Problem]]] = {
    "compound_interest": compound_interest,
    "ratio_percent": ratio_percent,
    "npv": npv,
    "dividend_discount": dividend_discount,
    "loan_payment": loan_payment,
    "payments_needed": payments_needed,
    "operating_income": operating_income,
    "capm_return": capm_return,
}


def generate_tasks(n: int, seed: int = 0, families: Sequence[str] = ()) -> list[Task]:
    """``n`` tasks, the families in turn (so any prefix is balanced; ``families``: only these,
    default all), numbers drawn from ``random.Random(seed)``."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {', '.join(FAMILIES)}")
    rng = random.Random(f"combee-finance:{seed}")
    names = list(families) or list(FAMILIES)
    tasks = []
    for index in range(n):
        family = names[index % len(names)]
        question, value, solution = FAMILIES[family](rng)
        tasks.append(
            Task(
                id=f"gen-{seed}-{index:05d}",
                question=question,
                answer=f"{value:.4f}",
                scorer="numeric",
                family=family,
                metadata={"solution": solution},
            )
        )
    return tasks


__all__ = ["FAMILIES", "KEY", "generate_tasks"]
