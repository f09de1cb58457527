"""GSPO-token: GSPO's sequence ratio with a per-token gradient path, for token-level advantages.

Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071, eq. 10-11:

    s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it)) = sg(s_i) * exp(logp_it - sg(logp_it))
    L = (1/B) sum_i (1/|y_i|) sum_t -min(s_it A_it, clip(s_it, 1-e_lo, 1+e_hi) A_it)

s_it equals s_i in value, and its gradient w.r.t. logp_it is s_i. So when A_it = A_i for all t the value and the
gradient equal GSPO's exactly (the paper's remark, and a test here). Default clip 3e-4 / 4e-4 as GSPO. Clip metrics
are per token (a token is clipped when s_i is out of range in the direction of its A_it); ratio metrics are over
sequences (s_i), so with per-sequence advantages every metric matches GSPO's.
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import clip_metrics, finish, mean_over_sequences, ppo_clipped_term, prepare, ratio_metrics
from moe_rl.objectives.config import ObjectiveConfig, resolve_clip
from moe_rl.objectives.masked import nonempty_sequences, sequence_log_ratio
from moe_rl.objectives.registry import register_objective

DEFAULT_CLIP = (3e-4, 4e-4)


@register_objective("gspo_token", default_clip=DEFAULT_CLIP)
def gspo_token(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token (arXiv 2507.18071 eq. 10-11): s_it = sg(s_i) exp(logp_it - sg(logp_it)), GRPO aggregation."""
    eps_lo, eps_hi = resolve_clip(cfg, DEFAULT_CLIP)
    mask_BT, log_w_BT, adv_BT = prepare(logp_BT, old_logp_BT, advantages, mask_BT)
    s_B = sequence_log_ratio(log_w_BT, mask_BT).exp()
    # log_w_BT - sg(log_w_BT) is logp_it - sg(logp_it) on real tokens (old_logp is a constant) and 0 on padding.
    s_BT = s_B.detach()[:, None] * (log_w_BT - log_w_BT.detach()).exp()
    term_BT, low_BT, high_BT = ppo_clipped_term(s_BT, adv_BT, eps_lo, eps_hi)
    loss = mean_over_sequences(term_BT, mask_BT)
    metrics = ratio_metrics(s_B, nonempty_sequences(mask_BT))
    return finish(loss, metrics, clip_metrics(low_BT, high_BT, mask_BT))
