"""reasoning-gym tasks with compact prompts that a tiny character-level model can read.

reasoning-gym's own questions are long English sentences; we rebuild a short prompt from each entry's metadata and
keep its reference answer. No spaces anywhere; the completion starts right after the last prompt character.

    dataset            prompt                 reference answer      verifier
    chain_sum          "4-1-7="               "-4"                  numeric (answer.py)
    basic_arithmetic   "(-9/9)="  "2--1="     "-1"  "3"             numeric; "/" is floor division, as in reasoning-gym
                                                                    (its divisors are chosen to divide exactly)
    countdown          "6,6,2>24:"            "6*(6-2)"             expression over the numbers (expr.py)

"2--1=" reads "2 minus -1". The countdown prompt is the numbers (comma-separated), ">", the target, ":"; the reference
is reasoning-gym's solution with spaces removed, and any other valid expression scores 1 too.

Determinism and splits. reasoning-gym generates item j of a dataset from `Random(seed + j)`, so item j is a pure
function of (dataset, knobs, seed, j). Each split draws from its own block of 2**41 seeds, far apart. Different
seeds alone would not keep eval prompts out of training, because small settings have tiny prompt spaces (2 terms of
1 digit: 200 prompts). So a prompt belongs to eval iff a hash of its text falls below `eval_fraction`, and item i of
a split is the first of the generator items i*1024 .. i*1024+1023 whose prompt belongs to that split. The two splits
therefore never share a prompt, and the eval split is the same set of prompts for every seed.

The validation split (added later, leaving train and eval as they were) draws from a third seed block, far from
every seed's train and eval blocks; item i is the first item of its window whose prompt hashes into eval and is not
the prompt of one of the first HELD_OUT_RESERVE eval items. So validation never shares a prompt with train, nor with
any held-out evaluation of up to HELD_OUT_RESERVE prompts (`moe-rl evaluate` refuses more). A prompt space whose eval
part those held-out items exhaust (2-3 one-digit terms: about 420 eval prompts) has no validation split: asking for
one raises ConfigError.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from moe_rl.errors import ConfigError, check_choice
from moe_rl.tasks.answer import numeric_reward
from moe_rl.tasks.base import Problem, Task, check_split_index
from moe_rl.tasks.expr import countdown_reward

GYM_TASKS = ("basic_arithmetic", "chain_sum", "countdown")
TRIES = 1024  # generator items tried per problem; P(no eval prompt among them) = (1 - eval_fraction) ** 1024
_BLOCK = 2**41  # seeds per split block; item j uses Random(block + j), j < _BLOCK
_VALIDATION_BLOCKS = 2**62  # validation's block is seed * _BLOCK above this: no seed below 2**20 uses it for train/eval
HELD_OUT_RESERVE = 2048  # validation excludes the prompts of eval items 0 .. HELD_OUT_RESERVE - 1


def in_eval(prompt: str, eval_fraction: float) -> bool:
    """True if `prompt` is held out for eval: a stable hash of the text, read as a number in [0, 1), < fraction."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8, person=b"moe-rl-split").digest()
    return int.from_bytes(digest, "big") / 2**64 < eval_fraction


def in_split(split: str, prompt: str, eval_fraction: float, held_out: Callable[[], frozenset[str]]) -> bool:
    """Whether `prompt` belongs to `split`: train and eval by the hash (in_eval); validation by the hash and by not
    being one of the held-out prompts `held_out()` returns (called only for a validation candidate)."""
    if split == "train":
        return not in_eval(prompt, eval_fraction)
    if not in_eval(prompt, eval_fraction):
        return False
    return split == "eval" or prompt not in held_out()


def too_small(split: str, eval_fraction: float) -> str:
    """Why a split found no prompt, and what to change."""
    if split == "validation":
        return (f"the eval part of the prompt space (eval_fraction={eval_fraction}) holds little beyond the first "
                f"{HELD_OUT_RESERVE} held-out prompts, which validation excludes (widen the difficulty range)")
    return f"the prompt space is too small for eval_fraction={eval_fraction} (widen the difficulty range or change it)"


def compact(text: str) -> str:
    """Remove all whitespace: "( -9 / 9 )" -> "(-9/9)"."""
    return "".join(text.split())


