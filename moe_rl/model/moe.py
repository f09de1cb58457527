"""The MoE feed-forward: router, SwiGLU experts stored as 3-D tensors, and two dispatch paths.

Shapes: T tokens (batch and sequence flattened), D model dim, E experts, K top-k, F expert hidden dim,
N = T*K token-slots (one per token and chosen expert).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.model.config import ModelConfig
from moe_rl.model.layers import SwiGLU, engine_router_dtype


class RouterOutput(NamedTuple):
    """The routing contract (docs/design.md section 4): the first three fields; logits are kept for the z-loss."""

    weights_TK: torch.Tensor  # gate weights, gathered from scores_TE at ids_TK (renormalised if configured)
    ids_TK: torch.Tensor  # int64 expert ids
    scores_TE: torch.Tensor  # softmax over all experts, fp32
    logits_TE: torch.Tensor  # pre-softmax router logits, fp32


class Router(nn.Module):
    """linear -> softmax -> top-k; under replay the ids come from the caller instead of top-k."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x_TD: torch.Tensor, replay_ids_TK: torch.Tensor | None = None) -> RouterOutput:
        # The router runs in fp32 even under bf16 autocast: top-k on low-precision scores makes ties
        # and flips that would show up as spurious churn.
        # Inside an emulated bf16 engine (layers.sampler_autocast) the gate runs in bf16 like the engine's would.
        dtype = engine_router_dtype() or torch.float32
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype)).float()
        scores_TE = logits_TE.softmax(dim=-1)
        if replay_ids_TK is None:
            ids_TK = scores_TE.topk(self.top_k, dim=-1).indices
        else:
            ids_TK = replay_ids_TK.long()
        # Gather from the dense scores, never from a post-top-k tensor, so the router keeps its
        # gradient under replay.
        weights_TK = scores_TE.gather(-1, ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return RouterOutput(weights_TK, ids_TK, scores_TE, logits_TE)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (grouped_mm is not an autocast op), else x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights: w_gate_up (E, D, 2F) and w_down (E, F, D)."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int, dispatch: str):
        super().__init__()
        self.n_experts = n_experts
        self.dispatch = dispatch
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))

    def forward(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        if self.dispatch == "grouped":
            return self._grouped(x_TD, weights_TK, ids_TK)
        return self._loop(x_TD, weights_TK, ids_TK)

    def _grouped(self, x_TD, weights_TK, ids_TK):
        """Sort token-slots by expert and run all experts as two grouped matmuls."""
        T, K = ids_TK.shape
        dtype = _compute_dtype(x_TD)
        ids_N = ids_TK.reshape(-1)
        slot_order_N = ids_N.argsort(stable=True)
        token_of_slot_N = slot_order_N // K
        tokens_per_expert_E = torch.bincount(ids_N, minlength=self.n_experts)
        group_ends_E = tokens_per_expert_E.cumsum(0).to(torch.int32)

        x_ND = x_TD[token_of_slot_N].to(dtype)
        gate_up_N2F = torch._grouped_mm(x_ND, self.w_gate_up.to(dtype), offs=group_ends_E)
        gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
        hidden_NF = F.silu(gate_NF) * up_NF
        y_ND = torch._grouped_mm(hidden_NF, self.w_down.to(dtype), offs=group_ends_E)

        gate_weight_N = weights_TK.reshape(-1)[slot_order_N]
        y_ND = y_ND.float() * gate_weight_N[:, None]
        out_TD = torch.zeros(T, x_TD.shape[1], device=x_TD.device, dtype=torch.float32)
        return out_TD.index_add(0, token_of_slot_N, y_ND).to(x_TD.dtype)

    def _loop(self, x_TD, weights_TK, ids_TK):
        """Reference path: one plain matmul chain per expert that received tokens."""
        out_TD = torch.zeros(x_TD.shape, device=x_TD.device, dtype=torch.float32)
        for e in range(self.n_experts):
            token_idx, slot_idx = (ids_TK == e).nonzero(as_tuple=True)
            if token_idx.numel() == 0:
                continue
            gate, up = (x_TD[token_idx] @ self.w_gate_up[e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w_down[e]
            out_TD = out_TD.index_add(0, token_idx, y.float() * weights_TK[token_idx, slot_idx, None])
        return out_TD.to(x_TD.dtype)


def load_balancing_loss(scores_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Switch Transformer auxiliary loss E * sum_e f_e * P_e; equals 1 under perfect balance.

    f_e is the fraction of token-slots sent to expert e (not differentiable), P_e the mean router probability.
    """
    E = scores_TE.shape[-1]
    slots_per_expert_E = torch.bincount(ids_TK.reshape(-1), minlength=E).float()
    fraction_E = slots_per_expert_E / max(ids_TK.numel(), 1)
    return E * (fraction_E * scores_TE.mean(dim=0)).sum()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: keeps router logits small so the softmax stays well conditioned."""
    return torch.logsumexp(logits_TE, dim=-1).pow(2).mean()


class MoEFeedForward(nn.Module):
    """Router + routed experts (+ optional shared expert). A routing session, when one is attached by
    `moe_rl.routing`, supplies replay ids and observes every decision; otherwise routing is native."""

    def __init__(self, cfg: ModelConfig, moe_index: int):
        super().__init__()
        self.moe_index = moe_index  # position among MoE layers; the routing trace's layer axis
        self.router = Router(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_expert, cfg.dispatch)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.d_shared_expert) if cfg.d_shared_expert else None
        self.routing_session = None  # set only inside a moe_rl.routing session

    @property
    def n_experts(self) -> int:
        return self.experts.n_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor):
        """Returns (y_BSD, load-balancing loss, z-loss).

        The losses count valid (non-padding) tokens only and are None when gradients are off.
        """
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        session = self.routing_session
        replay_ids_TK = session.replay_ids(self.moe_index, B, S) if session is not None else None
        routing = self.router(x_TD, replay_ids_TK)
        if session is not None:
            session.observe(self.moe_index, routing, B, S)
        y_TD = self.experts(x_TD, routing.weights_TK, routing.ids_TK)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        if not torch.is_grad_enabled():  # sampling and no-grad passes need no auxiliary losses
            return y_TD.view(B, S, D), None, None
        valid_T = valid_BS.reshape(-1)
        lb_loss = load_balancing_loss(routing.scores_TE[valid_T], routing.ids_TK[valid_T])
        z_loss = router_z_loss(routing.logits_TE[valid_T])
        return y_TD.view(B, S, D), lb_loss, z_loss
