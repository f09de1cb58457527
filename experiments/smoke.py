"""smoke: does the whole sweep path work? Warm start, two objectives x two routing modes, two RL steps each.

Used by the tests and CI. CPU: about 30 s in all with `--workers 2` on a shared 2-core machine, nearly all of it the
start of five Python processes (one warm start, four runs; the training itself takes under a second each).
`scale="gpu"` runs the same grid on cuda.

    moe-rl sweep smoke --workers 2
"""

from __future__ import annotations

from moe_rl.errors import check_choice
from moe_rl.experiments.common import SCALES
from moe_rl.model import ModelConfig
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import LogConfig, OptimConfig, RolloutConfig, SFTConfig, SFTLogConfig, TrainConfig
from moe_rl.sweep.grid import Experiment, axis, product

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, d_expert=32, d_dense=64,
                   max_seq_len=64)


def smoke(scale: str = "cpu", steps: int = 2) -> Experiment:
    """A 4-run sweep of a tiny model: objective grpo | gspo x routing_mode native | R2, `steps` rollout steps."""
    check_choice("scale", scale, SCALES)
    device = "cpu" if scale == "cpu" else "cuda"
    sampling = SamplingConfig(max_new_tokens=6)
    base = TrainConfig(
        total_steps=steps, minibatches=2, device=device, checkpoint_every=1, model=TINY,
        rollout=RolloutConfig(prompts_per_step=4, group_size=4, sampling=sampling),
        optim=OptimConfig(lr=3e-4), log=LogConfig(samples_every=1, eval_every=0),
    )
    warm = SFTConfig(total_steps=10, batch_size=16, log=SFTLogConfig(eval_every=10, eval_prompts=8), device=device,
                     model=TINY, sampling=sampling)
    grid = product(axis("objective.name", ["grpo", "gspo"]), axis("routing_mode", ["native", "R2"]))
    return Experiment(base, grid, warmstart=warm)
