"""stress: the objective comparison where GRPO with native routing is pushed until it degrades: a higher learning rate
and more minibatches per rollout batch (more off-policy updates per sample), the knobs the GSPO paper's failure of
token-level GRPO on MoE is attributed to. Same five methods, same warm start and sampler mismatch as
objective_comparison; the question is which of them collapse (analysis/collapse.py: held-out reward below half its
start for the rest of the run, or diverged) and which keep learning.

    moe-rl sweep stress --workers 2                            # CPU: 5 methods x 5 seeds = 25 runs
    moe-rl sweep stress --arg lr=1e-4                          # a milder arm: decline, no collapse
    moe-rl sweep stress --arg scale=gpu --executor slurm --partition gpu --time 240

CPU (default): the objective_comparison regime (long_regime.py) with lr 2e-4 (4x) and 8 minibatches (2x: 7 of 8 updates
off-policy), 40 rollout steps. Probe runs (GRPO, native routing, bf16 sampler, probes off, 30 steps; the search's
base command in objective_comparison plus `--rollout.prompts-per-step 64 --minibatches 8 --optim.lr <lr>
--rollout.sampling.precision bf16`; half the start is 0.18):
    lr 2e-4: held-out 0.363 -> 0.207 (10) 0.145 (20) 0.125 (30), collapsed from step 20 by analysis/collapse.py;
             training reward 0.37 -> 0.12; 2.5 CPU-minutes (2 min 38 s wall).
    lr 1e-4: held-out 0.363 -> 0.301 (10) 0.285 (20) 0.266 (30), a steady loss of 0.10 but no collapse; 2.5 CPU-min.
With every probe on, expect about twice that per run: each of the 8 updates per rollout step pays for the update
probe.
GPU (`scale="gpu"`): the gpu regime at 3x its lr with 8 minibatches; not yet run.
"""

from __future__ import annotations

from moe_rl.sweep.grid import Experiment

from experiments.long_regime import SAMPLER_PRECISION, knobs, regime_base, regime_warm_start
from experiments.objective_comparison import methods_grid

CPU_STRESS = dict(lr=2e-4, minibatches=8)


def stress(scale: str = "cpu", seeds: int = 5, steps: int = 0, lr: float = 0.0, minibatches: int = 0,
           all_objectives: bool = False, precision: str = SAMPLER_PRECISION) -> Experiment:
    """The five methods in the stress arm; `lr` and `minibatches` 0 take the arm's defaults (cpu lr 2e-4, 8
    minibatches; gpu 3x the regime's lr, 8 minibatches), `steps` 0 the regime's."""
    k = knobs(scale)
    arm = CPU_STRESS if scale == "cpu" else dict(lr=3 * k["lr"], minibatches=8)
    base = regime_base(scale, steps=steps, lr=lr or arm["lr"], minibatches=minibatches or arm["minibatches"],
                       precision=precision)
    return Experiment(base, methods_grid(all_objectives, seeds), warmstart=regime_warm_start(scale, precision))
