"""The objective registry: every policy objective under one name and one signature.

    objective(logp_BT, old_logp_BT, advantages, mask_BT, cfg) -> (loss, metrics: dict[str, float])

An objective file registers its function with `@register_objective(name, default_clip=..., ...)`; the spec also carries
what the trainer must do before calling it (advantage normalisation, dropping zero-std groups), so those choices
live next to the formula that needs them instead of in `if name == ...` branches of the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from moe_rl.errors import check_choice

if TYPE_CHECKING:
    import torch

ObjectiveFn = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]

# What the clip numbers bound: the ratio w in [1-e_lo, 1+e_hi] (PPO style, the gradient is cut outside), log w in
# [-e_lo, e_hi] (GMPO), or the stop-gradient importance weight (CISPO truncates it, the gradient is never cut).
CLIP_SPACES = ("ratio", "log_ratio", "is_weight")
# What the loss averages over: non-empty sequences (grpo, gspo, ...), response tokens of the batch (dapo, cispo) or
# rows, empty or not (dr_grpo's constant B * L_max). Data-parallel training weights each rank's loss by its share of
# this count, so that the averaged gradient is the gradient of the loss on all ranks' rows together (trainer.py).
LOSS_DENOMINATORS = ("sequences", "tokens", "rows")


@dataclass(frozen=True)
class ObjectiveSpec:
    """One registered objective: its function, default clip and the advantage treatment it expects."""

    name: str
    fn: ObjectiveFn
    default_clip: tuple[float | None, float | None]
    clip_space: str
    normalize_adv_by_std: bool
    drop_zero_std_groups: bool
    loss_denominator: str
    summary: str

    # cfg: objectives.config.ObjectiveConfig
    def __call__(self, logp_BT, old_logp_BT, advantages, mask_BT, cfg: Any) -> Any:
        return self.fn(logp_BT, old_logp_BT, advantages, mask_BT, cfg)


_REGISTRY: dict[str, ObjectiveSpec] = {}
OBJECTIVES = MappingProxyType(_REGISTRY)
"""Read-only view name -> ObjectiveSpec of every registered objective."""


def register_objective(
    name: str,
    default_clip: tuple[float | None, float | None],
    normalize_adv_by_std: bool = True,
    drop_zero_std_groups: bool = False,
    clip_space: str = "ratio",
    loss_denominator: str = "sequences",
) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Decorator: register `fn` under `name`. The summary is the first line of its docstring."""
    check_choice("clip_space", clip_space, CLIP_SPACES)
    check_choice("loss_denominator", loss_denominator, LOSS_DENOMINATORS)

    def decorate(fn: ObjectiveFn) -> ObjectiveFn:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} is registered twice")
        summary = next(iter((fn.__doc__ or "").strip().splitlines()), "")
        _REGISTRY[name] = ObjectiveSpec(
            name, fn, default_clip, clip_space, normalize_adv_by_std, drop_zero_std_groups, loss_denominator, summary
        )
        return fn

    return decorate


def objective_names() -> list[str]:
    """Names of all registered objectives, sorted."""
    return sorted(_REGISTRY)


def get_objective(name: str) -> ObjectiveSpec:
    """The spec registered under `name`; an unknown name raises ConfigError listing the valid ones."""
    check_choice("objective.name", name, objective_names())
    return _REGISTRY[name]
