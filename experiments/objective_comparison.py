"""objective_comparison: in a regime where GRPO learns, with long completions and a sampler that routes differently
from the trainer, which objectives and routing modes learn, and how stable are they? GRPO (native routing), GRPO+R2,
GRPO+R3, GSPO and GSPO+R2, five seeds each, from one warm start.

The GSPO paper (arXiv 2507.18071) reports that token-level GRPO on MoE fails to converge without Routing Replay and
that GSPO needs none; the R3 paper (rollout routing replay) that replaying the inference engine's routing (R3) beats
replaying the trainer's old pass (R2) because the engine's rounding flips router decisions. Every run here uses the
regime of experiments/long_regime.py: running sums with worked solutions (about 28 generated tokens), a 4-block model
with 64 experts and top-8 routing, and a sampler running as an emulated bf16 inference engine while the trainer
stays fp32 (`sampling.precision bf16`), so R3 and R2 replay different routings. The mismatch is always on, not an
axis: without it R3 equals R2 on CPU and the fifth method would be a duplicate. `precision=trainer` turns it off.
Each run logs training and held-out reward (`eval/reward` on 256 held-out prompts every 10 steps), clip fractions,
F(2), per-update KL, update churn and the rollout probe's sampler-vs-trainer `set_change`.
`all_objectives=true` adds cispo and gmpo with native routing.

    moe-rl sweep objective_comparison --workers 2                          # CPU: 5 methods x 5 seeds = 25 runs
    moe-rl sweep objective_comparison --arg all_objectives=true            # 7 methods x 5 seeds = 35 runs
    moe-rl sweep objective_comparison --arg scale=gpu --executor slurm --partition gpu --time 240

CPU (default): see long_regime.py for the model, task and warm start; GRPO knobs 64 prompts x 8 completions per
rollout step, 2 minibatches, lr 3e-5 (10 warmup updates), 40 rollout steps. SEARCH below records every trial.
GPU (`scale="gpu"`): the common gpu model on running_sum with 4-8 terms of 1-2 digits; not yet run.
"""

from __future__ import annotations

from moe_rl.sweep.grid import Experiment, axis, product

from experiments.long_regime import SAMPLER_PRECISION, regime_base, regime_warm_start

METHODS = [("grpo", "native"), ("grpo", "R2"), ("grpo", "R3"), ("gspo", "native"), ("gspo", "R2")]
SECOND_TIER = [("cispo", "native"), ("gmpo", "native")]


def methods_grid(all_objectives: bool, seeds: int) -> list[dict]:
    methods = METHODS + (SECOND_TIER if all_objectives else [])
    points = [{"objective.name": name, "routing_mode": mode} for name, mode in methods]
    return product(points, axis("seed", range(seeds)))


def objective_comparison(scale: str = "cpu", seeds: int = 5, steps: int = 0, lr: float = 0.0,
                         all_objectives: bool = False, precision: str = SAMPLER_PRECISION) -> Experiment:
    """Methods x seeds from one warm start; `steps` and `lr` 0 take the regime's defaults (long_regime.py);
    `precision` is the sampler's ('bf16': emulated inference engine, 'trainer': identical routing)."""
    base = regime_base(scale, steps=steps, lr=lr, precision=precision)
    return Experiment(base, methods_grid(all_objectives, seeds), warmstart=regime_warm_start(scale, precision))
