"""GMPO: geometric mean of token ratios, each clipped in log space, per sequence.

Zhao et al., "Geometric-Mean Policy Optimization", arXiv 2507.20673 (the GMPO objective). In log space, with the
clip pessimistic in the direction of the advantage as PPO's min is:

    l_it = min(log w_it, e_hi)   if A_i > 0        (only a rise is capped)
    l_it = max(log w_it, -e_lo)  otherwise         (only a fall is capped)
    L = (1/B) sum_i -A_i exp((1/|y_i|) sum_t l_it)

Default e_lo = e_hi = 0.4 in log space (ratios within [e^-0.4, e^0.4] ~ [0.67, 1.49]), the paper's range: wider
than GRPO's because the geometric mean is far less sensitive to a single outlier token than the arithmetic mean.

A token is clipped when its l_it is at the bound (log w_it > e_hi with A_i > 0, or < -e_lo with A_i < 0); its
gradient is then zero. A sequence is clipped when any of its tokens is. Ratio metrics are over tokens (w_it, before
clipping), since the clip acts on tokens. With `[B, T]` advantages, A_i is their masked mean over the sequence (as
GSPO). Sequences without response tokens are left out of the mean over sequences.
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import clip_metrics, finish, prepare, ratio_metrics, sequence_advantages
from moe_rl.objectives.config import ObjectiveConfig, resolve_clip
from moe_rl.objectives.masked import masked_mean, nonempty_sequences, sequence_log_ratio
from moe_rl.objectives.registry import register_objective

DEFAULT_CLIP = (0.4, 0.4)


@register_objective("gmpo", default_clip=DEFAULT_CLIP, clip_space="log_ratio")
def gmpo(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (arXiv 2507.20673): -A_i * geometric mean of log-space-clipped token ratios, mean over sequences."""
    eps_lo, eps_hi = resolve_clip(cfg, DEFAULT_CLIP, "log_ratio")
    mask_BT, log_w_BT, adv_BT = prepare(logp_BT, old_logp_BT, advantages, mask_BT)
    adv_B = sequence_advantages(adv_BT, mask_BT)
    positive_BT = (adv_B > 0)[:, None].expand_as(log_w_BT)
    clipped_log_w_BT = torch.where(positive_BT, log_w_BT.clamp(max=eps_hi), log_w_BT.clamp(min=-eps_lo))
    geo_mean_B = sequence_log_ratio(clipped_log_w_BT, mask_BT).exp()
    seq_B = nonempty_sequences(mask_BT)
    loss = masked_mean(-adv_B * geo_mean_B, seq_B)
    with torch.no_grad():
        high_BT = positive_BT & (log_w_BT > eps_hi)
        low_BT = (adv_B < 0)[:, None] & (log_w_BT < -eps_lo)
    return finish(loss, ratio_metrics(log_w_BT.exp(), mask_BT), clip_metrics(low_BT, high_BT, mask_BT))
