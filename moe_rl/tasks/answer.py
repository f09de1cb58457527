"""The answer format, in one place: what a completion is and how it is compared with the reference answer.

Completion
    The text the model generates right after the prompt, up to (not including) EOS. It is the answer itself: no
    reasoning, no "Answer:" prefix, no \\boxed{}. Tiny character-level models cannot afford more, and a format with
    nothing to learn but the answer keeps the reward about the task. `parse_answer` strips surrounding whitespace
    (spaces, newlines); everything else counts.

Comparisons (reward 1.0 on a match, 0.0 otherwise; a malformed completion is never an error, only reward 0)
    numeric     Both sides must be plain decimal numbers: optional sign, digits, optional fraction, optional
                exponent ("-4", "+4", "4.0", "4.", ".5", "1e3"). Two integers compare exactly; otherwise as floats
                with relative tolerance 1e-6 (absolute 1e-9), so "-4" == "-4.0". Anything else is malformed:
                "4 apples", "1,000", "1_000", "nan", "inf", "" all score 0.
    exact       String equality after stripping whitespace on both sides.
    expression  Countdown: an arithmetic expression over the given numbers; see expr.py.

Prompt formats live with their source: gym.py (compact reasoning-gym prompts such as "4-1-7=") and files.py (the
prompt column, used as is).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

REL_TOL = 1e-6
ABS_TOL = 1e-9

# Deliberately narrower than float(): float() also accepts "nan", "inf", "1_000" and surrounding whitespace.
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")


def parse_answer(completion: str) -> str:
    """Completion text -> the answer string it carries (surrounding whitespace removed)."""
    return completion.strip()


def parse_number(text: str) -> int | float | None:
    """A plain decimal number -> int (if written as an integer) or finite float; anything else -> None."""
    text = text.strip()
    if _INTEGER.fullmatch(text):
        return int(text)
    if _NUMBER.fullmatch(text):
        value = float(text)
        return value if math.isfinite(value) else None  # "1e999" overflows to inf
    return None


def numbers_equal(a: int | float, b: int | float) -> bool:
    """Exact for two ints (no float rounding of large values), tolerant otherwise."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def numeric_reward(completion: str, answer: str) -> float:
    """1.0 if the completion is a number equal to the reference `answer`, else 0.0."""
    got, want = parse_number(parse_answer(completion)), parse_number(answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if numbers_equal(got, want) else 0.0


def exact_reward(completion: str, answer: str) -> float:
    """1.0 if the stripped completion equals the stripped reference `answer`, else 0.0."""
    return 1.0 if parse_answer(completion) == answer.strip() else 0.0


MATCHERS: dict[str, Callable[[str, str], float]] = {"numeric": numeric_reward, "exact": exact_reward}
"""Verifiers for (completion, reference answer) by match mode; config `match` picks one."""