def _arithmetic(entry: dict) -> tuple[str, str, dict]:
    """A chain_sum / basic_arithmetic entry -> (prompt "4-1-7=", answer "-4", meta)."""
    return compact(entry["metadata"]["expression"]) + "=", entry["answer"], {}


def _countdown(entry: dict) -> tuple[str, str, dict]:
    """A countdown entry -> (prompt "6,6,2>24:", answer "6*(6-2)", meta with the numbers and the target)."""
    numbers, target = list(entry["metadata"]["numbers"]), int(entry["metadata"]["target"])
    prompt = ",".join(map(str, numbers)) + f">{target}:"
    return prompt, compact(entry["answer"]), {"numbers": numbers, "target": target}


_FORMATS = {"chain_sum": _arithmetic, "basic_arithmetic": _arithmetic, "countdown": _countdown}


def _create_dataset(name: str, options: dict[str, Any], seed: int) -> Any:
    """A reasoning-gym dataset; its assertion-based validation becomes a ConfigError."""
    import reasoning_gym  # lazy: importing it loads ~100 generators and sympy (about 2 s)

    try:
        return reasoning_gym.create_dataset(name, size=_BLOCK, seed=seed, **options)
    except (AssertionError, TypeError) as err:
        raise ConfigError(f"reasoning-gym {name} rejected options {options}: {err}") from None


class GymTask(Task):
    """A reasoning-gym dataset as a Task: compact prompts, hash-disjoint splits, our own verifiers."""

    def __init__(self, name: str, options: dict[str, Any], seed: int = 0, eval_fraction: float = 0.1):
        """`options` are the reasoning-gym config fields for `name` (e.g. min_terms); `seed` >= 0 fixes all data."""
        check_choice("name", name, GYM_TASKS)
        if seed < 0:
            raise ConfigError(f"seed={seed} must be >= 0 (reasoning-gym folds negative seeds onto positive ones)")
        self.name = name
        self.eval_fraction = eval_fraction
        self._format = _FORMATS[name]
        self._options, self._seed = options, seed
        self._datasets = {s: _create_dataset(name, options, (2 * seed + k) * _BLOCK)
                          for k, s in enumerate(("train", "eval"))}
        self._held_out: frozenset[str] | None = None

    def problem(self, split: str, index: int) -> Problem:
        """Item `index` of `split`: the first generator item of its window whose prompt belongs to `split`."""
        check_split_index(split, index)
        if index >= _BLOCK // TRIES:
            raise ValueError(f"problem index {index} is beyond this generator's range ({_BLOCK // TRIES})")
        for attempt in range(TRIES):
            item = index * TRIES + attempt
            problem = self._candidate(split, item)
            if problem is not None and in_split(split, problem.prompt, self.eval_fraction, self.held_out_prompts):
                return Problem(problem.prompt, problem.answer, {"split": split, "index": index, **problem.meta})
        raise ConfigError(f"{self.name}: no {split} prompt among {TRIES} generated items; "
                          f"{too_small(split, self.eval_fraction)}")

    def held_out_prompts(self) -> frozenset[str]:
        """The prompts of eval items 0 .. HELD_OUT_RESERVE - 1, which validation excludes (made once, ~1 s)."""
        if self._held_out is None:
            self._held_out = frozenset(p.prompt for p in self.problems("eval", 0, HELD_OUT_RESERVE))
        return self._held_out

    def _candidate(self, split: str, item: int) -> Problem | None:
        """Generator item `item` of `split` as a Problem, or None if reasoning-gym could not build it."""
        if split not in self._datasets:  # validation: its dataset is made on first use
            self._datasets[split] = _create_dataset(self.name, self._options,
                                                    _VALIDATION_BLOCKS + self._seed * _BLOCK)
        try:
            entry = self._datasets[split][item]
        except ValueError:  # countdown gives up when no expression hits the target range
            return None
        prompt, answer, meta = self._format(entry)
        return Problem(prompt, answer, {"source_index": item, **meta})

    def reward(self, problem: Problem, completion: str) -> float:
        """Countdown: a valid expression reaching the target; arithmetic: the number equal to the answer."""
        if self.name == "countdown":
            return countdown_reward(completion, problem.meta["numbers"], problem.meta["target"])
        return numeric_reward(completion, problem.answer)
