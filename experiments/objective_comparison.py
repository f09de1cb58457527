"""objective_comparison: on the same warm-started MoE model and task, which objectives and routing modes learn, and
how stable are they? GRPO (native routing), GRPO+R2, GRPO+R3, GSPO and GSPO+R2, several seeds each.

The GSPO paper (arXiv 2507.18071) reports that token-level GRPO on MoE fails to converge without Routing Replay, and
that GSPO needs no replay. Every run uses the paper's off-policy setting (each rollout batch split into 4 minibatches,
so 3 of 4 updates are off-policy) and logs reward, held-out reward (`eval/reward` every 10 steps), clip fractions,
the extreme-token fraction F(2) and churn, so that seeds give confidence intervals per method.
`all_objectives=true` adds a second tier with native routing: cispo, gmpo, dapo, dr_grpo, gspo_token.
On CPU, R3 and R2 runs are nearly identical: the sampler routes like the trainer's old pass (no bf16 or kernel
mismatch) except at rare near-exact router ties, where the KV-cached and the full forward round differently (one
such flip in the committed study: at the last step of seed 2, seen by both its R2 and R3 runs, which are
identical up to there); R3 differs from R2 on GPU.

    moe-rl sweep objective_comparison --workers 2                        # CPU: 5 methods x 3 seeds = 15 runs
    moe-rl sweep objective_comparison --arg all_objectives=true seeds=5  # 10 methods x 5 seeds = 50 runs
    moe-rl sweep objective_comparison --arg lr=3e-4 steps=200
    moe-rl sweep objective_comparison --arg scale=gpu --executor slurm --partition gpu --time 240

CPU (default): a more MoE-like tiny model (4 layers, 32 experts, top-4, expert width 32) on chain_sum with two
one-digit terms, a prompt space of about 200 that recurs every dozen steps (RL over epochs of a fixed dataset),
warm started by only 120 SFT steps so that RL starts near 0.3 reward and has room to improve; lr 2e-4 with 10
warmup updates, 150 rollout steps (600 updates). Measured in a pilot (seed 0): GRPO and GSPO both raise the
training reward from about 0.37 to 0.46, with update churn about 1.5% per update and a clipped-token fraction of
3% (GRPO) vs 38% (GSPO). 15 runs of about 45 s each plus a 10 s warm start: about 7 min with --workers 2.
GPU (`scale="gpu"`): 200 rollout steps at lr 1e-5 on the gpu base, not yet timed.
"""

from __future__ import annotations

from dataclasses import replace

from moe_rl.sweep.grid import Experiment, axis, product
from moe_rl.model import ModelConfig
from moe_rl.tasks import TaskConfig

from experiments.common import rl_base, warm_start

# CPU: more experts per token than the default tiny model, so routing has more near-ties to churn on.
CPU_MODEL = ModelConfig(n_experts=32, top_k=4, d_expert=32)
CPU_TASK = TaskConfig(min_terms=2, max_terms=2)

METHODS = [("grpo", "native"), ("grpo", "R2"), ("grpo", "R3"), ("gspo", "native"), ("gspo", "R2")]
SECOND_TIER = [("cispo", "native"), ("gmpo", "native"), ("dapo", "native"), ("dr_grpo", "native"),
               ("gspo_token", "native")]


def objective_comparison(scale: str = "cpu", seeds: int = 3, steps: int = 0, lr: float = 0.0,
                         all_objectives: bool = False) -> Experiment:
    """Methods x seeds from one warm start; `steps` and `lr` 0 take the scale's defaults (cpu 150 steps at lr 2e-4,
    gpu 200 steps at lr 1e-5)."""
    cpu = scale == "cpu"
    base = rl_base(scale, total_steps=steps or (150 if cpu else 200), lr=lr or (2e-4 if cpu else 1e-5))
    sft = warm_start(scale)
    if cpu:
        base = replace(base, model=CPU_MODEL, task=CPU_TASK, log=replace(base.log, eval_every=25, eval_prompts=128))
        sft = replace(sft, model=CPU_MODEL, task=CPU_TASK, steps=120)
    methods = METHODS + (SECOND_TIER if all_objectives else [])
    points = [{"objective.name": name, "routing_mode": mode} for name, mode in methods]
    return Experiment(base, product(points, axis("seed", range(seeds))), warmstart=sft)
