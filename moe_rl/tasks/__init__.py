"""Tasks: prompts, verifiers and tokenizers.

    task = build_task(TaskConfig())                  # chain_sum, 2-3 one-digit terms
    problem = task.problem("train", 0)               # deterministic in (split, index): resume is exact
    task.reward(problem, "-4")                       # in [0, 1]; the completion is the answer text (answer.py)
    task.solution(problem)                           # SFT target; the caller appends EOS

Sources: reasoning-gym generators with compact prompts (gym.py), our own worked-solution generators with long
completions (worked.py: running_sum) and local JSONL/Parquet files (files.py).
"""

from __future__ import annotations

from moe_rl.errors import check_choice
from moe_rl.tasks.answer import parse_answer, parse_number
from moe_rl.tasks.base import SPLITS, Problem, Task
from moe_rl.tasks.config import TaskConfig
from moe_rl.tasks.files import FileTask
from moe_rl.tasks.gym import GYM_TASKS, GymTask
from moe_rl.tasks.tokenizer import CharTokenizer, Tokenizer
from moe_rl.tasks.worked import WORKED_TASKS, RunningSumTask

TOKENIZERS = ("char",)


def build_tokenizer(name: str = "char") -> Tokenizer:
    """A tokenizer by name; "char" (CharTokenizer, vocab 99) is the one for the native tiny models."""
    check_choice("tokenizer", name, TOKENIZERS)
    return CharTokenizer()


def build_task(cfg: TaskConfig, tokenizer: Tokenizer | None = None) -> Task:
    """The task `cfg` describes. File records are checked against `tokenizer` (default: CharTokenizer)."""
    if cfg.source == "reasoning_gym" and cfg.name in WORKED_TASKS:
        return RunningSumTask(cfg.min_terms, cfg.max_terms, cfg.min_digits, cfg.max_digits, seed=cfg.seed,
                              eval_fraction=cfg.eval_fraction, check_steps=cfg.check_steps,
                              demo_slip_rate=cfg.demo_slip_rate)
    if cfg.source == "reasoning_gym":
        return GymTask(cfg.name, cfg.gym_options(), seed=cfg.seed, eval_fraction=cfg.eval_fraction)
    return FileTask(
        cfg.path, cfg.eval_path, prompt_column=cfg.prompt_column, answer_column=cfg.answer_column,
        match=cfg.match, seed=cfg.seed, eval_fraction=cfg.eval_fraction, tokenizer=tokenizer,
        cache_dir=cfg.cache_dir,
    )


__all__ = [
    "GYM_TASKS", "SPLITS", "TOKENIZERS", "WORKED_TASKS", "CharTokenizer", "FileTask", "GymTask", "Problem",
    "RunningSumTask", "Task", "TaskConfig",
    "Tokenizer", "build_task", "build_tokenizer", "parse_answer", "parse_number",
]
