"""Objectives against independent references written here with python loops over sequences and tokens.

Each reference returns (loss, d loss / d logp) derived by hand from the formula of docs/design.md section 6; the
objective's loss and its autograd gradient must match both, on random inputs with ragged and empty sequences,
advantages of both signs and ratios on both sides of both clip bounds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_rl.objectives import ObjectiveConfig, get_objective, objective_names

torch.set_num_threads(1)

NAMES = ["grpo", "gspo", "gspo_token", "dr_grpo", "dapo", "cispo", "gmpo"]
LENGTHS = [8, 3, 0, 5, 1, 6, 7, 2]
SEQ_ADV = [1.3, -0.7, 0.4, -1.1, 0.9, -0.5, 0.6, -1.6]


def make_batch(seed=0, noise=0.4, token_adv=False, T=8):
    """Float64 (logp, old_logp, advantages, mask) with garbage on padding, which must be ignored."""
    g, B = torch.Generator().manual_seed(seed), len(LENGTHS)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    logp = old + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = torch.where(mask, logp, torch.full_like(logp, 40.0))
    adv = torch.tensor(SEQ_ADV[:B], dtype=torch.float64)
    if token_adv:
        adv = adv[:, None] + torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def ppo_token(r, a, lo, hi):
    """(-min(r a, clip(r) a), its derivative w.r.t. log r) for one ratio r."""
    cr = min(max(r, 1 - lo), 1 + hi)
    if r * a <= cr * a:  # the unclipped branch is the min: d(-r a)/d log r = -r a
        return -r * a, -r * a
    return -cr * a, 0.0  # the clipped branch is a constant


def tokens(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def adv_at(adv, i, t):
    return adv[i] if adv.ndim == 1 else adv[i, t]


def seq_adv(adv, mask, i):
    toks = tokens(mask, i)
    return adv[i] if adv.ndim == 1 else sum(adv[i, t] for t in toks) / len(toks)


def ref_token_ppo(logp, old, adv, mask, lo, hi, denominator):
    """Sum of PPO token terms, each divided by denominator(i, num_tokens_i)."""
    loss, grad = 0.0, np.zeros_like(logp)
    for i in range(logp.shape[0]):
        toks = tokens(mask, i)
        for t in toks:
            term, d = ppo_token(math.exp(logp[i, t] - old[i, t]), adv_at(adv, i, t), lo, hi)
            loss += term / denominator(i, len(toks))
            grad[i, t] = d / denominator(i, len(toks))
    return loss, grad


def num_nonempty(mask):
    return sum(1 for i in range(mask.shape[0]) if tokens(mask, i))


def ref_grpo(logp, old, adv, mask, lo=0.2, hi=0.27, cfg=None):
    n = num_nonempty(mask)
    return ref_token_ppo(logp, old, adv, mask, lo, hi, lambda i, L: L * n)


def ref_dr_grpo(logp, old, adv, mask, lo=0.2, hi=0.2, cfg=None):
    L_max = cfg.max_response_len or mask.shape[1]
    return ref_token_ppo(logp, old, adv, mask, lo, hi, lambda i, L: mask.shape[0] * L_max)


def ref_dapo(logp, old, adv, mask, lo=0.2, hi=0.28, cfg=None):
    N = int(mask.sum())
    return ref_token_ppo(logp, old, adv, mask, lo, hi, lambda i, L: N)


def seq_ratio(logp, old, mask, i):
    toks = tokens(mask, i)
    return math.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))


def ref_gspo(logp, old, adv, mask, lo=3e-4, hi=4e-4, cfg=None):
    loss, grad, n = 0.0, np.zeros_like(logp), num_nonempty(mask)
    for i in range(logp.shape[0]):
        toks = tokens(mask, i)
        if not toks:
            continue
        term, d = ppo_token(seq_ratio(logp, old, mask, i), seq_adv(adv, mask, i), lo, hi)
        loss += term / n
        for t in toks:  # d log s_i / d logp_it = 1/|y_i|
            grad[i, t] = d / len(toks) / n
    return loss, grad


def ref_gspo_token(logp, old, adv, mask, lo=3e-4, hi=4e-4, cfg=None):
    loss, grad, n = 0.0, np.zeros_like(logp), num_nonempty(mask)
    for i in range(logp.shape[0]):
        toks = tokens(mask, i)
        for t in toks:  # s_it has the value s_i and d log s_it / d logp_it = 1
            term, d = ppo_token(seq_ratio(logp, old, mask, i), adv_at(adv, i, t), lo, hi)
            loss += term / len(toks) / n
            grad[i, t] = d / len(toks) / n
    return loss, grad


def ref_cispo(logp, old, adv, mask, lo=None, hi=5.0, cfg=None):
    loss, grad, N = 0.0, np.zeros_like(logp), int(mask.sum())
    for i in range(logp.shape[0]):
        for t in tokens(mask, i):
            r = min(math.exp(logp[i, t] - old[i, t]), 1 + hi)
            r = r if lo is None else max(r, 1 - lo)
            loss += -r * adv_at(adv, i, t) * logp[i, t] / N
            grad[i, t] = -r * adv_at(adv, i, t) / N
    return loss, grad


def ref_gmpo(logp, old, adv, mask, lo=0.4, hi=0.4, cfg=None):
    loss, grad, n = 0.0, np.zeros_like(logp), num_nonempty(mask)
    for i in range(logp.shape[0]):
        toks = tokens(mask, i)
        if not toks:
            continue
        a = seq_adv(adv, mask, i)
        x = {t: logp[i, t] - old[i, t] for t in toks}
        c = {t: (min(x[t], hi) if a > 0 else max(x[t], -lo)) for t in toks}
        geo = math.exp(sum(c.values()) / len(toks))
        loss += -a * geo / n
        for t in toks:
            grad[i, t] = (-a * geo / len(toks) / n) if c[t] == x[t] else 0.0
    return loss, grad


REFERENCES = {
    "grpo": ref_grpo, "gspo": ref_gspo, "gspo_token": ref_gspo_token, "dr_grpo": ref_dr_grpo,
    "dapo": ref_dapo, "cispo": ref_cispo, "gmpo": ref_gmpo,
}
# Clip ranges that put a good share of this data on each side of each bound (checked in the test).
CUSTOM = {
    "grpo": (0.2, 0.27), "gspo": (0.05, 0.05), "gspo_token": (0.05, 0.05), "dr_grpo": (0.25, 0.3),
    "dapo": (0.2, 0.28), "cispo": (0.3, 0.3), "gmpo": (0.2, 0.3),
}


def run(name, batch, **cfg_kwargs):
    logp, old, adv, mask = batch
    logp = logp.clone().requires_grad_(True)
    cfg = ObjectiveConfig(name=name, **cfg_kwargs)
    loss, metrics = get_objective(name)(logp, old, adv, mask, cfg)
    loss.backward()
    return loss.item(), logp.grad.numpy(), metrics, cfg


def numpy_batch(batch):
    logp, old, adv, mask = batch
    return logp.numpy(), old.numpy(), adv.numpy(), mask.numpy()


def test_every_objective_is_registered_with_its_reference():
    assert objective_names() == sorted(NAMES) == sorted(REFERENCES)


@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_loss_and_grad_match_reference_at_default_clip(name, token_adv):
    batch = make_batch(seed=1, token_adv=token_adv)
    loss, grad, _, cfg = run(name, batch)
    ref_loss, ref_grad = REFERENCES[name](*numpy_batch(batch), cfg=cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_loss_and_grad_match_reference_with_both_bounds_active(name, token_adv):
    batch = make_batch(seed=2, token_adv=token_adv)
    lo, hi = CUSTOM[name]
    loss, grad, metrics, cfg = run(name, batch, clip_low=lo, clip_high=hi, max_response_len=12)
    ref_loss, ref_grad = REFERENCES[name](*numpy_batch(batch), lo=lo, hi=hi, cfg=cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-13)
    # The data must exercise the clip: some tokens cut at each bound, most not.
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    assert 0 < metrics["clip_ratio/region_mean"] < 0.8
    assert (ref_grad[batch[3].numpy()] != 0).sum() > 10


def test_grpo_clip_metrics_match_counts():
    batch = make_batch(seed=3)
    _, _, metrics, _ = run("grpo", batch)
    logp, old, adv, mask = numpy_batch(batch)
    low = high = 0
    seq_low = seq_high = seq_any = 0
    for i in range(len(LENGTHS)):
        w = [math.exp(logp[i, t] - old[i, t]) for t in tokens(mask, i)]
        lows = [x < 0.8 and adv[i] < 0 for x in w]
        highs = [x > 1.27 and adv[i] > 0 for x in w]
        low, high = low + sum(lows), high + sum(highs)
        seq_low, seq_high, seq_any = seq_low + any(lows), seq_high + any(highs), seq_any + any(lows + highs)
    N, S = int(mask.sum()), num_nonempty(mask)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(low / N)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high / N)
    assert metrics["clip_ratio/region_mean"] == pytest.approx((low + high) / N)
    assert metrics["clip_ratio/low_seq"] == pytest.approx(seq_low / S)
    assert metrics["clip_ratio/high_seq"] == pytest.approx(seq_high / S)
    assert metrics["clip_ratio/region_seq"] == pytest.approx(seq_any / S)
    w_all = [math.exp(logp[i, t] - old[i, t]) for i in range(len(LENGTHS)) for t in tokens(mask, i)]
    assert metrics["ratio/max"] == pytest.approx(max(w_all)) and metrics["ratio/min"] == pytest.approx(min(w_all))
    assert metrics["ratio/mean"] == pytest.approx(sum(w_all) / N)


def test_gspo_clip_metrics_are_per_sequence():
    batch = make_batch(seed=4)
    _, _, metrics, _ = run("gspo", batch, clip_low=0.1, clip_high=0.15)
    logp, old, adv, mask = numpy_batch(batch)
    clipped_tokens, clipped_seqs, s_all = 0, 0, []
    for i in range(len(LENGTHS)):
        if not tokens(mask, i):
            continue
        s = seq_ratio(logp, old, mask, i)
        s_all.append(s)
        if (s < 0.9 and adv[i] < 0) or (s > 1.15 and adv[i] > 0):
            clipped_tokens, clipped_seqs = clipped_tokens + len(tokens(mask, i)), clipped_seqs + 1
    assert 0 < clipped_seqs < len(s_all)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(clipped_tokens / int(mask.sum()))
    assert metrics["clip_ratio/region_seq"] == pytest.approx(clipped_seqs / len(s_all))
    assert metrics["ratio/mean"] == pytest.approx(sum(s_all) / len(s_all))
    assert metrics["ratio/max"] == pytest.approx(max(s_all)) and metrics["ratio/min"] == pytest.approx(min(s_all))


@pytest.mark.parametrize("as_token_adv", [False, True])
def test_gspo_and_gspo_token_agree_for_sequence_advantages(as_token_adv):
    logp, old, adv, mask = make_batch(seed=5)
    if as_token_adv:  # constant along each sequence, given as [B, T]
        adv = adv[:, None].expand_as(logp).clone()
    for clip in ({}, {"clip_low": 0.1, "clip_high": 0.15}):
        loss_s, grad_s, metrics_s, _ = run("gspo", (logp, old, adv, mask), **clip)
        loss_t, grad_t, metrics_t, _ = run("gspo_token", (logp, old, adv, mask), **clip)
        assert loss_s == pytest.approx(loss_t, rel=1e-12)
        np.testing.assert_allclose(grad_s, grad_t, rtol=1e-12, atol=1e-15)
        assert metrics_s == pytest.approx(metrics_t)
        assert np.abs(grad_s).sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_ratios_are_one_and_nothing_is_clipped(name):
    logp, old, adv, mask = make_batch(seed=6)
    _, _, metrics, _ = run(name, (old.clone(), old, adv, mask))
    assert metrics["ratio/mean"] == metrics["ratio/max"] == metrics["ratio/min"] == 1.0
    clip_keys = {f"clip_ratio/{k}_{w}" for k in ("low", "high", "region") for w in ("mean", "seq")}
    assert all(metrics[key] == 0.0 for key in clip_keys)
    assert set(metrics) == {"loss", "ratio/mean", "ratio/max", "ratio/min"} | clip_keys
    assert all(type(v) is float and math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_empty_sequences_and_inf_padding_give_no_nan(name):
    logp, old, adv, mask = make_batch(seed=8)
    clean_loss, clean_grad, _, _ = run(name, (logp, old, adv, mask))
    # -inf on padding in both: logp - old is NaN there, which must not reach the loss or the gradient.
    logp_inf = torch.where(mask, logp, torch.full_like(logp, -math.inf))
    old_inf = torch.where(mask, old, torch.full_like(old, -math.inf))
    loss, grad, metrics, _ = run(name, (logp_inf, old_inf, adv, mask))
    assert loss == pytest.approx(clean_loss, rel=1e-12) and np.array_equal(grad, clean_grad)
    empty = torch.zeros_like(mask)
    loss, grad, metrics, _ = run(name, (logp_inf, old_inf, adv, empty))
    assert loss == 0.0 and np.all(grad == 0)
    assert all(math.isfinite(v) for v in metrics.values())


def test_gspo_clips_far_more_than_grpo_at_default_ranges():
    """GSPO paper section 5.2: at their default ranges GSPO clips orders of magnitude more than GRPO."""
    g = torch.Generator().manual_seed(9)
    lengths = torch.randint(50, 200, (64,), generator=g)
    mask = torch.arange(200)[None, :] < lengths[:, None]
    old = -torch.randn(64, 200, generator=g).abs()
    logp = old + 0.1 * torch.randn(64, 200, generator=g)  # |log w| ~ 0.1: an off-policy minibatch
    adv = torch.randn(64, generator=g).sign()
    cfg = ObjectiveConfig
    _, grpo_m = get_objective("grpo")(logp, old, adv, mask, cfg("grpo"))
    _, gspo_m = get_objective("gspo")(logp, old, adv, mask, cfg("gspo"))
    assert 0 < grpo_m["clip_ratio/region_mean"] < 0.05
    assert gspo_m["clip_ratio/region_mean"] > 10 * grpo_m["clip_ratio/region_mean"]
    assert gspo_m["clip_ratio/region_seq"] > 0.2
