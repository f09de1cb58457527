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
Each run logs training and held-out reward (`eval/reward` on 256 held-out prompts every 5 rollout steps and after
training), clip fractions, F(2), per-update KL, update churn and the rollout probe's sampler-vs-trainer `set_change`.
`all_objectives=true` adds cispo and gmpo with native routing.

    moe-rl sweep objective_comparison --workers 2                          # CPU: 5 methods x 5 seeds = 25 runs
    moe-rl sweep objective_comparison --arg all_objectives=true            # 7 methods x 5 seeds = 35 runs
    moe-rl sweep objective_comparison --arg scale=gpu --executor slurm --partition gpu --time 240

CPU (default): see long_regime.py for the model, task and warm start (a noisy demonstrator: sampled held-out reward
0.38-0.41, greedy 0.81); GRPO knobs 64 prompts x 8 completions per rollout step, 4 minibatches, lr 5e-5 (10 warmup
updates), 30 rollout steps, held-out eval of 256 prompts every 5 steps. The committed study
(results/objective_comparison) is this sweep; its README has every number with its CI.

How the regime was found. With a warm start on clean solutions (500 SFT steps; held-out 0.37 sampled, 0.53 greedy)
no setting raised held-out reward by 0.10 within 40 rollout steps: lr >= 1e-4 lost 0.05-0.10 within 10 steps; lr
3e-5..5e-5 kept the policy and raised training reward by about 0.03-0.05 while held-out stayed within noise (standard
error about 0.03 on 256 prompts). That warm start's failures are confident arithmetic mistakes (149 of 161 failures
on 256 held-out prompts differ from the reference first at a step's result), not sampling noise, so RL had little to
sharpen. Trials from it (4-block, 64-expert, top-8 model; running_sum 4-6 terms; mean completion length 28 tokens in
every run; held-out = eval/reward on 256 prompts at the training temperature):
  a1  32x8, 2 mb, lr 1e-4:                held-out 0.371 -> 0.289 (10) 0.324 0.324 0.348 (40)
  a3  64x8, 2 mb, lr 3e-5:                0.371 -> 0.359 (10) 0.355 (20)
  a4  64x8, 2 mb, lr 5e-5, temperature 1.3: 0.266 -> 0.262 (10) 0.277 (20)
  a6  32x8, 2 mb, lr 1e-4, temperature 1.3: 0.266 -> 0.230 (10) 0.234 0.191 0.285 (40)
  a7  64x8, 4 mb, lr 5e-5:                0.371 -> 0.375 (10) 0.375 0.363 0.367 (40)
  a8  a7 + bf16 sampler + every probe, 80 steps: 0.363 -> 0.367 (10) 0.414 0.371 0.344 (40) ... 0.387 (80)
  on-policy (1 mb), 64x8: lr 2e-4: 0.371 -> 0.246 (10) 0.238 (20); lr 1e-4: 0.371 -> 0.328 0.324
The noisy-demonstrator warm start (`task.demo_slip_rate 0.15`, 800 SFT steps) changed that: its failures are slips
it samples but does not prefer, and the same GRPO knobs raised held-out reward by about 0.2 in 20 steps
(long_regime.py has the trial numbers).
Sampler mismatch (a8, rollout probe, bf16 sampler vs fp32 trainer, mean over 39 rollout steps): 4.3% of router
decisions (set_change), 14% of response tokens with any layer routed differently (token_any; 4 MoE layers),
mean |log p_sampler - log p_trainer| 0.007. With 8 MoE layers (8-block model, 3 steps): 4.1-5.3% and 24-29%.
The R3 paper reports about 10% of routers and 94% of tokens on a 48-layer engine.
GPU (`scale="gpu"`): the common gpu model on running_sum with 4-8 terms of 1-2 digits; not yet run.
"""

from __future__ import annotations

from moe_rl.experiments.long_regime import SAMPLER_PRECISION, regime_base, regime_warm_start
from moe_rl.sweep.grid import Experiment, axis, product

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
