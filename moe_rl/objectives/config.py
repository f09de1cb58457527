"""ObjectiveConfig: which objective to optimise and its clip range; parsed by tyro, each field documented."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe_rl.errors import ConfigError, check_positive
from moe_rl.objectives.registry import get_objective

# The built-in objectives, so that --help lists them; tests/commands/test_cli_errors.py checks this equals the registry.
ObjectiveName = Literal["grpo", "gspo", "gspo_token", "dr_grpo", "dapo", "cispo", "gmpo"]


@dataclass
class ObjectiveConfig:
    """The policy objective of an RL update (docs/design.md section 6)."""

    name: ObjectiveName = "grpo"
    """Objective: grpo, gspo, gspo_token, dr_grpo, dapo, cispo or gmpo (`moe_rl.objectives.objective_names()`)."""

    clip_low: float | None = None
    """e_lo: the ratio's lower bound is 1-e_lo (gmpo: log-ratio bound -e_lo; cispo: weight floor, default none).
    None = the objective's default (grpo 0.2, gspo 3e-4, dr_grpo 0.2, dapo 0.2, gmpo 0.4)."""

    clip_high: float | None = None
    """e_hi: the ratio's upper bound is 1+e_hi (gmpo: log-ratio bound +e_hi; cispo: weight cap 1+e_hi).
    None = the objective's default (grpo 0.27, gspo 4e-4, dr_grpo 0.2, dapo 0.28, cispo 5.0, gmpo 0.4)."""

    max_response_len: int | None = None
    """Dr. GRPO's constant loss denominator per sequence (the generation budget). None = the mask width T."""

    def __post_init__(self) -> None:
        space = get_objective(self.name).clip_space
        check_clip("clip_low", self.clip_low, space)
        check_clip("clip_high", self.clip_high, space)
        if self.max_response_len is not None:
            check_positive("max_response_len", self.max_response_len)


def check_clip(field: str, value: float | None, clip_space: str) -> None:
    """Refuse a negative clip, and for a ratio range a clip_low that leaves no positive lower bound."""
    if value is None:
        return
    check_positive(field, value, allow_zero=True)
    if clip_space == "ratio" and field == "clip_low" and value >= 1:
        raise ConfigError(
            f"clip_low={value!r} puts the ratio's lower bound 1-clip_low at {1 - value:g}, and a ratio is always "
            "> 0, so the range would be inverted or empty; choose 0 <= clip_low < 1"
        )


def resolve_clip(
    cfg: ObjectiveConfig, default: tuple[float | None, float | None], clip_space: str = "ratio"
) -> tuple[float | None, float | None]:
    """(e_lo, e_hi) of `cfg`, each falling back to the objective's `default`; checked against `clip_space`.

    Checked again here because an objective may be called directly with a config made for another one.
    """
    eps_lo = default[0] if cfg.clip_low is None else cfg.clip_low
    eps_hi = default[1] if cfg.clip_high is None else cfg.clip_high
    check_clip("clip_low", eps_lo, clip_space)
    check_clip("clip_high", eps_hi, clip_space)
    return eps_lo, eps_hi
