"""Synthetic traces for tests and benchmarks: each carries one lesson marker in its feedback.

Keys are ``sim-k0``, ``sim-k1``, ...; key ``j`` has lessons ``kj-l000``, ``kj-l001``, ... Lessons
are dealt round-robin before shuffling, so with ``n >= keys * lessons`` every lesson appears and
each appears ``n // (keys * lessons)`` or one more times. Same arguments, same traces.
"""

from __future__ import annotations

import functools
import itertools
import random

from combee_stream.schemas import Feedback, Step, Trace
from combee_stream.sim.markers import marker_line

_SITUATIONS = (
    "the invoice total disagrees with the line items",
    "a date is given without a year",
    "the customer asks for a refund after 30 days",
    "the API returns an empty page",
    "two records share the same email address",
    "the currency is not stated",
    "a tool call times out",
    "the spreadsheet has merged header cells",
    "the user writes in a language other than English",
    "the search returns more than 50 results",
    "a required field is missing from the form",
    "the order was split across warehouses",
)
_ACTIONS = (
    "recompute the total from the line items",
    "ask which year is meant",
    "check the refund policy for exceptions",
    "follow the next-page cursor until it is empty",
    "merge the records by customer id, not by email",
    "infer the currency from the billing country",
    "retry once with a smaller request",
    "read the header row by column position",
    "answer in the user's language",
    "narrow the query with the date filter",
    "report the missing field instead of guessing",
    "track each shipment separately",
)
_CHECKS = (
    "before submitting the answer",
    "before calling the payment tool",
    "and state the assumption in the reply",
    "and log the discrepancy",
    "before closing the ticket",
    "and cite the source record",
    "before summarising",
    "and confirm with a second lookup",
)
_TASKS = (
    ("Reconcile the invoices of account {n}", "ledger.query"),
    ("Answer support ticket #{n} about a late delivery", "orders.lookup"),
    ("Summarise the sales of region {n} for last quarter", "sheets.read"),
    ("Deduplicate the contact list of campaign {n}", "crm.search"),
    ("Schedule the follow-up call for lead {n}", "calendar.create"),
    ("Compute the refund owed on order {n}", "payments.get"),
)


@functools.cache
def _combinations(seed: int, scope: str) -> list[tuple[str, str, str]]:
    """Every (situation, action, check), in an order fixed by (seed, scope)."""
    combos = list(itertools.product(_SITUATIONS, _ACTIONS, _CHECKS))
    random.Random(f"{seed}:lessons:{scope}").shuffle(combos)
    return combos


def lesson_text(seed: int, lesson_id: str) -> str:
    """The lesson's wording: fixed for a (seed, id) and plausible. Lessons ``<scope>-lNNN`` of
    one scope (a key) get distinct wordings (up to 1,152 of them), so that two lessons the
    scorer counts apart are never the same sentence under two ids."""
    scope, _, number = lesson_id.rpartition("-l")
    if scope and number.isdigit():
        combos = _combinations(seed, scope)
        situation, action, check = combos[int(number) % len(combos)]
    else:
        rng = random.Random(f"{seed}:lesson:{lesson_id}")
        situation, action, check = (rng.choice(x) for x in (_SITUATIONS, _ACTIONS, _CHECKS))
    return f"When {situation}, {action} {check}."


def lesson_ids(keys: int, lessons: int) -> dict[str, list[str]]:
    """Key -> its lesson ids, e.g. ``{"sim-k0": ["k0-l000", ...]}``."""
    return {f"sim-k{k}": [f"k{k}-l{i:03d}" for i in range(lessons)] for k in range(keys)}


def generate_traces(n: int, keys: int, lessons: int, seed: int = 0) -> list[Trace]:
    """``n`` valid traces over ``keys`` keys of ``lessons`` lessons each (n >= keys*lessons)."""
    if keys < 1 or lessons < 1:
        raise ValueError("keys and lessons must be >= 1")
    if n < keys * lessons:
        raise ValueError(
            f"{n} traces cannot cover {keys} keys x {lessons} lessons; use n >= {keys * lessons}"
        )
    ids = lesson_ids(keys, lessons)
    dealt = [(key, ids[key][i]) for i in range(lessons) for key in ids]
    slots = [dealt[i % len(dealt)] for i in range(n)]
    rng = random.Random(seed)
    rng.shuffle(slots)
    return [_trace(rng, seed, index, key, lesson) for index, (key, lesson) in enumerate(slots)]


def _trace(rng: random.Random, seed: int, index: int, key: str, lesson_id: str) -> Trace:
    template, tool = rng.choice(_TASKS)
    task = template.format(n=rng.randrange(1000, 9999))
    passed = rng.random() < 0.6
    verdict = "Accepted by the checker." if passed else "Rejected by the checker."
    score = 1.0 if passed else round(rng.uniform(0.0, 0.6), 2)
    return Trace(
        key=key,
        trace_id=f"sim-s{seed}-{index:06d}",
        task=task,
        output=f"{task}: done." if passed else f"{task}: answered, but with an error.",
        steps=[
            Step(kind="thought", content=f"I need to look this up with {tool}."),
            Step(kind="tool_call", name=tool, content=f'{{"query": "{task}"}}'),
            Step(kind="observation", name=tool, content=f"{rng.randrange(1, 40)} rows returned."),
            Step(kind="message", content="Here is the result."),
        ],
        feedback=Feedback(
            passed=passed,
            score=score,
            text=f"{verdict}\n{marker_line(lesson_id, lesson_text(seed, lesson_id))}",
        ),
        metadata={"simulated": "true", "lesson_id": lesson_id},
    )


__all__ = ["generate_traces", "lesson_ids", "lesson_text"]
