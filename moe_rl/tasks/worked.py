"""Long-completion tasks: worked solutions of 20-80 characters that end in a final answer the verifier checks.

The reasoning-gym tasks (gym.py) answer in 2-3 tokens, so token- and sequence-level importance ratios barely differ
and the objectives' differences cannot show. Here the completion is a worked solution, one step per operation:

    running_sum   prompt "3+4-2+9="   solution "3+4=7;7-2=5;5+9=14"       (n terms -> n-1 steps)

Each step is `<running value><op><next term>=<new running value>`; steps are joined by ";". Length grows with the
number of terms (about 6-8 characters per step for one-digit terms), difficulty with the number and size of terms.

Reward (1.0 or 0.0; text is parsed with a regular expression, never executed):
    1.0 iff the completion is a well-formed chain of exactly n-1 steps and the result of its last step equals the
    reference answer. The intermediate steps are read but not checked: the reward is for the final answer, and the
    step count is what makes a truncated completion (fewer steps, or a cut-off number) score 0. Anything else
    (other characters, a missing "=", an empty step, trailing text) is malformed and scores 0.
    `check_steps=True` (off by default) is the optional format/process component: every step must also restate the
    prompt's operation (right running value, operator and term) with correct arithmetic.

Splits: item i of a split is the first of attempts i*1024 .. i*1024+1023 (each drawn from its own seeded Random) whose
prompt hashes into that split (gym.in_split), so train and eval never share a prompt, as for the gym tasks; validation
draws its own attempts and keeps eval-hashed prompts outside the first HELD_OUT_RESERVE held-out ones (gym.py).
"""

from __future__ import annotations

import random
import re

from moe_rl.errors import ConfigError
from moe_rl.tasks.base import Problem, Task, check_split_index
from moe_rl.tasks.gym import HELD_OUT_RESERVE, TRIES, in_split, too_small

WORKED_TASKS = ("running_sum",)
MAX_CHARS = 512  # a completion longer than this is malformed without being parsed (bounds the cost on junk)

_INT = r"-?\d+"
_STEP = re.compile(rf"({_INT})([+-])(\d+)=({_INT})")  # "7-2=5", "-3+4=1"; terms themselves are non-negative


def parse_steps(completion: str) -> list[tuple[int, str, int, int]] | None:
    """"3+4=7;7-2=5" -> [(3, "+", 4, 7), (7, "-", 2, 5)]; None if the text is not such a chain (whitespace around
    the whole completion is ignored, inside it is not)."""
    text = completion.strip()
    if not text or len(text) > MAX_CHARS:
        return None
    steps = []
    for part in text.split(";"):
        match = _STEP.fullmatch(part)
        if match is None:
            return None
        left, op, term, result = match.groups()
        steps.append((int(left), op, int(term), int(result)))
    return steps


def worked_solution(terms: list[int], ops: list[str], slip_rate: float = 0.0,
                    rng: random.Random | None = None) -> tuple[str, int]:
    """The chain for terms[0] ops[0] terms[1] ... and its final value. With `slip_rate` > 0 each step's result is,
    with that probability, off by 1 or 2 (drawn from `rng`) and carried into the next step: a noisy demonstrator."""
    value, steps = terms[0], []
    for op, term in zip(ops, terms[1:]):
        new = value + term if op == "+" else value - term
        if slip_rate and rng.random() < slip_rate:
            new += rng.choice((-2, -1, 1, 2))
        steps.append(f"{value}{op}{term}={new}")
        value = new
    return ";".join(steps), value


class RunningSumTask(Task):
    """"3+4-2+9=" -> "3+4=7;7-2=5;5+9=14": a left-to-right running sum, one worked step per operation."""

    def __init__(self, min_terms: int = 4, max_terms: int = 6, min_digits: int = 1, max_digits: int = 1,
                 seed: int = 0, eval_fraction: float = 0.1, check_steps: bool = False, demo_slip_rate: float = 0.0):
        if min_terms < 2:
            raise ConfigError(f"min_terms={min_terms} must be >= 2 for running_sum (a step needs two terms)")
        if max_terms < min_terms or max_digits < min_digits or min_digits < 1:
            raise ConfigError(f"running_sum: need 2 <= min_terms <= max_terms and 1 <= min_digits <= max_digits, got "
                              f"terms {min_terms}..{max_terms}, digits {min_digits}..{max_digits}")
        self.name = "running_sum"
        self.terms, self.digits = (min_terms, max_terms), (min_digits, max_digits)
        if not 0.0 <= demo_slip_rate < 1.0:
            raise ConfigError(f"demo_slip_rate={demo_slip_rate} must be in [0, 1)")
        self.seed, self.eval_fraction, self.check_steps = seed, eval_fraction, check_steps
        self.demo_slip_rate = demo_slip_rate
        self._held_out: frozenset[str] | None = None

    def _draw(self, split: str, item: int) -> tuple[list[int], list[str]]:
        """Generator item `item` of `split`: a pure function of (seed, split, item)."""
        rng = random.Random(f"running_sum:{self.seed}:{split}:{item}")
        n = rng.randint(*self.terms)
        terms = []
        for _ in range(n):
            digits = rng.randint(*self.digits)
            terms.append(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
        return terms, [rng.choice("+-") for _ in range(n - 1)]

    def problem(self, split: str, index: int) -> Problem:
        check_split_index(split, index)
        for attempt in range(TRIES):
            terms, ops = self._draw(split, index * TRIES + attempt)
            prompt = str(terms[0]) + "".join(f"{op}{t}" for op, t in zip(ops, terms[1:])) + "="
            if in_split(split, prompt, self.eval_fraction, self.held_out_prompts):
                solution, answer = worked_solution(terms, ops)
                meta = {"split": split, "index": index, "terms": terms, "ops": ops, "solution": solution}
                return Problem(prompt, str(answer), meta)
        raise ConfigError(f"running_sum: no {split} prompt among {TRIES} draws; {too_small(split, self.eval_fraction)}")

    def held_out_prompts(self) -> frozenset[str]:
        """The prompts of eval items 0 .. HELD_OUT_RESERVE - 1, which validation excludes (made once, ~1 s)."""
        if self._held_out is None:
            self._held_out = frozenset(p.prompt for p in self.problems("eval", 0, HELD_OUT_RESERVE))
        return self._held_out

    def solution(self, problem: Problem) -> str:
        """The SFT demonstration: the reference chain, or with demo_slip_rate > 0 a noisy demonstrator's chain (its
        slips are a pure function of the task seed and the problem, so every SFT run sees the same data)."""
        if not self.demo_slip_rate:
            return problem.meta["solution"]
        meta = problem.meta
        rng = random.Random(f"running_sum-demo:{self.seed}:{meta['split']}:{meta['index']}")
        return worked_solution(meta["terms"], meta["ops"], self.demo_slip_rate, rng)[0]

    def reward(self, problem: Problem, completion: str) -> float:
        steps = parse_steps(completion)
        ops = problem.meta["ops"]
        if steps is None or len(steps) != len(ops) or steps[-1][3] != int(problem.answer):
            return 0.0
        if self.check_steps and completion.strip() != problem.meta["solution"]:
            return 0.0  # the reference chain is the only one restating every operation with correct arithmetic
        return 1.0
