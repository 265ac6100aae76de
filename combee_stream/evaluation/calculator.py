"""The example agent's one tool: a calculator for arithmetic expressions, evaluated safely.

Small models choose the right formula far more often than they carry out its arithmetic (a bare
answer from Qwen2.5-0.5B scored 0 of 200 on ACE's Formula split), so the agent writes the
expression and this evaluates it. Only numbers, ``+ - * / // % **``, parentheses and a few
functions (``round abs min max sum ceil floor sqrt log exp``) are allowed: the expression comes
from a model and is never given to ``eval``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any, Final

from combee_stream.errors import CombeeError


class CalculatorError(CombeeError):
    """The expression is not arithmetic the calculator accepts, or it does not evaluate."""


_BINARY: Final[dict[type[ast.operator], Callable[[Any, Any], Any]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: Final[dict[type[ast.unaryop], Callable[[Any], Any]]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_FUNCTIONS: Final[dict[str, Callable[..., Any]]] = {
    "round": round,
    "abs": abs,
    "min": min,
    "max": max,
    "sum": lambda *xs: sum(xs[0]) if len(xs) == 1 and isinstance(xs[0], list) else sum(xs),
    "ceil": math.ceil,
    "floor": math.floor,
    "sqrt": math.sqrt,
    "log": math.log,
    "exp": math.exp,
}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_MAX_POWER: Final = 10_000  # bounds 10 ** 10 ** 10 and friends
_MAX_LENGTH: Final = 2_000


def evaluate(expression: str) -> float:
    """The value of ``expression``; CalculatorError with the reason when it has none."""
    # "^" as power and thousands separators ("1,000") are what models write for arithmetic.
    text = _THOUSANDS.sub("", expression.strip().replace("^", "**"))
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > _MAX_LENGTH:
        raise CalculatorError(f"expression longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
        value = _eval(tree.body)
    except CalculatorError:
        raise
    except (SyntaxError, ArithmeticError, ValueError, TypeError, OverflowError) as exc:
        raise CalculatorError(f"{type(exc).__name__}: {exc}") from None
    try:  # an int beyond a float (a real model wrote 10 ** 400) is no answer either
        number = None if isinstance(value, list) else float(value)
    except OverflowError:
        number = math.inf
    if number is None or not math.isfinite(number):
        raise CalculatorError(f"not a finite number: {str(value)[:40]!r}")
    return number


def _eval(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
            raise CalculatorError(f"exponent {right} is too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.List | ast.Tuple):
        return [_eval(item) for item in node.elts]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_eval(arg) for arg in node.args))
    raise CalculatorError(f"not allowed in an expression: {ast.unparse(node)[:80]!r}")


__all__ = ["CalculatorError", "evaluate"]
