"""correction: does a rollout correction (TIS, IcePop) or routing replay (R3) remove what the sampler's numerics do to
GRPO, and what does each leave? GRPO native, +TIS, +IcePop, R3 and R3+TIS under the bf16 and fp8 sampler arms and the
`exact` control (zero mismatch), 3 seeds each, from one warm start.

The field's two remedies for train-inference mismatch in MoE RL: replaying the engine's routing (R3, Ma et al.,
arXiv 2510.11370) and importance-sampling the engine's tokens back to the trainer's distribution: truncated IS (TIS,
verl / TRL / NeMo-RL / OpenRLHF) or IcePop's band (Ling team, Ring-1T). The regime is objective_comparison's
(experiments/long_regime.py: running sums, a 4-block model of 64 experts with top-8 routing, the noisy-demonstrator
warm start); the sampler precision is the axis here (`bf16`, `fp8`: expert and attention weights in float8 e4m3 with
a per-matrix scale; `exact`: the sampler's log-probs and routing are the trainer's old pass, bit for bit). Under
`exact` every correction is the identity (every weight is 1) and R3 equals R2, so its five methods measure the seed
noise of the comparison. Each run logs held-out reward, the mismatch metrics (`rollout/kl`, `rollout/extreme_frac`,
`routing/rollout/set_change`) and the correction's (`correction/ess`, `correction/truncated_frac`,
`correction/zeroed_frac`); docs/metrics.md has them with their names in verl, slime and NeMo-RL.

    moe-rl sweep correction --workers 2                        # CPU: 5 methods x 3 precisions x 3 seeds = 45 runs
    moe-rl sweep correction --arg seeds=5 --arg steps=40
    moe-rl sweep correction --arg scale=gpu --executor slurm --partition gpu --time 240

CPU, timed: a 2-rollout-step run of the fp8 + TIS point from the regime's warm start took 120 s of wall time on the
2-core machine shared with three other jobs (rollout 14 s and 36 s, old pass 2 s and 5 s, 4 updates 7 s per step,
plus the held-out evaluations at step 0 and at the end: 256 prompts sampled and greedy), i.e. about 20-45 s per
rollout step and 20-25 s per evaluation. A 30-step run (7 evaluations) is then about 15-25 minutes there, and the 45
runs about 6-9 hours with --workers 2 (less on idle cores: objective_comparison's bf16 runs measured about 8 s per
rollout step with two runs sharing 2 cores); the warm start (800 SFT steps) took 6.6 minutes. Not yet run;
results/correction/ is where its committed study goes.
GPU (`scale="gpu"`): the gpu regime with the same grid; not yet run.
"""

from __future__ import annotations

from moe_rl.sweep.grid import Experiment, axis, product

from experiments.long_regime import regime_base, regime_warm_start

TIS = {"correction.is_level": "token", "correction.is_cap": 2.0}  # verl's default cap
ICEPOP = {"correction.is_level": "token", "correction.is_band": (0.5, 2.0)}  # IcePop's published band
METHODS = [
    {"routing_mode": "native"},
    {"routing_mode": "native", **TIS},
    {"routing_mode": "native", **ICEPOP},
    {"routing_mode": "R3"},
    {"routing_mode": "R3", **TIS},
]
PRECISIONS = ("bf16", "fp8", "exact")
LABELS = {"rollout.sampling.precision": "prec", "correction.is_level": "is", "correction.is_cap": "cap",
          "correction.is_band": "band"}


def correction(scale: str = "cpu", seeds: int = 3, steps: int = 0, lr: float = 0.0) -> Experiment:
    """GRPO's five mismatch remedies x three sampler arms x seeds; `steps` and `lr` 0 take the regime's defaults."""
    base = regime_base(scale, steps=steps, lr=lr)
    # Seed first: a sweep stopped part way leaves whole seeds of every cell, the pairs the comparison needs.
    grid = product(axis("seed", range(seeds)), axis("rollout.sampling.precision", PRECISIONS), METHODS)
    # One warm start serves every arm: SFT does not sample, and the arm only changes how its evaluation does.
    return Experiment(base, grid, warmstart=regime_warm_start(scale), labels=LABELS)
