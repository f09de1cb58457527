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
rollout step, 4 minibatches, lr 5e-5 (10 warmup updates), 40 rollout steps, held-out eval of 256 prompts every 10.
One run with every probe and the bf16 sampler: about 10-12 s per rollout step on the shared 2-core machine
(rollout 3.8 s, old pass 1.3 s, 4 updates 2.8 s, probes 4 x 1.1 s). Measured CPU time: 8.2 s per rollout step with
every probe and the bf16 sampler (a8's resumed steps 25-80: 7 min 33 s user), 3.6 s without probes (a7: 40 steps in
2.4 CPU-minutes). So a 40-step run with every probe is about 5.5 CPU-minutes and 25 runs about 70 minutes with
--workers 2 on two free cores (plus the 2 CPU-minute warm start); `--set probes.every=update:4` or fewer probes cut
most of the difference.

NOT YET A LEARNING REGIME. In the search below no setting raised held-out reward by 0.10 within 40 rollout steps:
lr >= 1e-4 lost 0.05-0.10 within 10 steps; lr 3e-5..5e-5 kept the policy and raised training reward by about 0.03-0.05
while held-out stayed within noise (standard error about 0.03 on 256 prompts). The warm start's failures are
confident arithmetic mistakes (149 of 161 failures on 256 held-out prompts differ from the reference first at a
step's result; greedy accuracy 0.53), not sampling noise, so sharpening gains little and RL has to learn arithmetic.

Search (4-block, 64-expert, top-8 model; running_sum 4-6 terms; warm start 500 SFT steps; mean completion length
28 tokens in every run; held-out = eval/reward on 256 prompts at the training temperature; wall times on the shared
machine, CPU = user time). Base command:
    moe-rl train --model.n-layers 4 --model.n-experts 64 --model.top-k 8 --model.d-expert 32 --task.name running_sum
      --task.min-terms 4 --task.max-terms 6 --rollout.sampling.max-new-tokens 48 --init-from <sft>
      --log.eval-every 10 --log.eval-prompts 256 --probes.enabled   (probes off) + the knobs below
  warm start: moe-rl sft (same model/task) --steps 500: 2.0 CPU-min; held-out 0.37 (T 1), 0.42 (T 0.7), 0.53 (greedy),
              0.27 (T 1.3). 300 steps: 0.07. 8 blocks, 600 steps: 4.5 CPU-min; 0.61 / 0.70 / 0.73 (T 1 / 0.7 / greedy).
  a1  32x8, 2 mb, lr 1e-4:                held-out 0.371 -> 0.289 (10) 0.324 0.324 0.348 (40); 1.4 CPU-min
  a2  64x8, 1 mb, lr 1e-4, warmup 5:      0.371 -> 0.273 (10); stopped
  a3  64x8, 2 mb, lr 3e-5:                0.371 -> 0.359 (10) 0.355 (20); training 0.36 -> 0.39; stopped at 30
  a4  64x8, 2 mb, lr 5e-5, temperature 1.3: 0.266 -> 0.262 (10) 0.277 (20); training 0.26 -> 0.30; stopped at 23
  a5  32x8, 2 mb, lr 1e-4, aux loss 0:    0.371 -> 0.320 (10) 0.285 0.305 0.324 (40)
  a6  32x8, 2 mb, lr 1e-4, temperature 1.3: 0.266 -> 0.230 (10) 0.234 0.191 0.285 (40); 1.3 CPU-min
  a7  64x8, 4 mb, lr 5e-5:                0.371 -> 0.375 (10) 0.375 0.363 0.367 (40); 2.4 CPU-min
  a8  a7 + bf16 sampler + every probe, 80 steps: 0.363 -> 0.367 (10) 0.414 0.371 0.344 (40) 0.387 0.363 0.414
      0.387 (80); training reward 0.355 (mean of steps 0-9) -> 0.40 (steps 70-79); about 11 CPU-minutes
Sampler mismatch (a8, rollout probe, bf16 sampler vs fp32 trainer, mean over 39 rollout steps): 4.3% of router
decisions (set_change), 14% of response tokens with any layer routed differently (token_any; 4 MoE layers),
mean |log p_sampler - log p_trainer| 0.007. With 8 MoE layers (8-block model, 3 steps): 4.1-5.3% and 24-29%.
The R3 paper reports about 10% of routers and 94% of tokens on a 48-layer engine.
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
