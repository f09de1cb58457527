"""precision_arms: how far each sampler precision arm (`--rollout.sampling.precision`) is from the trainer, measured
on the committed CPU regime's warm start (experiments/long_regime.py) through the trainer's own path: one rollout
batch per arm (the same prompts and generator seed), then the old pass, native routing. Prints, per arm, the
sampler-vs-trainer k3 KL per token (`rollout/kl`), the extreme-token fraction (`rollout/extreme_frac`), the mean
|log-ratio| and the router-decision mismatch (`set_change`, pooled and per MoE layer) on the response-scoring
positions. What it simplifies on purpose: one batch and one seed per arm (a measurement of the arm, not a training
comparison; experiments/correction.py is the sweep).

    python -m moe_rl.experiments.precision_arms --warm-start runs/regime_warm            # CPU: ~7 min SFT + ~2 min
    python -m moe_rl.experiments.precision_arms --warm-start runs/regime_warm --prompts 64 --group-size 8

The warm start (800 SFT steps of regime_warm_start("cpu")) is trained into --warm-start first when it holds no
checkpoint. docs/metrics.md ("Sampler precision arms") has the numbers this printed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from moe_rl.commands.sft import sft
from moe_rl.experiments.long_regime import regime_base, regime_warm_start
from moe_rl.model.precision import SAMPLER_PRECISIONS
from moe_rl.rl.correction import mismatch_metrics
from moe_rl.rl.trainer import Trainer
from moe_rl.routing.churn import churn_stats


def measure_arm(warm: Path, precision: str, prompts: int, group_size: int, seed: int) -> dict:
    base = regime_base("cpu")
    rollout = replace(base.rollout, prompts_per_step=prompts, group_size=group_size,
                      sampling=replace(base.rollout.sampling, precision=precision))
    # out_dir is required by the Trainer but never written: nothing here saves or logs.
    cfg = replace(base, out_dir=str(warm.parent / "unused"), init_from=str(warm), seed=seed, rollout=rollout)
    trainer = Trainer(cfg, torch.device("cpu"))
    batch, _ = trainer.rollout()
    batch, chunks = trainer.minibatch_chunks(batch, cfg.minibatches)
    if precision == "exact":
        batch = trainer.exact_sampler(batch, chunks)
    old = trainer.old_pass(batch, chunks)
    mismatch = mismatch_metrics(old.logp_BN - batch.sampler_logp_BN, batch.response_mask_BN)
    routing = churn_stats(batch.sampler_routing, old.trace, batch.token_mask_BS())
    return {"k3_kl": mismatch["rollout/kl"], "extreme_frac": mismatch["rollout/extreme_frac"],
            "log_ratio_abs_mean": mismatch["rollout/log_ratio_abs_mean"], "set_change": routing.set_change,
            "set_change_per_layer": routing.set_change_per_layer, "tokens": int(batch.response_mask_BN.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-start", type=Path, required=True, help="run directory of the regime's warm start")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per arm's rollout batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every arm)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    checkpoint = args.warm_start / "checkpoints" / "latest.pt"
    if not checkpoint.exists():
        sft(replace(regime_warm_start("cpu"), out_dir=str(args.warm_start)))
    for precision in SAMPLER_PRECISIONS:
        print(precision, json.dumps(measure_arm(checkpoint, precision, args.prompts, args.group_size, args.seed)),
              flush=True)


if __name__ == "__main__":
    main()
