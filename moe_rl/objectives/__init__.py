"""Policy objectives, one file each, all reachable by name and sharing one signature (docs/design.md section 6):

    objective(logp_BT, old_logp_BT, advantages, mask_BT, cfg) -> (loss, metrics: dict[str, float])

    spec = get_objective(cfg.name)          # ObjectiveSpec: fn, default clip, advantage flags, summary
    loss, metrics = spec(logp_BT, old_logp_BT, advantages, mask_BT, cfg)

To add an objective: a new file with a function decorated by `@register_objective(...)`, imported below.
"""

# Importing each file registers its objective.
from moe_rl.objectives import cispo, dapo, dr_grpo, gmpo, grpo, gspo, gspo_token  # noqa: F401
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.objectives.registry import OBJECTIVES, ObjectiveSpec, get_objective, objective_names, register_objective

__all__ = ["OBJECTIVES", "ObjectiveConfig", "ObjectiveSpec", "get_objective", "objective_names", "register_objective"]
