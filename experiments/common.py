"""The base configs the named experiments share, at two scales.

cpu: the default tiny native MoE (d_model 64, 4 layers, 8 experts, top-2) on chain_sum with 2-3 one-digit terms, warm
     started by 300 SFT steps (batch 64, lr 3e-3; 0.3-0.6 sampled reward, 15-30 s on one CPU thread). One RL rollout
     step (16 prompts x 8 completions, 4 minibatches, every routing probe) takes 0.3-1 s, more for deeper or wider
     models; each run process also spends about 4 s importing torch and reasoning-gym.
gpu: a deeper, wider model in the regime of the GSPO paper's churn claim (d_model 512, 24 layers, 64 experts, top-8,
     expert width 192 = 0.375 d_model as in Qwen3-30B-A3B) on harder chain_sum (2-5 two-digit terms), bf16 on one GPU,
     batches of 64 prompts x 16 completions. These sizes are a documented starting point, not yet tuned on GPU runs.
"""

from __future__ import annotations

from dataclasses import replace

from moe_rl.errors import ConfigError, check_choice
from moe_rl.model import ModelConfig
from moe_rl.objectives import ObjectiveConfig
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import (
    LogConfig,
    OptimConfig,
    RolloutConfig,
    SFTConfig,
    SFTLogConfig,
    SFTOptimConfig,
    TrainConfig,
)
from moe_rl.tasks import TaskConfig

SCALES = ("cpu", "gpu")
# GSPO paper section 5.1: each rollout batch is split into 4 minibatches, so 3 of 4 updates are off-policy.
MINIBATCHES = 4


def model(scale: str) -> ModelConfig:
    check_choice("scale", scale, SCALES)
    if scale == "cpu":
        return ModelConfig()
    return ModelConfig(d_model=512, n_layers=24, n_heads=8, n_kv_heads=4, n_experts=64, top_k=8, d_expert=192,
                       d_dense=1024, max_seq_len=128)


def task(scale: str) -> TaskConfig:
    return TaskConfig() if scale == "cpu" else TaskConfig(min_terms=2, max_terms=5, max_digits=2)


def sampling(scale: str) -> SamplingConfig:
    # chain_sum answers are at most 3 (cpu) or 4 (gpu) characters, plus EOS; a little slack lets failures show.
    return SamplingConfig(max_new_tokens=8 if scale == "cpu" else 12)


def rl_base(scale: str, *, total_steps: int, lr: float = 1e-4, objective: str = "grpo",
            routing_mode: str = "native") -> TrainConfig:
    """The RL run every experiment varies: warmup 10 optimizer steps, KL 0, 4 minibatches, all probes."""
    check_choice("scale", scale, SCALES)
    cpu = scale == "cpu"
    return TrainConfig(
        total_steps=total_steps, minibatches=MINIBATCHES, routing_mode=routing_mode,
        device="cpu" if cpu else "cuda", checkpoint_every=10 if cpu else 25,
        model=model(scale), task=task(scale),
        rollout=RolloutConfig(prompts_per_step=16 if cpu else 64, group_size=8 if cpu else 16,
                              sampling=sampling(scale)),
        objective=ObjectiveConfig(name=objective),
        optim=OptimConfig(lr=lr, warmup_steps=10),
        log=LogConfig(eval_every=10, eval_prompts=64 if cpu else 256),
    )


def warm_start(scale: str) -> SFTConfig:
    """SFT on task solutions so RL starts with partial success (the sweep fits model and task to each run)."""
    check_choice("scale", scale, SCALES)
    if scale == "cpu":
        return SFTConfig(total_steps=300, batch_size=64, optim=SFTOptimConfig(lr=3e-3),
                         log=SFTLogConfig(eval_every=100, eval_prompts=64), device="cpu",
                         model=model(scale), task=task(scale), sampling=sampling(scale))
    return SFTConfig(total_steps=2000, batch_size=256, optim=SFTOptimConfig(lr=1e-3, warmup_steps=100),
                     log=SFTLogConfig(eval_every=500, eval_prompts=256),
                     device="cuda", model=model(scale), task=task(scale), sampling=sampling(scale))


def wider(model: ModelConfig, d_model: int) -> ModelConfig:
    """`model` at residual width `d_model`: d_expert and d_dense scaled by d_model / model.d_model, the head count
    kept (so each head widens too); depth, E and K unchanged."""
    if d_model < model.n_heads or d_model % model.d_model and model.d_model % d_model:
        raise ConfigError(f"d_model={d_model} must be a multiple or a divisor of the regime's {model.d_model} "
                          f"(so d_expert scales exactly), at least n_heads={model.n_heads}")
    d_expert = model.d_expert * d_model // model.d_model
    if d_expert < 1 or d_model % model.n_heads:
        raise ConfigError(f"d_model={d_model} gives d_expert {d_expert} or a head width that is not whole "
                          f"(n_heads={model.n_heads})")
    return replace(model, d_model=d_model, d_expert=d_expert, d_dense=model.d_dense * d_model // model.d_model)
