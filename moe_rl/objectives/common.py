"""Pieces shared by the objectives: input checks, the PPO-style clipped term, aggregations and metrics.

Clip metrics (the same names for every objective, TRL names where they exist):
- `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`: token-weighted, the fraction of response
  tokens whose term is clipped (its gradient is cut): low = below the lower bound with A < 0, high = above the upper
  bound with A > 0, region = either.
- `clip_ratio/low_seq`, `clip_ratio/high_seq`, `clip_ratio/region_seq`: sequence-weighted, the fraction of non-empty
  sequences in which any token is clipped (for a sequence-level clip such as GSPO's: the sequence is clipped).
  "Any token" grows with length, so for token-level objectives `*_seq` is far above `*_mean` on long responses;
  compare GRPO with GSPO on the token-weighted `*_mean`, as the GSPO paper does.
- `ratio/mean`, `ratio/max`, `ratio/min`: the ratio the objective actually uses, over tokens or over sequences.
"""

from __future__ import annotations

import torch

from moe_rl.objectives.config import resolve_clip
from moe_rl.objectives.masked import (
    as_bool_mask,
    masked_log_ratio,
    masked_max,
    masked_mean,
    masked_min,
    nonempty_sequences,
)


def prepare(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes; return (bool mask_BT, log-ratio log_w_BT zeroed on padding, advantages broadcast to [B, T]).

    Arithmetic runs in at least float32. (The log-probs themselves should come from float32 logits: bf16 values
    near -5 are spaced 0.03 apart, a hundred times GSPO's whole clip range; upcasting here cannot undo that.)
    """
    if logp_BT.dim() != 2 or logp_BT.shape != old_logp_BT.shape or logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"logp_BT {tuple(logp_BT.shape)}, old_logp_BT {tuple(old_logp_BT.shape)} and mask_BT "
            f"{tuple(mask_BT.shape)} must be the same [B, T] shape"
        )
    mask_BT = as_bool_mask(mask_BT)
    log_w_BT = masked_log_ratio(at_least_float32(logp_BT), at_least_float32(old_logp_BT.detach()), mask_BT)
    return mask_BT, log_w_BT, token_advantages(at_least_float32(advantages), mask_BT)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` upcast to float32 if it is a lower-precision (or integer) type; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_advantages(advantages: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """A_it as `[B, T]`: a per-sequence `[B]` is broadcast over tokens; padding is set to 0."""
    B, T = mask_BT.shape
    if advantages.shape == (B,):
        advantages = advantages[:, None].expand(B, T)
    elif advantages.shape != (B, T):
        raise ValueError(f"advantages must be [B]=({B},) or [B, T]=({B}, {T}), got {tuple(advantages.shape)}")
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(mask_BT, advantages.detach(), zero)


def sequence_advantages(adv_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """A_i as `[B]` for sequence-level objectives: the masked mean of A_it over the sequence's tokens.

    For per-sequence advantages (the GRPO case) this is exactly A_i; for token advantages it is the one number a
    sequence-level ratio can be paired with.
    """
    return masked_mean(adv_BT, mask_BT, dim=1)


def ppo_clipped_term(
    ratio: torch.Tensor, adv: torch.Tensor, eps_lo: float, eps_hi: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1-e_lo, 1+e_hi) A) and where it is clipped (low: r < 1-e_lo, A < 0; high: r > 1+e_hi, A > 0).

    Exactly at those points the clipped branch wins the min and the term's gradient is zero.
    """
    clipped_ratio = ratio.clamp(1 - eps_lo, 1 + eps_hi)
    term = -torch.minimum(ratio * adv, clipped_ratio * adv)
    with torch.no_grad():
        low = (ratio < 1 - eps_lo) & (adv < 0)
        high = (ratio > 1 + eps_hi) & (adv > 0)
    return term, low, high


def token_clipped_terms(logp_BT, old_logp_BT, advantages, mask_BT, cfg, default_clip):
    """The PPO-clipped token term that grpo, dr_grpo and dapo share; they differ only in how they aggregate it.

    Returns (term_BT, mask_BT, metrics): metrics holds the token ratio and clip fractions."""
    eps_lo, eps_hi = resolve_clip(cfg, default_clip)
    mask_BT, log_w_BT, adv_BT = prepare(logp_BT, old_logp_BT, advantages, mask_BT)
    w_BT = log_w_BT.exp()
    term_BT, low_BT, high_BT = ppo_clipped_term(w_BT, adv_BT, eps_lo, eps_hi)
    return term_BT, mask_BT, {**ratio_metrics(w_BT, mask_BT), **clip_metrics(low_BT, high_BT, mask_BT)}


def mean_over_sequences(term_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(1/|B'|) sum_i (1/|y_i|) sum_t term_it over the non-empty sequences B' (GRPO's aggregation).

    Sequences without response tokens carry nothing to learn from, so they are left out rather than counted as 0.
    """
    per_sequence_B = masked_mean(term_BT, mask_BT, dim=1)
    return masked_mean(per_sequence_B, nonempty_sequences(mask_BT))


def clip_metrics(low_BT: torch.Tensor, high_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """Token- and sequence-weighted clip fractions; a sequence counts as clipped when any of its tokens is."""
    low_BT, high_BT = low_BT & mask_BT, high_BT & mask_BT
    region_BT = low_BT | high_BT
    seq_B = nonempty_sequences(mask_BT)
    metrics = {}
    for kind, clipped_BT in (("low", low_BT), ("high", high_BT), ("region", region_BT)):
        metrics[f"clip_ratio/{kind}_mean"] = masked_mean(clipped_BT, mask_BT).item()
        metrics[f"clip_ratio/{kind}_seq"] = masked_mean(clipped_BT.any(dim=1), seq_B).item()
    return metrics


def ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, max and min of the ratio the objective uses, over the selected tokens or sequences (1 if none)."""
    ratio = ratio.detach()
    return {
        "ratio/mean": masked_mean(ratio, mask).item() if as_bool_mask(mask).any() else 1.0,
        "ratio/max": masked_max(ratio, mask, empty=1.0).item(),
        "ratio/min": masked_min(ratio, mask, empty=1.0).item(),
    }


def finish(loss: torch.Tensor, *metric_dicts: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective's return value: the loss and one flat dict of python floats, `loss` first."""
    metrics = {"loss": loss.detach().item()}
    for extra in metric_dicts:
        metrics.update(extra)
    return loss, metrics


def loss_denominator_count(denominator: str, mask_BT: torch.Tensor) -> int:
    """How many of what the loss averages over (ObjectiveSpec.loss_denominator) these rows hold: non-empty
    sequences, response tokens, or rows. Data-parallel training weights each rank's loss by its share of the count."""
    if denominator == "sequences":
        return int(nonempty_sequences(mask_BT).sum())
    if denominator == "tokens":
        return int(as_bool_mask(mask_BT).sum())
    if denominator == "rows":
        return mask_BT.shape[0]
    raise ValueError(f"unknown loss denominator {denominator!r}")
