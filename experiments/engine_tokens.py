"""engine_tokens: does moe-rl's emulated bf16 sampler predict the real vLLM bf16 engine's mismatch on the very same
tokens? One rollout batch sampled by the vLLM bf16 engine from the `engine` experiment's warm start, then three
passes over its tokens: the trainer's (fp32, native routing: the old pass), and the emulated bf16 engine's
(moe_rl.model.precision.sampler_numerics "bf16", a full teacher-forced forward with its routing recorded). Prints,
per seed, the sampler-vs-trainer k3 per token and router set change (pooled and per MoE layer) of the real engine
and of the emulation on those tokens, the emulation against the engine directly, and the correlation over tokens
of the two log-ratios log pi_trainer - log pi_engine and log pi_trainer - log pi_emulated (1 would mean the
emulation predicts each token's mismatch). What it simplifies on purpose: the emulation runs the full sequence in
one forward, not the KV-cached decode the native sampler uses (the two round differently at about the fp32 level,
far below bf16's rounding).

    .venv-vllm/bin/python -m moe_rl.experiments.engine_tokens --warm-start sweeps/engine/warmstart/<key> --seeds 0 1 2
    .venv-vllm/bin/python -m moe_rl.experiments.engine_tokens --regime long \\
        --warm-start "sweeps/engine,regime=long,steps=10/warmstart/<key>"

CPU: under a minute for the three seeds of the small regime on a shared 2-core machine (one 16 x 8 rollout and two
forwards each), a few minutes for the long regime's 64 x 8. results/engine/ has what it printed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from moe_rl.experiments.engine import REGIMES, engine_base
from moe_rl.model.precision import sampler_numerics
from moe_rl.rl.correction import mismatch_metrics
from moe_rl.rl.policy import response_logprobs
from moe_rl.rl.rollout import RolloutBatch
from moe_rl.rl.trainer import Trainer
from moe_rl.routing.churn import churn_stats
from moe_rl.routing.replay import record_routing


@torch.no_grad()
def emulated_pass(model, batch: RolloutBatch, temperature: float):
    """(logp_BN, trace): the emulated bf16 engine's log-probs of the batch's response tokens and its routing."""
    device = batch.input_ids_BS.device
    with record_routing(model) as active, sampler_numerics(model, device, "bf16") as numerics:
        out = model(batch.input_ids_BS, batch.input_valid_BS, numerics=numerics)
    logits_BNV = out.logits_BSV[:, batch.prompt_len - 1:].float() / temperature
    return response_logprobs(logits_BNV, batch.response_BN), active.trace()


def compare(logp_a_BN, logp_b_BN, trace_a, trace_b, batch: RolloutBatch) -> dict:
    """k3 per token and router set change of b against a (a: the reference, as the trainer is for rollout/kl)."""
    mismatch = mismatch_metrics(logp_a_BN - logp_b_BN, batch.response_mask_BN)
    routing = churn_stats(trace_b, trace_a, batch.token_mask_BS())
    return {"k3": mismatch["rollout/kl"], "log_ratio_abs_mean": mismatch["rollout/log_ratio_abs_mean"],
            "set_change": routing.set_change, "set_change_per_layer": routing.set_change_per_layer}


def measure_seed(warm: Path, seed: int, regime: str = "small") -> dict:
    base = engine_base("cpu", steps=1, regime=regime)
    rollout = replace(base.rollout, engine="vllm")
    # out_dir is required by the Trainer but never written: nothing here saves or logs.
    cfg = replace(base, out_dir=str(warm.parent / "unused"), init_from=str(warm / "checkpoints" / "latest.pt"),
                  seed=seed, rollout=rollout)
    trainer = Trainer(cfg, torch.device("cpu"))
    batch, _ = trainer.rollout()
    batch, chunks = trainer.minibatch_chunks(batch, cfg.minibatches)
    old = trainer.old_pass(batch, chunks)
    emulated_logp_BN, emulated_trace = emulated_pass(trainer.model, batch, cfg.rollout.sampling.temperature)
    mask_BN = batch.response_mask_BN.bool()
    real_r, emulated_r = (old.logp_BN - batch.sampler_logp_BN)[mask_BN], (old.logp_BN - emulated_logp_BN)[mask_BN]
    return {"seed": seed, "tokens": int(mask_BN.sum()),
            "real": compare(old.logp_BN, batch.sampler_logp_BN, old.trace, batch.sampler_routing, batch),
            "emulated": compare(old.logp_BN, emulated_logp_BN, old.trace, emulated_trace, batch),
            "emulated_vs_real": compare(emulated_logp_BN, batch.sampler_logp_BN, emulated_trace,
                                        batch.sampler_routing, batch),
            "log_ratio_corr": torch.corrcoef(torch.stack([real_r, emulated_r]).double())[0, 1].item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-start", type=Path, required=True, help="the engine sweep's warm start run folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="sampling seeds, one batch each")
    parser.add_argument("--regime", choices=REGIMES, default="small", help="the engine experiment's regime")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:
        print(json.dumps(measure_seed(args.warm_start, seed, args.regime)), flush=True)


if __name__ == "__main__":
    main()
