"""GRPO: token-level PPO-clipped surrogate, mean over each sequence's tokens, then over sequences.

Shao et al., "DeepSeekMath", arXiv 2402.03300, eq. 3 (the GRPO objective; here with KL coefficient 0, docs/design.md
section 6):

    w_it = pi_theta(y_it) / pi_old(y_it)
    L = (1/B) sum_i (1/|y_i|) sum_t -min(w_it A_i, clip(w_it, 1-e_lo, 1+e_hi) A_i)

Default clip 0.2 / 0.27: the tuned GRPO of the GSPO paper (arXiv 2507.18071, section 5.1). Sequences without
response tokens are left out of the mean over sequences. A sequence counts as clipped (`clip_ratio/*_seq`) when
any of its tokens is clipped. Ratio metrics are over tokens.
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import finish, mean_over_sequences, token_clipped_terms
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.objectives.registry import register_objective

DEFAULT_CLIP = (0.2, 0.27)


@register_objective("grpo", default_clip=DEFAULT_CLIP)
def grpo(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO (DeepSeekMath eq. 3): token-clipped ratio, token mean per sequence, then mean over sequences."""
    term_BT, mask_BT, metrics = token_clipped_terms(logp_BT, old_logp_BT, advantages, mask_BT, cfg, DEFAULT_CLIP)
    loss = mean_over_sequences(term_BT, mask_BT)
    return finish(loss, metrics)
