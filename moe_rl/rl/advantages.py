"""Group-relative advantages and reward statistics (docs/design.md section 6).

Rewards come as `rewards_NG`: N groups (prompts) of G completions each. GRPO's outcome advantage
(DeepSeekMath, arXiv 2402.03300, section 4.1.2) is

    A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)        (Dr. GRPO, arXiv 2503.20783: no division by std)

std is the unbiased sample std (Bessel's correction, divide by G-1), as `torch.std` computes it and as TRL and verl
use it for GRPO, so our advantages and our logged `reward_std` match theirs for the same rewards.
"""

from __future__ import annotations

import torch


def _check_groups(rewards_NG: torch.Tensor) -> None:
    if rewards_NG.dim() != 2 or rewards_NG.shape[1] < 2:
        raise ValueError(
            f"rewards_NG must be [N groups, G completions] with G >= 2 (one completion has nothing to be "
            f"relative to), got shape {tuple(rewards_NG.shape)}"
        )


def zero_std_groups(rewards_NG: torch.Tensor) -> torch.Tensor:
    """`[N]` bool: groups whose G rewards are all exactly equal: zero advantage, no signal (DAPO drops them)."""
    _check_groups(rewards_NG)
    return (rewards_NG == rewards_NG[:, :1]).all(dim=1)


def group_advantages(rewards_NG: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_ij = (r_ij - mean_j r) / (std_j r + eps), or r_ij - mean_j r without `scale_by_std`; `[N, G]`.

    Zero-std groups get exactly 0: the float32 mean of equal values can miss them by an ulp (seven rewards of 0.1
    average to 0.1 - 7e-9), which divided by std + eps = 1e-6 would leave a spurious advantage of up to ~0.06.
    """
    _check_groups(rewards_NG)
    rewards_NG = rewards_NG.to(torch.promote_types(rewards_NG.dtype, torch.float32))
    centred_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred_NG = centred_NG / (rewards_NG.std(dim=1, keepdim=True) + eps)
    return torch.where(zero_std_groups(rewards_NG)[:, None], torch.zeros_like(centred_NG), centred_NG)


def reward_stats(rewards_NG: torch.Tensor) -> dict[str, float]:
    """TRL-named reward metrics of one rollout batch.

    - `reward`: mean reward over all completions.
    - `reward_std`: mean over groups of the per-group (unbiased) std, TRL's definition: the spread the advantage
      normalisation divides by, not the spread across prompts.
    - `frac_reward_zero_std`: fraction of groups whose rewards are all equal.
    """
    _check_groups(rewards_NG)
    rewards_NG = rewards_NG.to(torch.promote_types(rewards_NG.dtype, torch.float32))
    return {
        "reward": rewards_NG.mean().item(),
        "reward_std": rewards_NG.std(dim=1).mean().item(),
        "frac_reward_zero_std": zero_std_groups(rewards_NG).float().mean().item(),
    }
