"""GSPO: one length-normalised importance ratio per sequence, clipped per sequence.

Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071, eq. 5-7:

    s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) = exp((1/|y_i|) sum_t log w_it)
    L = (1/B) sum_i -min(s_i A_i, clip(s_i, 1-e_lo, 1+e_hi) A_i)

Default clip 3e-4 / 4e-4 (section 5.1): s_i is a geometric mean, so its natural spread is tiny and the range is
too. The clip acts on whole sequences: `clip_ratio/*_seq` is the fraction of sequences clipped and
`clip_ratio/*_mean` the fraction of response tokens that belong to clipped sequences (the paper's "clipped tokens").
Ratio metrics are over sequences (s_i).

With `[B, T]` advantages the paper's objective is not defined; we pair s_i with A_i = the masked mean of A_it over
the sequence's tokens (for per-sequence advantages this is exactly A_i). Sequences without response tokens are
left out of the mean over sequences.
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import clip_metrics, finish, ppo_clipped_term, prepare, ratio_metrics, sequence_advantages
from moe_rl.objectives.config import ObjectiveConfig, resolve_clip
from moe_rl.objectives.masked import masked_mean, nonempty_sequences, sequence_log_ratio
from moe_rl.objectives.registry import register_objective

DEFAULT_CLIP = (3e-4, 4e-4)


@register_objective("gspo", default_clip=DEFAULT_CLIP)
def gspo(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (arXiv 2507.18071 eq. 5-7): clipped sequence ratio s_i, mean over sequences."""
    eps_lo, eps_hi = resolve_clip(cfg, DEFAULT_CLIP)
    mask_BT, log_w_BT, adv_BT = prepare(logp_BT, old_logp_BT, advantages, mask_BT)
    s_B = sequence_log_ratio(log_w_BT, mask_BT).exp()
    adv_B = sequence_advantages(adv_BT, mask_BT)
    term_B, low_B, high_B = ppo_clipped_term(s_B, adv_B, eps_lo, eps_hi)
    seq_B = nonempty_sequences(mask_BT)
    loss = masked_mean(term_B, seq_B)
    return finish(loss, ratio_metrics(s_B, seq_B), clip_metrics(low_B[:, None], high_B[:, None], mask_BT))
