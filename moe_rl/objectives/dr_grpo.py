"""Dr. GRPO: GRPO's clipped token term without the length and std biases.

Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783 (the Dr. GRPO
objective). Two changes to GRPO, each removing a bias the paper identifies:

    A_i = r_i - mean_G r                         (no division by std_G r: the spec tells the trainer)
    L = sum_i sum_t -min(w_it A_i, clip(w_it, 1-e_lo, 1+e_hi) A_i) / (B * L_max)

The denominator is a constant, B sequences times the generation budget L_max (`cfg.max_response_len`, default the
mask width T), so a long wrong answer is not penalised less per token than a short one. Default clip 0.2 / 0.2.
Clip metrics and ratio metrics as GRPO (token level).
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import finish, token_clipped_terms
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.objectives.masked import masked_sum, sequence_lengths
from moe_rl.objectives.registry import register_objective

DEFAULT_CLIP = (0.2, 0.2)


@register_objective("dr_grpo", default_clip=DEFAULT_CLIP, normalize_adv_by_std=False, loss_denominator="rows")
def dr_grpo(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
    cfg: ObjectiveConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO (arXiv 2503.20783): GRPO term, sum over all tokens / (num sequences * max length)."""
    term_BT, mask_BT, metrics = token_clipped_terms(logp_BT, old_logp_BT, advantages, mask_BT, cfg, DEFAULT_CLIP)
    num_sequences = mask_BT.shape[0]
    loss = masked_sum(term_BT, mask_BT) / (num_sequences * constant_length(cfg, mask_BT))
    return finish(loss, metrics)


def constant_length(cfg: ObjectiveConfig, mask_BT: torch.Tensor) -> int:
    """L_max: `cfg.max_response_len`, or the mask width; refused if a response is longer than it."""
    if cfg.max_response_len is None:
        return max(mask_BT.shape[1], 1)
    longest = int(sequence_lengths(mask_BT).max()) if mask_BT.numel() else 0
    if longest > cfg.max_response_len:
        raise ValueError(f"a response has {longest} tokens, more than max_response_len={cfg.max_response_len}")
    return cfg.max_response_len
