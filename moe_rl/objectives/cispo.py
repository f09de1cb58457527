"""CISPO: REINFORCE with a truncated, stop-gradient importance weight; no token's gradient is ever cut.

MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585 (the CISPO
objective):

    w_it = pi_theta(y_it) / pi_old(y_it),   r_it = clip(w_it, 1-e_lo, 1+e_hi)
    L = sum_i sum_t -sg(r_it) A_i logp_it / sum_i |y_i|        (token mean over the batch)

The gradient is -r_it A_i grad logp_it on every token. The paper sets no lower bound (e_lo "large") and tunes only
e_hi; so do we by default (e_lo = None); `cfg.clip_low` adds a floor 1-e_lo.

Default e_hi = 5.0, i.e. weights capped at 6. MiniMax-M1 does not publish its e_hi; public CISPO recipes cap the
weight between 4 (Tinker) and 6 (NeMo-RL's MiniMax-M1-style recipe, run on Qwen3-30B-A3B, an MoE like ours); we take
that recipe's 6. The cap is far from PPO's 1.2 on purpose: it only bounds the variance of rare, huge weights. It is
not a trust region, and a tight cap would shrink the gradient of exactly the tokens whose probability is rising.

"Clipped" here means truncated: `clip_ratio/high_*` counts w_it > 1+e_hi, `clip_ratio/low_*` counts w_it < 1-e_lo
(always 0 without a lower bound), whatever the sign of A. A sequence is clipped when any of its tokens is. Ratio
metrics are over tokens (w_it, before truncation).
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import at_least_float32, clip_metrics, finish, prepare, ratio_metrics
from moe_rl.objectives.config import ObjectiveConfig, resolve_clip
from moe_rl.objectives.masked import masked_mean
from moe_rl.objectives.registry import register_objective

DEFAULT_CLIP = (None, 5.0)


@register_objective("cispo", default_clip=DEFAULT_CLIP, clip_space="is_weight", loss_denominator="tokens")
def cispo(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(min(w, 1+e_hi)) A logp, token mean over the batch."""
    eps_lo, eps_hi = resolve_clip(cfg, DEFAULT_CLIP, "is_weight")
    mask_BT, log_w_BT, adv_BT = prepare(logp_BT, old_logp_BT, advantages, mask_BT)
    w_BT = log_w_BT.exp()
    floor = None if eps_lo is None else 1 - eps_lo
    weight_BT = w_BT.clamp(min=floor, max=1 + eps_hi).detach()
    # logp itself carries the gradient; padding may hold -inf, so select before multiplying.
    logp_BT = at_least_float32(logp_BT)
    safe_logp_BT = torch.where(mask_BT, logp_BT, torch.zeros((), dtype=logp_BT.dtype, device=logp_BT.device))
    loss = masked_mean(-weight_BT * adv_BT * safe_logp_BT, mask_BT)
    with torch.no_grad():
        high_BT = w_BT > 1 + eps_hi
        low_BT = w_BT < floor if floor is not None else torch.zeros_like(high_BT)
    return finish(loss, ratio_metrics(w_BT, mask_BT), clip_metrics(low_BT, high_BT, mask_BT))
