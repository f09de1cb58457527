"""Policy-change signals logged every optimizer step (docs/design.md section 5), from log-probs and a response mask.

Inputs: `logp_BT` (log pi_theta of the response tokens), `old_logp_BT` (log pi_old), `mask_BT` (real response
tokens). With log w_it = logp_it - old_logp_it over real tokens:

| metric | formula |
|---|---|
| `ratio/log_mean`, `ratio/log_std` | mean and population std (divide by the count) of log w over tokens |
| `ratio/log_abs_max` | max \\|log w\\| over tokens |
| `kl` | k3 estimate of KL(old \\|\\| new): mean over tokens of w - 1 - log w (>= 0, unbiased under old's samples) |
| `ratio/extreme_frac` | F(2) = mean over tokens of 1[max(w, 1/w) > 2] = 1[\\|log w\\| > log 2] (R3 paper) |
| `seq_ratio/mean`, `/min`, `/max` | GSPO's s_i = exp(mean_t log w_it), over non-empty sequences |
| `seq_ratio/abs_dev_mean` | mean over sequences of \\|s_i - 1\\| |
| `entropy` | mean over tokens of H(pi_theta(. \\| prefix)), from logits (`entropy_from_logits`) |

Everything is computed without gradient, in float64, and returned as python floats. An empty mask gives the
on-policy values (ratios 1, everything else 0), never NaN.
"""

from __future__ import annotations

import math

import torch

from moe_rl.objectives.masked import (
    as_bool_mask,
    masked_log_ratio,
    masked_max,
    masked_mean,
    masked_min,
    nonempty_sequences,
    sequence_log_ratio,
)

__all__ = ["entropy_from_logits", "masked_mean", "ratio_signals"]


@torch.no_grad()
def ratio_signals(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor, extreme: float = 2.0
) -> dict[str, float]:
    """Token log-ratio stats, k3 KL, extreme-token fraction F(`extreme`) and GSPO sequence-ratio stats."""
    mask_BT = as_bool_mask(mask_BT)
    log_w_BT = masked_log_ratio(logp_BT.double(), old_logp_BT.double(), mask_BT)
    log_mean = masked_mean(log_w_BT, mask_BT)
    s_B = sequence_log_ratio(log_w_BT, mask_BT).exp()
    seq_B = nonempty_sequences(mask_BT)
    return {
        "ratio/log_mean": log_mean.item(),
        "ratio/log_std": masked_mean((log_w_BT - log_mean) ** 2, mask_BT).sqrt().item(),
        "ratio/log_abs_max": masked_max(log_w_BT.abs(), mask_BT, empty=0.0).item(),
        "kl": masked_mean(log_w_BT.exp() - 1 - log_w_BT, mask_BT).item(),
        "ratio/extreme_frac": masked_mean((log_w_BT.abs() > math.log(extreme)).double(), mask_BT).item(),
        "seq_ratio/mean": masked_mean(s_B, seq_B).item() if seq_B.any() else 1.0,
        "seq_ratio/min": masked_min(s_B, seq_B, empty=1.0).item(),
        "seq_ratio/max": masked_max(s_B, seq_B, empty=1.0).item(),
        "seq_ratio/abs_dev_mean": masked_mean((s_B - 1).abs(), seq_B).item(),
    }


@torch.no_grad()
def entropy_from_logits(logits_BTV: torch.Tensor, mask_BT: torch.Tensor, chunk_tokens: int = 1024) -> float:
    """Mean over real tokens of H = -sum_v p_v log p_v, p = softmax(logits): the next-token entropy (`entropy`).

    Memory: only `chunk_tokens` token rows are ever upcast to float32 at once, so a bf16
    [B, T, V] with a 150k vocabulary does not get a float32 twin (plus softmax) in memory.
    """
    mask_N = as_bool_mask(mask_BT).reshape(-1)
    logits_NV = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    total, count = 0.0, 0
    for start in range(0, logits_NV.shape[0], chunk_tokens):
        keep = mask_N[start : start + chunk_tokens]
        if not keep.any():
            continue
        z_CV = logits_NV[start : start + chunk_tokens][keep]
        z_CV = z_CV.to(torch.promote_types(z_CV.dtype, torch.float32))
        p_CV = torch.softmax(z_CV, dim=-1)
        # xlogy: 0 * log 0 = 0, so logits masked to -inf (banned tokens) contribute nothing instead of NaN.
        entropy_C = -torch.special.xlogy(p_CV, p_CV).sum(dim=-1)
        total += entropy_C.double().sum().item()
        count += int(keep.sum())
    return total / max(count, 1)
