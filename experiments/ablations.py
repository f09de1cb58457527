"""ablations: around one method (GRPO with native routing by default), what does each knob do to learning, stability
and churn? One knob at a time: clip range, minibatches per rollout batch, learning rate, number of experts, top-k
and depth; everything else as in the base run.

Clip ranges are scaled from the objective's own defaults (GRPO 0.2 / 0.27, GSPO 3e-4 / 4e-4), so the same ablation
works for any objective. Minibatches change how off-policy the updates are (1 = fully on-policy). Changes of
architecture get their own warm start (one per distinct model).

    moe-rl sweep ablations --workers 2                                    # CPU: 14 runs, 40 steps, 7 warm starts
    moe-rl sweep ablations --arg objective=gspo seeds=3
    moe-rl sweep ablations --arg scale=gpu --executor slurm --partition gpu --time 240

CPU (default): the base run (lr 1e-4) and 13 one-knob variants, 40 rollout steps each, 7 warm starts; measured 5 min
with --workers 2 on this shared 2-core machine (warm starts about 25 s, runs 11-41 s), roughly twice that with
--workers 1. GPU (`scale="gpu"`): 150 steps at lr 1e-5, not yet timed.
"""

from __future__ import annotations

from moe_rl.experiments.common import rl_base, warm_start
from moe_rl.objectives import get_objective
from moe_rl.sweep.grid import Experiment, axis, product, union


def ablations(scale: str = "cpu", objective: str = "grpo", routing_mode: str = "native", seeds: int = 1,
              steps: int = 0) -> Experiment:
    """The base run and one-knob variants of it, times `seeds`; `steps` 0 takes the scale's default (40 | 150)."""
    cpu = scale == "cpu"
    base = rl_base(scale, total_steps=steps or (40 if cpu else 150), objective=objective, routing_mode=routing_mode,
                   lr=1e-4 if cpu else 1e-5)
    lo, hi = get_objective(objective).default_clip
    clips = [{"objective.clip_low": None if lo is None else lo * s, "objective.clip_high": hi * s} for s in (0.5, 2)]
    lr = base.optim.lr
    lrs = [float(f"{lr / 3:.1g}"), float(f"{lr * 3:.1g}")]  # 3e-5 and 3e-4 around 1e-4, readable in run names
    m = base.model
    variants = union(
        [{}],
        clips,
        axis("minibatches", [1, 2, 8]),
        axis("optim.lr", lrs),
        axis("model.n_experts", [m.n_experts // 2, m.n_experts * 2]),
        axis("model.top_k", [max(1, m.top_k // 2), m.top_k * 2]),
        axis("model.n_layers", [m.n_layers // 2, m.n_layers * 2]),
    )
    return Experiment(base, product(variants, axis("seed", range(seeds))), warmstart=warm_start(scale))
