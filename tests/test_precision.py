"""The sampler's precision arms (moe_rl.model.precision): fp16 and fp8 engines differ from the fp32 trainer by a
measurable amount ordered by their precision, fp8's storage is float8 e4m3 with a per-matrix scale, the trainer's
weights come back bit for bit, and the engine state never leaks out."""

from __future__ import annotations

import pytest
import torch

from conftest import metric_lines, sample_and_refit, tiny_model, tiny_train_config
from moe_rl.config import RolloutConfig
from moe_rl.model.precision import FP8_MAX, engine_router_dtype, fp8_parameters, fp8_round_trip, fp8_weights
from moe_rl.rollout import SamplingConfig
from moe_rl.train import train
from moe_rl.trainer import Trainer


def test_the_trainer_arm_uses_the_trainers_autocast():
    from moe_rl.model.layers import autocast_context
    from moe_rl.model.precision import trainer_autocast

    for device in ("cpu", "cuda"):
        ours, theirs = trainer_autocast(torch.device(device)), autocast_context(torch.device(device))
        assert type(ours) is type(theirs)
        assert getattr(ours, "fast_dtype", None) == getattr(theirs, "fast_dtype", None)


def test_fp8_round_trip_by_hand():
    w = torch.tensor([FP8_MAX, 1.0, -0.3, 0.0])
    # scale 448 / 448 = 1; e4m3 has 3 mantissa bits: 0.3 = 1.2 x 2^-2 rounds to 1.25 x 2^-2 = 0.3125
    assert fp8_round_trip(w).tolist() == [448.0, 1.0, -0.3125, 0.0]
    experts = torch.stack([torch.tensor([[448.0, 0.3]]), torch.tensor([[4.48, 0.003]])])  # (E, in, out)
    out = fp8_round_trip(experts)
    assert out[0].tolist() == [[448.0, 0.3125]]
    # expert 1 has its own scale 4.48 / 448 = 0.01: 4.48 is exact, 0.003 = 0.3 x 0.01 rounds as 0.3 did
    assert torch.allclose(out[1], torch.tensor([[4.48, 0.003125]]), rtol=1e-6)
    assert fp8_round_trip(torch.zeros(2, 3)).eq(0).all()


def test_fp8_weights_cover_attention_and_experts_and_come_back_bit_for_bit():
    model = tiny_model()
    names = [name for name, _ in fp8_parameters(model)]
    assert names and all(".attn." in n or ".experts." in n for n in names)
    assert any("experts.w_gate_up" in n for n in names) and any("attn.q" in n for n in names)
    assert not any("router" in n or "embed" in n or "lm_head" in n for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with fp8_weights(model):
        inside = dict(model.named_parameters())
        assert all(torch.equal(inside[n], fp8_round_trip(before[n])) for n in names)
        assert not all(torch.equal(inside[n], before[n]) for n in names)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_engine_arms_are_ordered_by_their_precision():
    _, exact_gap = sample_and_refit("exact")  # samples as the trainer does (the old pass then replaces it)
    fp16, fp16_gap = sample_and_refit("fp16")
    bf16, bf16_gap = sample_and_refit("bf16")
    fp8, fp8_gap = sample_and_refit("fp8")
    assert exact_gap < 1e-5 < fp16_gap < bf16_gap < fp8_gap  # 10 mantissa bits, then 7, then 3 for the matrices
    assert fp16.set_change <= bf16.set_change < fp8.set_change < 0.5
    assert engine_router_dtype() is None


@pytest.mark.parametrize("routing_mode", ["native", "R2", "R3"])
def test_exact_sampler_logprobs_equal_the_old_pass_bit_for_bit(tmp_path, routing_mode):
    sampling = SamplingConfig(max_new_tokens=6, precision="exact")
    cfg = tiny_train_config(tmp_path / "run", total_steps=1, routing_mode=routing_mode,
                            rollout=RolloutConfig(prompts_per_step=4, group_size=4, sampling=sampling))
    trainer = Trainer(cfg, torch.device("cpu"))
    batch, _ = trainer.rollout()
    batch, chunks = trainer.minibatch_chunks(batch, cfg.minibatches)
    exact = trainer.exact_sampler(batch, chunks)
    old = trainer.old_pass(exact, chunks)
    mask = exact.response_mask_BN
    assert torch.equal(exact.sampler_logp_BN[mask], old.logp_BN[mask])
    assert torch.equal(exact.sampler_routing.ids_LBSK, old.trace.ids_LBSK)
    assert not torch.equal(batch.sampler_logp_BN[mask], old.logp_BN[mask])  # the KV-cached sampler's differ in rounding


def test_exact_arm_reads_zero_mismatch_in_a_run(tmp_path):
    sampling = SamplingConfig(max_new_tokens=6, precision="exact")
    cfg = tiny_train_config(tmp_path / "run", total_steps=2, routing_mode="R3",
                            rollout=RolloutConfig(prompts_per_step=4, group_size=4, sampling=sampling))
    for line in metric_lines(train(cfg)):
        assert line["rollout/log_ratio_abs_mean"] == 0.0 and line["rollout/kl"] == 0.0
        assert line["rollout/extreme_frac"] == 0.0 and line["correction/ess"] == 1.0
        assert line["routing/rollout/churn"] == 0.0
