"""The task interface: a deterministic stream of problems per split, a verifier, and a reference solution.

A trainer's data position is a plain integer: `task.problem("train", i)` is the same problem on every machine and
after every restart, so resuming from a checkpoint is exact. Three splits:

    train        what RL and SFT read
    eval         the held-out split every reported accuracy is measured on
    validation   for choosing settings (the sampling temperature of `moe-rl evaluate`), so held-out stays unbiased

The "train" and "eval" splits never share a prompt for reasoning-gym tasks (see gym.py); for files they are
disjoint sets of rows (see files.py). "validation" was added later without changing the other two: its prompts
hash into the eval part of the prompt space (never trained on) and exclude the first HELD_OUT_RESERVE held-out
prompts (gym.py); file tasks have no validation split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from moe_rl.errors import check_choice

SPLITS = ("train", "eval", "validation")


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer (see answer.py for what a completion must look like)."""

    prompt: str
    """The text the model is conditioned on; generation starts right after it."""
    answer: str
    """The reference answer text, as the verifier compares it."""
    meta: dict = field(default_factory=dict)
    """Where the problem came from (split, index, file and line, countdown numbers and target, ...)."""


def check_split_index(split: str, index: int) -> None:
    """Refuse an unknown split or a negative index."""
    check_choice("split", split, SPLITS)
    if index < 0:
        raise ValueError(f"problem index must be >= 0, got {index}")


class Task(ABC):
    """Prompts and a verifier. Subclasses implement `problem` and `reward`."""

    name: str
    """Short identifier used in run names and logs, e.g. "chain_sum" or "file:math.jsonl"."""

    @abstractmethod
    def problem(self, split: str, index: int) -> Problem:
        """The problem at `index` of `split`; the same (split, index) always gives the same problem."""

    def problems(self, split: str, start: int, count: int) -> list[Problem]:
        """Problems start .. start+count-1 of `split`, in order."""
        return [self.problem(split, start + k) for k in range(count)]

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Score a completion (the decoded text before EOS) in [0, 1]; never raises on malformed text."""

    def solution(self, problem: Problem) -> str:
        """The target completion for SFT warm start (EOS is appended by the caller)."""
        return problem.answer

    def num_problems(self, split: str) -> int | None:
        """How many distinct indices `split` has before it wraps around; None for an unbounded generator."""
        return None
