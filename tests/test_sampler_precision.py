"""The emulated bf16 inference engine (`sampling.precision bf16`): its routing differs from the fp32 trainer's at a
measurable rate, the default sampler routes exactly like the trainer, and the engine state never leaks out."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from moe_rl.errors import ConfigError
from moe_rl.model.layers import engine_router_dtype
from moe_rl.rollout import SamplingConfig, generate
from moe_rl.routing import churn_stats, record_routing

PAD, EOS = 0, 2


def _sample_and_refit(precision: str):
    """(set_change, mean |log p_sampler - log p_trainer|) between the sampler and an fp32 full forward."""
    model = tiny_model(n_experts=16, top_k=4).eval()
    ids = torch.randint(3, 40, (32, 6), generator=torch.Generator().manual_seed(0))
    valid = torch.ones_like(ids, dtype=torch.bool)
    cfg = SamplingConfig(max_new_tokens=12, precision=precision)
    out = generate(model, ids, valid, cfg, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(1),
                   record=True)
    with torch.no_grad(), record_routing(model) as rec:
        logits = model(out.input_ids_BS, out.input_valid_BS).logits_BSV
    logp = logits[:, out.prompt_len - 1:].log_softmax(-1).gather(-1, out.response_BN[..., None]).squeeze(-1)
    mask = out.response_mask_BN
    return churn_stats(rec.trace(), out.routing, out.input_valid_BS), (logp - out.logprobs_BN)[mask].abs().mean()


def test_bf16_engine_routes_differently_from_the_fp32_trainer_and_the_default_does_not():
    same, same_gap = _sample_and_refit("trainer")
    assert same.set_change == 0.0 and same_gap < 1e-5
    engine, engine_gap = _sample_and_refit("bf16")
    assert 0.001 < engine.set_change < 0.5  # some router decisions flip, most do not
    assert engine.token_any > engine.set_change and engine_gap > 1e-4
    assert engine_router_dtype() is None  # the engine's router precision ends with the sampler call


def test_unknown_precision_is_refused():
    with pytest.raises(ConfigError, match="precision"):
        SamplingConfig(precision="fp4")
