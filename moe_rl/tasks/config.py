"""TaskConfig: which prompts, how hard, and how completions are scored. tyro turns the field docstrings into --help."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moe_rl.errors import ConfigError, check_choice, check_positive
from moe_rl.tasks.answer import MATCHERS
from moe_rl.tasks.gym import GYM_TASKS
from moe_rl.tasks.worked import WORKED_TASKS

SOURCES = ("reasoning_gym", "file")
OPERATORS = "+-*/"


@dataclass
class TaskConfig:
    """Prompt source and verifier. Default: chain_sum with 2-3 one-digit terms ("4-1-7=" -> "-4")."""

    source: Literal["reasoning_gym", "file"] = "reasoning_gym"
    """Where prompts come from: "reasoning_gym" (procedural generators, offline) or "file" (local JSONL/Parquet)."""
    name: Literal[GYM_TASKS + WORKED_TASKS] = "chain_sum"  # the tuple spells the choices; --help lists them
    """Procedural task (source=reasoning_gym): reasoning-gym's "basic_arithmetic", "chain_sum" or "countdown" (short
    answers), or "running_sum" (worked solutions of 20-80 characters, tasks/worked.py; uses the terms and digits
    knobs, e.g. 4-6 one-digit terms)."""
    seed: int = 0
    """Data seed (>= 0): fixes every problem of both splits, independently of the training seed."""
    eval_fraction: float = 0.1
    """Share held out for eval. reasoning_gym: of the prompt space, by a hash of the prompt text (no eval prompt is
    ever trained on). file without eval_path: of the rows, chosen by a permutation seeded with `seed`."""

    min_terms: int = 2
    """chain_sum, basic_arithmetic: fewest operands in an expression."""
    max_terms: int = 3
    """chain_sum, basic_arithmetic: most operands in an expression."""
    min_digits: int = 1
    """chain_sum, basic_arithmetic: fewest digits per operand."""
    max_digits: int = 1
    """chain_sum, basic_arithmetic: most digits per operand."""
    allow_negation: bool = False
    """chain_sum: allow negative operands. basic_arithmetic: allow negated groups "-(...)" (its operands can be
    negative regardless)."""
    check_steps: bool = False
    """running_sum: also require every worked step to be the right one (a process/format component); off = reward
    for a well-formed chain of the right length whose final answer is correct."""
    demo_slip_rate: float = 0.0
    """running_sum, SFT only: the chance that each step of a demonstration has a result off by 1 or 2, carried into
    the next steps (a noisy demonstrator). The warm start then makes such slips at about this rate when it samples,
    while its most likely chain is still right: the mistakes RL can learn to avoid. Rewards and evaluation are never
    affected; 0 gives the reference solutions."""
    operators: str = "+-*/"
    """basic_arithmetic, countdown: the operators to use, a subset of "+-*/" (chain_sum always uses + and -)."""

    min_numbers: int = 3
    """countdown: fewest given numbers (>= 2)."""
    max_numbers: int = 4
    """countdown: most given numbers."""
    min_value: int = 1
    """countdown: smallest given number (>= 1)."""
    max_value: int = 10
    """countdown: largest given number."""
    min_target: int = 10
    """countdown: smallest target (>= 1)."""
    max_target: int = 100
    """countdown: largest target."""

    path: str | None = None
    """file: the JSONL (.jsonl, .json) or Parquet (.parquet) file of problems; the train split when eval_path is set."""
    eval_path: str | None = None
    """file: a separate eval file. If unset, eval_fraction of `path`'s rows are held out instead."""
    prompt_column: str = "prompt"
    """file: column holding the prompt text, used as is."""
    answer_column: str = "answer"
    """file: column holding the reference answer (a string or a number)."""
    match: Literal["numeric", "exact"] = "numeric"
    """file: how completions are compared with the answer: "numeric" (-4 == -4.0) or "exact" (string, stripped)."""
    cache_dir: str | None = None
    """file: where `datasets` keeps its Arrow copy of the files; None = the Hugging Face default cache."""

    def __post_init__(self) -> None:
        check_choice("source", self.source, SOURCES)
        check_positive("seed", self.seed, allow_zero=True)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction={self.eval_fraction!r} must be in (0, 1)")
        if self.source == "reasoning_gym":
            self._check_no_files()
            self._check_gym()
        else:
            self._check_file()

    def _check_no_files(self) -> None:
        """A path with the generator source would be ignored (the run would train on the generator): refuse it
        rather than guess. A path does not switch the source, so that a config that names both keeps its meaning."""
        for field in ("path", "eval_path"):
            if getattr(self, field):
                raise ConfigError(f"task.{field}={getattr(self, field)!r} is set but task.source='reasoning_gym' "
                                  "(the default) ignores files; add --task.source file to train on it")

    def _check_gym(self) -> None:
        check_choice("name", self.name, GYM_TASKS + WORKED_TASKS)
        for knob in ("terms", "digits", "numbers", "value", "target"):
            lo, hi = getattr(self, f"min_{knob}"), getattr(self, f"max_{knob}")
            check_positive(f"min_{knob}", lo)
            if hi < lo:
                raise ConfigError(f"max_{knob}={hi} must be >= min_{knob}={lo}")
        if self.name in WORKED_TASKS and self.min_terms < 2:
            raise ConfigError(f"min_terms={self.min_terms} must be >= 2 for {self.name}")
        if self.min_numbers < 2:
            raise ConfigError(f"min_numbers={self.min_numbers} must be >= 2")
        if not self.operators or not set(self.operators) <= set(OPERATORS):
            raise ConfigError(f"operators={self.operators!r} must be a non-empty subset of {OPERATORS!r}")

    def _check_file(self) -> None:
        if not self.path:
            raise ConfigError("source='file' needs path (a .jsonl, .json or .parquet file)")
        check_choice("match", self.match, tuple(MATCHERS))
        for field in ("prompt_column", "answer_column"):
            if not getattr(self, field):
                raise ConfigError(f"{field} must name a column")
        if self.eval_path and _same_file(self.path, self.eval_path):
            raise ConfigError(f"task.eval_path={self.eval_path!r} is the same file as task.path: every eval problem "
                              "would be a training problem; drop eval_path (eval_fraction of path's rows are then held "
                              "out) or name a separate file")

    def gym_options(self) -> dict[str, Any]:
        """The reasoning-gym config fields for `name`, taken from the difficulty knobs above."""
        arithmetic = dict(min_terms=self.min_terms, max_terms=self.max_terms, min_digits=self.min_digits,
                          max_digits=self.max_digits, allow_negation=self.allow_negation)
        if self.name == "chain_sum":
            return arithmetic
        if self.name == "basic_arithmetic":
            # reasoning-gym's parenthesis-free generator evaluates left to right ("4+2*2" -> 12), so keep it off.
            return {**arithmetic, "operators": tuple(self.operators), "allow_parentheses": True}
        return dict(min_numbers=self.min_numbers, max_numbers=self.max_numbers, min_value=self.min_value,
                    max_value=self.max_value, min_target=self.min_target, max_target=self.max_target,
                    operators=tuple(self.operators))


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (./x and x, a symlink and its target); by spelling when one does not exist."""
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)
