"""Countdown verification: evaluate an arithmetic expression safely and check it against the numbers and target.

A countdown completion is an expression such as "4*(9-3)" using +, -, *, /, parentheses and integer literals. It is
parsed with `ast` and evaluated by walking a whitelist of node types: text is never passed to eval (reasoning-gym's
own `score_answer` goes through sympy's parse_expr, which does eval, and gives 0.01/0.05 partial credit).
Arithmetic is exact (Fraction), so "6/4*2" equals 3 with no float tolerance; intermediate fractions are allowed, as
in reasoning-gym.

Rule (the game's): every literal must be one of the given numbers, each used at most once (not all need be used);
the value must equal the target. Unary minus is allowed (it uses no extra number).
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from fractions import Fraction

from moe_rl.tasks.answer import parse_answer

MAX_CHARS = 256  # completions are short; the cap bounds parsing cost on degenerate text
_ALLOWED_CHARS = set("0123456789+-*/() ")  # rejects names, floats, "1_0" and "**" before ast sees them
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class ExprError(ValueError):
    """The text is not an expression countdown accepts."""


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """Expression text -> (exact value, integer literals in the order they appear). Raises ExprError otherwise."""
    text = text.strip()
    if not text or len(text) > MAX_CHARS or not set(text) <= _ALLOWED_CHARS:
        raise ExprError(f"not a short +-*/ expression over integers: {text[:40]!r}")
    try:
        tree = ast.parse(text, mode="eval")
        literals: list[int] = []
        return _eval(tree.body, literals), literals
    except (SyntaxError, RecursionError, ZeroDivisionError) as err:
        raise ExprError(f"cannot evaluate {text[:40]!r}: {err}") from None


def _eval(node: ast.AST, literals: list[int]) -> Fraction:
    """Evaluate one whitelisted node, appending the integer literals it reads to `literals`."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, literals)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, literals), _eval(node.right, literals)
        return _BINOPS[type(node.op)](left, right)
    raise ExprError(f"{type(node).__name__} is not allowed in a countdown expression")


def countdown_reward(completion: str, numbers: list[int], target: int) -> float:
    """1.0 if the completion uses only `numbers` (each at most once) and evaluates to `target`, else 0.0."""
    try:
        value, used = evaluate(parse_answer(completion))
    except ExprError:
        return 0.0
    if Counter(used) - Counter(numbers):  # a literal not given, or given fewer times than used
        return 0.0
    return 1.0 if value == target else 0.0
