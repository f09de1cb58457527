"""Tensor helpers over a response mask, shared by the objectives and the policy-change signals.

Shapes: B sequences, T response-token axis (padded). `mask_BT` marks real response tokens (bool, or float where
nonzero means real). Padding may hold anything, even -inf or NaN log-probs: every helper selects with `torch.where`
before any arithmetic, so padding never leaks into a value or, through autograd, into a gradient.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    """The mask as bool: nonzero entries are real tokens."""
    return mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` where `mask` is true (over all entries, or along `dim`)."""
    kept = torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is true; 0 where nothing is selected (never NaN).

    `x` may be bool (then this is a fraction). With `dim`, each slice is averaged over its own selected entries.
    """
    mask = as_bool_mask(mask)
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    count = mask.sum() if dim is None else mask.sum(dim)
    # clamp(min=1): an empty selection gives 0 / 1 = 0 instead of 0 / 0.
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_max(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Max of `x` over the selected entries, or `empty` if none is selected."""
    mask = as_bool_mask(mask)
    return x[mask].max() if mask.any() else torch.tensor(empty, dtype=x.dtype, device=x.device)


def masked_min(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Min of `x` over the selected entries, or `empty` if none is selected."""
    mask = as_bool_mask(mask)
    return x[mask].min() if mask.any() else torch.tensor(empty, dtype=x.dtype, device=x.device)


def sequence_lengths(mask_BT: torch.Tensor) -> torch.Tensor:
    """|y_i|: number of real response tokens of each sequence, `[B]` int64."""
    return as_bool_mask(mask_BT).sum(dim=1)


def nonempty_sequences(mask_BT: torch.Tensor) -> torch.Tensor:
    """`[B]` bool: sequences with at least one response token."""
    return as_bool_mask(mask_BT).any(dim=1)


def masked_log_ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log w_it = logp_it - old_logp_it on real tokens, exactly 0 on padding (so w = 1 there)."""
    mask_BT = as_bool_mask(mask_BT)
    zero = torch.zeros((), dtype=logp_BT.dtype, device=logp_BT.device)
    return torch.where(mask_BT, logp_BT - old_logp_BT, zero)


def sequence_log_ratio(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t log w_it: GSPO's length-normalised sequence log-ratio, `[B]` (0 if empty)."""
    return masked_mean(log_ratio_BT, mask_BT, dim=1)
