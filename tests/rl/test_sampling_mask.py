"""Sampling-mask consistency with top_p < 1: the sampler reports the log-probs of the truncated distribution it drew
from, a trainer that scores the full distribution is off by the log of the nucleus mass on every token (the bias),
and `keep_sampling_mask` removes it (the trainer renormalises over the sampler's nucleus)."""

import math

import torch
from conftest import tiny_model

from moe_rl.rl.policy import policy_forward
from moe_rl.rl.rollout import SamplingConfig, draw, generate, nucleus_support, to_rollout_batch

PAD, EOS = 0, 2


def test_nucleus_draws_and_scores_the_renormalised_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # mass before each token in order: 0, 0.5, 0.8, 0.95; top_p 0.7 keeps the first two (mass 0.8)
    assert nucleus_support(probs, 0.7).tolist() == [[True, True, False, False]]
    g = torch.Generator().manual_seed(0)
    drawn = {}
    for _ in range(300):
        token, logp, support = draw(probs.log(), SamplingConfig(top_p=0.7), g)
        drawn[int(token)] = logp.item()
    assert set(drawn) == {0, 1}
    assert math.isclose(drawn[0], math.log(0.5 / 0.8), rel_tol=1e-6)
    assert math.isclose(drawn[1], math.log(0.3 / 0.8), rel_tol=1e-6)
    assert support.tolist() == [[True, True, False, False]]
    _, full_logp, none = draw(probs.log(), SamplingConfig(), g)  # top_p = 1: the full distribution, no support
    assert none is None


def _rollout(keep: bool):
    model = tiny_model().eval()
    ids = torch.randint(3, 40, (8, 5), generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(max_new_tokens=8, top_p=0.6, keep_sampling_mask=keep)
    gen = generate(model, ids, torch.ones_like(ids, dtype=torch.bool), cfg, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(1))
    zeros = torch.zeros(8)
    return model, gen, to_rollout_batch(gen, zeros, zeros, 4, [""] * 8, [""] * 8)


def test_full_distribution_scoring_is_biased_by_the_nucleus_mass_and_the_kept_mask_fixes_it():
    model, gen, batch = _rollout(keep=True)
    mask = batch.response_mask_BN
    assert gen.support_BNV is not None and not gen.support_BNV[mask].all()  # the nucleus cut something
    with torch.no_grad():
        kept = policy_forward(model, batch, 1.0)
        full = policy_forward(model, type(batch)(**{**vars(batch), "sampler_support_BNV": None}), 1.0)
    # the fix: the trainer scores the sampler's truncated distribution (up to the decode kernels' rounding)
    torch.testing.assert_close(kept.logp_BN[mask], batch.sampler_logp_BN[mask], rtol=0, atol=1e-5)
    # the bias: log p_full - log p_sampler = log Z, Z the full distribution's mass on the nucleus, on every token
    log_z_BN = torch.logsumexp(full.logits_BNV.masked_fill(~batch.sampler_support_BNV, -torch.inf), -1) - \
        torch.logsumexp(full.logits_BNV, -1)
    bias_BN = full.logp_BN - batch.sampler_logp_BN
    torch.testing.assert_close(bias_BN[mask], log_z_BN[mask], rtol=0, atol=1e-5)
    assert bias_BN[mask].max() <= 1e-5 and bias_BN[mask].min() < -0.05  # p_full <= p_sampler, clearly so somewhere


def test_without_the_mask_nothing_is_kept_and_top_p_one_is_unchanged():
    _, gen, batch = _rollout(keep=False)
    assert gen.support_BNV is None and batch.sampler_support_BNV is None
