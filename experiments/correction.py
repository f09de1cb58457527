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

    moe-rl sweep correction --arg steps=10 --workers 2         # CPU: 5 methods x 3 precisions x 3 seeds = 45 runs
    moe-rl sweep correction --arg seeds=5 --arg steps=40
    moe-rl sweep correction --arg scale=gpu --executor slurm --partition gpu --time 240

CPU, timed (2026-12-01, a 2-core AVX2 machine, --workers 2): the committed study is `--arg steps=10` (40 updates;
the regime's held-out gain comes mostly in its first 10 rollout steps). Its 45 runs took 59 minutes: bf16 and fp8
runs 152-253 s each, exact runs 61-104 s (`exact` samples in fp32, without the bf16 or fp8 emulation, then takes
the old pass's log-probs and routing), after a 230 s warm start (800 SFT steps). The default 30 steps take about three
times as long. results/correction/ holds the report, with per-run tables and the warm start's baseline
(results/README.md says what it shows).
GPU (`scale="gpu"`): the gpu regime with the same grid; not yet run.
"""

from __future__ import annotations

from moe_rl.experiments.long_regime import regime_base, regime_warm_start
from moe_rl.sweep.grid import Experiment, axis, product

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
