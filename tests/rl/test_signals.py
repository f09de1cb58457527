"""Policy-change signals and masked helpers against numpy loops over the real tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_rl.objectives.masked import masked_mean
from moe_rl.rl.signals import entropy_from_logits, ratio_signals

torch.set_num_threads(1)

LENGTHS = [6, 2, 0, 4, 1]


def make_batch(seed=0, noise=0.6, T=6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    old = -2 * torch.rand(len(LENGTHS), T, generator=g, dtype=torch.float64)
    logp = old + noise * torch.randn(len(LENGTHS), T, generator=g, dtype=torch.float64)
    logp = torch.where(mask, logp, torch.full_like(logp, -math.inf))  # padding garbage must be ignored
    return logp, old, mask


def reference_signals(logp, old, mask):
    log_w = [logp[i, t] - old[i, t] for i in range(len(LENGTHS)) for t in range(LENGTHS[i])]
    seqs = [np.mean([logp[i, t] - old[i, t] for t in range(L)]) for i, L in enumerate(LENGTHS) if L]
    s = np.exp(seqs)
    return {
        "ratio/log_mean": np.mean(log_w),
        "ratio/log_std": np.std(log_w),
        "ratio/log_abs_max": np.max(np.abs(log_w)),
        "kl": np.mean([math.exp(x) - 1 - x for x in log_w]),
        "ratio/extreme_frac": np.mean([max(math.exp(x), math.exp(-x)) > 2 for x in log_w]),
        "seq_ratio/mean": s.mean(),
        "seq_ratio/min": s.min(),
        "seq_ratio/max": s.max(),
        "seq_ratio/abs_dev_mean": np.abs(s - 1).mean(),
    }


def test_ratio_signals_match_numpy():
    logp, old, mask = make_batch()
    got = ratio_signals(logp, old, mask)
    expected = reference_signals(logp.numpy(), old.numpy(), mask.numpy())
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert 0 < got["ratio/extreme_frac"] < 1 and got["kl"] > 0
    assert all(type(v) is float for v in got.values())


def test_float_mask_is_accepted():
    logp, old, mask = make_batch(seed=1)
    assert ratio_signals(logp, old, mask.double()) == ratio_signals(logp, old, mask)


def test_on_policy_signals_are_neutral():
    _, old, mask = make_batch()
    got = ratio_signals(old.clone(), old, mask)
    assert got["kl"] == got["ratio/log_mean"] == got["ratio/log_abs_max"] == got["ratio/extreme_frac"] == 0.0
    assert got["seq_ratio/mean"] == got["seq_ratio/min"] == got["seq_ratio/max"] == 1.0


def test_empty_mask_gives_no_nan():
    logp, old, mask = make_batch()
    got = ratio_signals(logp, old, torch.zeros_like(mask))
    assert all(math.isfinite(v) for v in got.values()) and got["seq_ratio/mean"] == 1.0 and got["kl"] == 0.0
    assert entropy_from_logits(torch.ones(2, 3, 5), torch.zeros(2, 3, dtype=torch.bool)) == 0.0


def test_extreme_fraction_counts_both_directions():
    log_w = torch.tensor([[math.log(3), -math.log(3), 0.5, -0.5, math.log(2.1), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    got = ratio_signals(log_w, torch.zeros_like(log_w), mask)
    assert got["ratio/extreme_frac"] == pytest.approx(3 / 5)
    assert got["ratio/log_abs_max"] == pytest.approx(math.log(3))


def numpy_entropy(logits, mask):
    values = []
    for b, t in zip(*np.nonzero(mask)):
        z = logits[b, t] - logits[b, t].max()
        p = np.exp(z) / np.exp(z).sum()
        values.append(-sum(pi * math.log(pi) for pi in p if pi > 0))
    return np.mean(values)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1024])
def test_entropy_matches_numpy_for_any_chunk(chunk_tokens):
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(3, 4, 11, generator=g, dtype=torch.float64)
    logits[0, 1, :5] = -math.inf  # banned tokens: probability 0, entropy stays finite
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    got = entropy_from_logits(logits, mask, chunk_tokens=chunk_tokens)
    assert got == pytest.approx(numpy_entropy(logits.numpy(), mask.numpy()), rel=1e-12)


def test_entropy_of_uniform_logits_in_bf16_is_log_v():
    logits = torch.zeros(2, 3, 50, dtype=torch.bfloat16)
    assert entropy_from_logits(logits, torch.ones(2, 3)) == pytest.approx(math.log(50), rel=1e-5)


def test_masked_mean_ignores_nan_padding_in_value_and_gradient():
    x = torch.tensor([[1.0, 3.0, math.nan], [math.nan, math.nan, math.nan]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert masked_mean(x, mask).item() == 2.0
    per_row = masked_mean(x, mask, dim=1)
    assert per_row.tolist() == [2.0, 0.0]
    per_row.sum().backward()
    assert x.grad.tolist() == [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]
