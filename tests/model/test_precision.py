"""The sampler's precision arms (moe_rl.model.precision): fp16 and fp8 engines differ from the fp32 trainer by a
measurable amount ordered by their precision, fp8's storage is float8 e4m3 with a per-matrix scale, the trainer's
weights come back bit for bit, and the engine state never leaks out."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import metric_lines, sample_and_refit, tiny_model, tiny_train_config

from moe_rl.commands.train import train
from moe_rl.model import moe, precision
from moe_rl.model.precision import (
    FP8_MAX,
    engine_products,
    fp8_parameters,
    fp8_round_trip,
    fp8_weights,
    sampler_numerics,
)
from moe_rl.rl.rollout import SamplingConfig
from moe_rl.rl.run_config import RolloutConfig
from moe_rl.rl.trainer import Trainer


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


def _bf16_operands(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).bfloat16() for shape in shapes]


def test_engine_products_are_fp32_products_of_the_rounded_operands_rounded_once(monkeypatch):
    """Every product op the engine takes over gives exactly round_bf16(fp32 product of the bf16 operands)."""
    widened = []
    widen = precision._widen
    monkeypatch.setattr(precision, "_widen", lambda v: widened.append(v) or widen(v))
    a_MK, b_KN, bias_N = _bf16_operands((33, 64), (64, 48), (48,))
    a_BMK, b_BKN = _bf16_operands((3, 17, 32), (3, 32, 16), seed=1)
    x_ND, w_EDF = _bf16_operands((20, 32), (4, 32, 24), seed=2)
    counts_E = torch.tensor([5, 0, 9, 6])
    expected = {
        "mm": (a_MK.float() @ b_KN.float()).bfloat16(),
        "linear": torch.nn.functional.linear(a_MK.float(), b_KN.float().T, bias_N.float()).bfloat16(),
        "bmm": torch.bmm(a_BMK.float(), b_BKN.float()).bfloat16(),
        "grouped": torch.cat([x.float() @ w_EDF[e].float() for e, x in enumerate(x_ND.split(counts_E.tolist()))]
                             ).bfloat16(),
    }
    with torch.inference_mode(), engine_products(moe.grouped_mm):
        got = {
            "mm": torch.mm(a_MK, b_KN),
            "linear": torch.nn.functional.linear(a_MK, b_KN.T, bias_N),
            "bmm": a_BMK @ b_BKN,
            "grouped": torch._grouped_mm(x_ND, w_EDF, offs=counts_E.cumsum(0).to(torch.int32)),
        }
    for name in expected:
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], expected[name]), name
    assert len(widened) == 7  # mm's 2 operands, linear's 3, bmm's 2 went through the engine (grouped has its own)


def test_engine_products_round_like_torchs_bf16_kernels_but_for_rare_one_ulp_ties():
    """The engine's products against torch's own bf16 matmul: the same values but for a few outputs (different
    fp32 summation orders straddle a bf16 rounding boundary), and there by one bf16 ulp at most."""
    a_MK, b_KN = _bf16_operands((512, 64), (64, 128), seed=3)
    torch_bf16 = a_MK @ b_KN
    with engine_products(moe.grouped_mm):
        ours = a_MK @ b_KN
    differ = ours != torch_bf16
    assert differ.float().mean().item() < 1e-3
    ulp = torch_bf16.float().abs() * 2.0**-7  # bf16 keeps 8 significant bits: one ulp is at most |x| / 128
    assert bool(((ours.float() - torch_bf16.float()).abs() <= ulp)[differ].all())


def test_engine_products_leave_fp32_and_other_ops_alone():
    a_MK, b_KN = torch.randn(8, 16), torch.randn(16, 4)
    (c_MK,) = _bf16_operands((8, 16))
    with engine_products(moe.grouped_mm):
        assert torch.equal(a_MK @ b_KN, torch.mm(a_MK, b_KN))  # fp32: torch's own
        assert torch.equal(torch.nn.functional.silu(c_MK), torch.nn.functional.silu(c_MK))
        assert torch.nn.functional.silu(c_MK).dtype == torch.bfloat16


def test_the_bf16_sampler_samples_like_torchs_bf16_autocast(monkeypatch):
    """A tiny model's greedy decode in the bf16 engine, with the engine's products and with torch's bf16 kernels:
    the same tokens (both round every product to bf16; they differ only at rare one-ulp ties)."""
    model = tiny_model(n_layers=2).eval()
    prompts_BP = torch.randint(1, model.cfg.vocab_size, (16, 6), generator=torch.Generator().manual_seed(0))

    def greedy(new_tokens=8):
        with torch.inference_mode(), sampler_numerics(model, torch.device("cpu"), "bf16"):
            cache = model.new_cache(prompts_BP.shape[0], prompts_BP.shape[1] + new_tokens)
            logits_BV = model(prompts_BP, cache=cache).logits_BSV[:, -1]
            tokens = []
            for _ in range(new_tokens):
                tokens.append(logits_BV.argmax(-1, keepdim=True))
                logits_BV = model(tokens[-1], cache=cache).logits_BSV[:, -1]
        return torch.cat(tokens, dim=1)

    ours = greedy()
    monkeypatch.setattr(precision, "engine_products", contextlib.nullcontext)
    assert (greedy() == ours).float().mean().item() >= 0.95


def test_the_engine_groups_through_the_models_grouped_product_with_the_models_kernels(monkeypatch):
    """The engine's grouped products run through moe.grouped_mm with the model's own kernel set (the fp32 CPU
    kernels), not torch's per-expert loop."""
    model = tiny_model(n_layers=1, dispatch="grouped_mm").eval()
    calls = []
    monkeypatch.setattr(precision, "grouped_mm", lambda *args, **kwargs: calls.append(kwargs) or moe.grouped_mm(
        *args, **kwargs))
    with torch.inference_mode(), sampler_numerics(model, torch.device("cpu"), "bf16") as numerics:
        model(torch.randint(1, model.cfg.vocab_size, (4, 6)), numerics=numerics)
    assert calls and all(kwargs["kernels"] is model.kernels for kwargs in calls)


def test_the_engine_router_dtype_reaches_the_router_as_an_argument():
    """sampler_numerics yields the Numerics a forward passes down; the router computes its gate in the dtype it is
    handed, and in fp32 without one (nothing is left behind in a module for later forwards)."""
    model = tiny_model(n_layers=1).eval()
    with sampler_numerics(model, torch.device("cpu"), "bf16") as numerics:
        assert numerics.router_dtype == torch.bfloat16 and numerics.kernels is model.kernels
    with sampler_numerics(model, torch.device("cpu"), "trainer") as numerics:
        assert numerics.router_dtype is None
    router, x_TD = model.moe_layers()[0].router, torch.randn(5, model.cfg.d_model)
    w = router.gate.weight
    engine = router(x_TD, router_dtype=torch.bfloat16).logits_TE
    assert torch.equal(engine, torch.nn.functional.linear(x_TD.bfloat16(), w.bfloat16()).float())
    assert torch.equal(router(x_TD).logits_TE, torch.nn.functional.linear(x_TD, w))
