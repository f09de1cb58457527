"""DAPO: GRPO's clipped token term with clip-higher and a token-level mean over the whole batch.

Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476, eq. 8:

    L = sum_i sum_t -min(w_it A_i, clip(w_it, 1-e_lo, 1+e_hi) A_i) / sum_i |y_i|

with decoupled clip 0.2 / 0.28 ("clip-higher") and dynamic sampling: groups whose rewards are all equal (zero
advantage, no signal) are dropped before the update. Dropping is the trainer's job, announced by this spec's
`drop_zero_std_groups=True`; this function computes the loss of whatever batch it is given. Clip metrics and ratio
metrics as GRPO (token level).
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import finish, token_clipped_terms
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.objectives.masked import masked_mean
from moe_rl.objectives.registry import register_objective

DEFAULT_CLIP = (0.2, 0.28)


@register_objective("dapo", default_clip=DEFAULT_CLIP, drop_zero_std_groups=True, loss_denominator="tokens")
def dapo(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO (arXiv 2503.14476 eq. 8): GRPO term with clip-higher, token mean over the batch."""
    term_BT, mask_BT, metrics = token_clipped_terms(logp_BT, old_logp_BT, advantages, mask_BT, cfg, DEFAULT_CLIP)
    loss = masked_mean(term_BT, mask_BT)
    return finish(loss, metrics)
