"""stress: the objective comparison where GRPO with native routing is pushed until it collapses: a higher learning rate
and more minibatches per rollout batch (more off-policy updates per sample), the knobs the GSPO paper's failure of
token-level GRPO on MoE is attributed to. Same five methods, same warm start and sampler mismatch as
objective_comparison; the question is which of them collapse (analysis/collapse.py: held-out reward below half its
start for the rest of the run, or diverged) and which keep learning.

    moe-rl sweep stress --workers 2                            # CPU: 5 methods x 3 seeds = 15 runs
    moe-rl sweep stress --arg lr=2e-4                          # a milder arm: rises, then declines
    moe-rl sweep stress --arg scale=gpu --executor slurm --partition gpu --time 240

CPU (default): the objective_comparison regime (long_regime.py: noisy-demonstrator warm start, held-out 0.383) with
lr 4e-4 (8x) and 8 minibatches (2x: 7 of 8 updates off-policy), 10 rollout steps, 3 seeds (a cost choice: each
rollout step pays for 8 updates). Probe runs of GRPO, native routing, bf16 sampler, probes off, one seed, 15 steps
(`moe-rl train ... --optim.lr <lr> --minibatches 8 --log.eval-every 5`; held-out at steps 0, 5, 10):
    lr 2e-4: 0.383 -> 0.504 -> 0.492, 0.441 at step 15: learns first, then declines; no collapse.
    lr 4e-4: 0.383 -> 0.203 -> 0.133: collapsed from step 5 (below half the start, 0.19, and staying there).
    lr 6e-4: 0.383 -> 0.055 -> 0.020: collapsed at once.
About 8 s per rollout step with two runs sharing 2 cores.
GPU (`scale="gpu"`): the gpu regime at 3x its lr with 8 minibatches; not yet run.
"""

from __future__ import annotations

from moe_rl.experiments.long_regime import SAMPLER_PRECISION, knobs, regime_base, regime_warm_start
from moe_rl.experiments.objective_comparison import methods_grid
from moe_rl.sweep.grid import Experiment

CPU_STRESS = dict(lr=4e-4, minibatches=8, steps=10)


def stress(scale: str = "cpu", seeds: int = 3, steps: int = 0, lr: float = 0.0, minibatches: int = 0,
           all_objectives: bool = False, precision: str = SAMPLER_PRECISION) -> Experiment:
    """The five methods in the stress arm; `lr` and `minibatches` 0 take the arm's defaults (cpu lr 4e-4, 8
    minibatches, 10 steps; gpu 3x the regime's lr, 8 minibatches, the regime's steps)."""
    k = knobs(scale)
    arm = CPU_STRESS if scale == "cpu" else dict(lr=3 * k["lr"], minibatches=8, steps=k["steps"])
    base = regime_base(scale, steps=steps or arm["steps"], lr=lr or arm["lr"],
                       minibatches=minibatches or arm["minibatches"], precision=precision)
    return Experiment(base, methods_grid(all_objectives, seeds), warmstart=regime_warm_start(scale, precision))
