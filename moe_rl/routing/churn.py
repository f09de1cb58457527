"""Churn between two routings of the same tokens: the share of activated experts, of router decisions and of
tokens whose routing changed (docs/design.md section 5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.errors import RoutingError
from moe_rl.routing.trace import RoutingTrace


@dataclass(frozen=True)
class ChurnStats:
    """Routing change between two routings A and B of the same tokens."""

    churn: float  # mean over (token, layer) of 1 - |S_A ∩ S_B| / K
    churn_per_layer: list[float]  # the same, per MoE layer
    set_change: float  # mean over (token, layer) of 1[S_A != S_B]
    set_change_per_layer: list[float]  # the same, per MoE layer
    token_any: float  # mean over tokens of 1[S_A != S_B in some layer]
    layers_changed: float  # mean over tokens of the number of layers with S_A != S_B
    n_tokens: int

    def as_metrics(self, prefix: str = "") -> dict[str, float]:
        metrics = {
            f"{prefix}churn": self.churn,
            f"{prefix}set_change": self.set_change,
            f"{prefix}token_any": self.token_any,
            f"{prefix}layers_changed": self.layers_changed,
        }
        metrics.update({f"{prefix}churn/L{l}": c for l, c in enumerate(self.churn_per_layer)})
        return metrics


def expert_overlap(a_LTK: torch.Tensor, b_LTK: torch.Tensor) -> torch.Tensor:
    """|S_A ∩ S_B| for every (layer, token): how many of A's K experts appear among B's."""
    return (a_LTK[..., :, None] == b_LTK[..., None, :]).any(dim=-1).sum(dim=-1)


def churn_stats(a: RoutingTrace, b: RoutingTrace, mask_BS: torch.Tensor | None = None) -> ChurnStats:
    """Churn between routings `a` and `b` over the tokens where `mask_BS` is true (all tokens if None)."""
    if a.ids_LBSK.shape != b.ids_LBSK.shape:
        raise RoutingError(
            f"cannot compare routings of different shape {tuple(a.ids_LBSK.shape)} and {tuple(b.ids_LBSK.shape)} "
            "(layers, batch, positions, K)"
        )
    if mask_BS is None:
        mask_BS = torch.ones(a.batch, a.seq_len, dtype=torch.bool, device=a.ids_LBSK.device)
    mask_BS = mask_BS.to(a.ids_LBSK.device, torch.bool)
    a_LTK, b_LTK = a.ids_LBSK[:, mask_BS], b.ids_LBSK[:, mask_BS]
    n_tokens = a_LTK.shape[1]
    if n_tokens == 0:
        nan = float("nan")
        return ChurnStats(nan, [nan] * a.n_layers, nan, [nan] * a.n_layers, nan, nan, 0)
    changed_frac_LT = 1.0 - expert_overlap(a_LTK, b_LTK).float() / a.top_k
    set_changed_LT = changed_frac_LT > 0
    return ChurnStats(
        churn=changed_frac_LT.mean().item(),
        churn_per_layer=changed_frac_LT.mean(dim=1).tolist(),
        set_change=set_changed_LT.float().mean().item(),
        set_change_per_layer=set_changed_LT.float().mean(dim=1).tolist(),
        token_any=set_changed_LT.any(dim=0).float().mean().item(),
        layers_changed=set_changed_LT.sum(dim=0).float().mean().item(),
        n_tokens=n_tokens,
    )
