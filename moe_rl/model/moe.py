"""The MoE feed-forward: router, SwiGLU experts stored as 3-D tensors, and their dispatch paths, in plain torch.

Shapes: T tokens (batch and sequence flattened), D model dim, E experts, K top-k, F expert hidden dim,
N = T*K token-slots (one per token and chosen expert), R rows of an expert buffer (slots plus any padding).

Functions marked @replaceable are the torch reference of a step a kernel may do faster (moe_rl/kernels/: the router's
top-k, the slot sort, the row copies and sums, the grouped products); which kernels run on a machine is measured
there, and every one but the fp32 sampler's gives these functions' numbers bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.model.config import ModelConfig
from moe_rl.model.layers import SwiGLU
from moe_rl.model.replaceable import Kernels, replaceable


class RouterOutput(NamedTuple):
    """The routing contract (docs/design.md section 4): the first three fields; logits are kept for the z-loss."""

    weights_TK: torch.Tensor  # gate weights, gathered from scores_TE at ids_TK (renormalised if configured)
    ids_TK: torch.Tensor  # int64 expert ids
    scores_TE: torch.Tensor  # softmax over all experts, fp32 (float64 in a float64 model)
    logits_TE: torch.Tensor  # pre-softmax router logits, fp32 (float64 in a float64 model)
    native_ids_TK: torch.Tensor | None = None  # margin replay: the router's own top-k in this forward
    replayed_T: torch.Tensor | None = None  # margin replay: which tokens' decisions were replayed


class ReplayInputs(NamedTuple):
    """What a router uses instead of its own choice (R2, R3 and their variants; docs/design.md section 4)."""

    ids_TK: torch.Tensor  # the expert ids to use
    weights_TK: torch.Tensor | None = None  # the gate weights to use with them (R3 gate-weight replay), constants
    margin: float | None = None  # replay only the decisions whose router margin in this forward is below this


class Router(nn.Module):
    """linear -> softmax -> top-k; under replay the ids (and optionally the gate weights) come from the caller."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x_TD: torch.Tensor, replay: ReplayInputs | None = None, kernels: Kernels | None = None,
                router_dtype: torch.dtype | None = None) -> RouterOutput:
        # The router runs in fp32 even under bf16 autocast: top-k on low-precision scores makes ties
        # and flips that would show up as spurious churn. Inside an emulated bf16 engine the sampler passes
        # `router_dtype` (precision.Numerics): the gate then runs in bf16 like the engine's would.
        dtype = router_dtype or accumulation_dtype(x_TD.dtype)
        if torch.is_autocast_enabled(x_TD.device.type):
            with torch.autocast(device_type=x_TD.device.type, enabled=False):
                logits_TE = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype))
        else:  # the common fp32 CPU case, without entering a context per layer and step
            logits_TE = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype))
        logits_TE = logits_TE.to(accumulation_dtype(x_TD.dtype))
        scores_TE = logits_TE.softmax(dim=-1)
        native_ids_TK = replayed_T = None
        if replay is None:
            ids_TK = topk_indices(scores_TE, self.top_k, kernels=kernels)
        elif replay.margin is None:
            ids_TK = replay.ids_TK.long()
        else:  # replay only where the router's own choice is within `margin` of a tie
            native_ids_TK = topk_indices(scores_TE.detach(), self.top_k, kernels=kernels)
            replayed_T = topk_margin_T(scores_TE.detach(), self.top_k) < replay.margin
            ids_TK = torch.where(replayed_T[:, None], replay.ids_TK.long(), native_ids_TK)
        # Gather from the dense scores, never from a post-top-k tensor, so the router keeps its
        # gradient under replay.
        weights_TK = scores_TE.gather(-1, ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        if replay is not None and replay.weights_TK is not None:
            # Replayed gate weights are constants: the experts combine with the sampler's weights and the router
            # gets no gradient through them (only through the auxiliary losses, which read scores_TE).
            replayed_TK = replay.weights_TK.to(weights_TK.dtype)
            if replayed_T is None:
                weights_TK = replayed_TK
            else:
                weights_TK = torch.where(replayed_T[:, None], replayed_TK, weights_TK)
        return RouterOutput(weights_TK, ids_TK, scores_TE, logits_TE, native_ids_TK, replayed_T)


def topk_margin_T(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """score of the k-th minus score of the (k+1)-th expert, per token (+inf when k equals the number of experts)."""
    if k >= scores_TE.shape[-1]:
        return torch.full(scores_TE.shape[:1], math.inf, device=scores_TE.device)
    top_T2 = scores_TE.float().topk(k + 1, dim=-1).values[:, k - 1:]
    return top_T2[:, 0] - top_T2[:, 1]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every dtype but float64 (the tests' reference model, which must not round to fp32 anywhere)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (grouped_mm is not an autocast op), else x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


@replaceable("topk")
def topk_indices(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """The router's choice: the indices of each row's k largest scores, in descending order."""
    return scores_TE.topk(k, dim=-1).indices


class SlotLayout(NamedTuple):
    """Token-slots sorted by expert (stable, so each expert sees its tokens in token order)."""

    order_N: torch.Tensor  # slot index (t * K + k) of each sorted position
    ids_N: torch.Tensor  # expert id of each sorted position
    token_N: torch.Tensor  # token index (order_N // K) of each sorted position
    counts_E: torch.Tensor  # slots per expert


@replaceable("slots")
def sort_slots(ids_TK: torch.Tensor, n_experts: int) -> SlotLayout:
    """The stable sort of token-slots by expert id."""
    K = ids_TK.shape[1]
    ids_N = ids_TK.reshape(-1)
    # The same stable order from narrower keys: on CPU a stable sort of bytes is a radix sort, 4.5x faster than on
    # int64 at 36,864 slots (a whole-batch pass at 128 experts, top-8) and no slower at a few thousand.
    order_N = ids_N.to(torch.uint8 if n_experts <= 256 else torch.int32).argsort(stable=True)
    return SlotLayout(order_N, ids_N[order_N], order_N // K, torch.bincount(ids_N, minlength=n_experts))


@replaceable("rows")
def gather_rows(x_TD: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """x_TD[index_N]. Without autograd the embedding kernel copies the rows (about 3x faster than index_select on
    CPU at 8k rows of 64, the same values); with it, index_select's backward (an index_add into zeros) is the
    cheaper one."""
    if not (x_TD.requires_grad and torch.is_grad_enabled()):
        return F.embedding(index_N, x_TD)
    return x_TD.index_select(0, index_N)


class ExpertRows(NamedTuple):
    """The rows the expert products read: one block per expert, in expert order, each its sorted slots followed by
    any padding rows (Experts._padded)."""

    x_RD: torch.Tensor  # the input row of each buffer row: its slot's token's (zeros for padding)
    token_R: torch.Tensor  # its token (T for padding)
    weight_R: torch.Tensor  # its slot's gate weight (0 for padding)


@replaceable("rows")
def expert_rows(x_TD: torch.Tensor, weights_TK: torch.Tensor, slots: SlotLayout,
                block_rows_E: torch.Tensor | None = None, kernels: Kernels | None = None) -> ExpertRows:
    """The buffer with block_rows_E[e] >= n_e rows for expert e (None: exactly n_e, no padding)."""
    if block_rows_E is None:
        return ExpertRows(gather_rows(x_TD, slots.token_N, kernels=kernels), slots.token_N,
                          weights_TK.reshape(-1).index_select(0, slots.order_N))
    T, D = x_TD.shape
    block_starts_E = block_rows_E.cumsum(0) - block_rows_E
    n_rows = int(block_rows_E.sum())
    rows_N = _buffer_rows(slots, block_starts_E)
    token_R = torch.full((n_rows,), T, device=x_TD.device, dtype=torch.long).index_copy(0, rows_N, slots.token_N)
    weight_R = weights_TK.new_zeros(n_rows).index_copy(0, rows_N, weights_TK.reshape(-1)[slots.order_N])
    x_padded_TD = torch.cat([x_TD, x_TD.new_zeros(1, D)])  # padding rows read the zero row T
    return ExpertRows(gather_rows(x_padded_TD, token_R, kernels=kernels), token_R, weight_R)


def _buffer_rows(slots: SlotLayout, block_starts_E: torch.Tensor) -> torch.Tensor:
    """Buffer row of each sorted slot: its expert's block start + its rank within the expert's group."""
    starts_E = slots.counts_E.cumsum(0) - slots.counts_E
    rank_N = torch.arange(slots.ids_N.numel(), device=slots.ids_N.device) - starts_E[slots.ids_N]
    return block_starts_E[slots.ids_N] + rank_N


@replaceable("rows")
def combine_rows(y_RD: torch.Tensor, token_R: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """out_TD (fp32) = the sum of each token's rows of y_RD, in row order; padding rows (token T) are dropped."""
    out_TD = torch.zeros(n_tokens + 1, y_RD.shape[1], device=y_RD.device, dtype=torch.float32)
    return out_TD.index_add(0, token_R, y_RD)[:n_tokens]


@replaceable("rows")
def combine_weighted_rows(y_RD: torch.Tensor, weight_R: torch.Tensor, token_R: torch.Tensor,
                          n_tokens: int, kernels: Kernels | None = None) -> torch.Tensor:
    """combine_rows of the rows each scaled by its gate weight, in fp32."""
    return combine_rows(y_RD.float() * weight_R[:, None], token_R, n_tokens, kernels=kernels)


@replaceable("swiglu")
def swiglu(gate_up_N2F: torch.Tensor) -> torch.Tensor:
    """The experts' activation: silu(gate) * up, gate and up the two halves of each row of the first product."""
    gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
    return F.silu(gate_NF) * up_NF


@replaceable("swiglu")
def weighted_swiglu(gate_up_N2F: torch.Tensor, weight_N: torch.Tensor, kernels: Kernels | None = None
                    ) -> torch.Tensor:
    """swiglu of each row times the row's gate weight: the down product's input where the weight scales it."""
    return swiglu(gate_up_N2F, kernels=kernels) * weight_N[:, None]


@replaceable("mkl_products")
def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y_NF with the rows of expert e equal to x_ND[rows of e] @ w_EDF[e]; groups given by their end offsets."""
    return torch._grouped_mm(x_ND, w_EDF, offs=counts_E.cumsum(0).to(torch.int32))



@replaceable("mkl_products")
def short_block_rows(counts_E: torch.Tensor, capacity: int, d_model: int, d_expert: int,
                     dtype: torch.dtype) -> torch.Tensor | None:
    """Rows per expert block of the padded kernel: None, C = capacity rows each. A kernel may give shorter blocks
    (at least n_e rows) where their products are exactly those of the C-row blocks."""
    return None


# Padded batched matmuls win while groups are tiny (many experts, decode steps): one bmm replaces a loop of E small
# matmuls. They lose once padding adds more work than the loop's per-expert overhead saves.
# The rule is a cost model: padding pays for E * C rows where the loop computes N rows plus a fixed per-expert cost
# (CPU _grouped_mm issues two small matmuls and reads each group's offsets per expert), worth about
# PADDED_EXPERT_OVERHEAD_MACS multiply-adds. Measured (one CPU thread, E128 K8 d64 F32, 64 tokens, interleaved
# medians): grouped_mm 0.81 ms against padded 0.43 ms at C=8, 0.54 ms at C=12, 0.68 at C=16, 0.79 at C=20, so the
# break-even is near C = N/E + 16 rows of d64 F32 (6,144 multiply-adds each). At d256 F256 a row costs 32x more and
# the allowance vanishes: only near-perfect balance pads. With a hot expert (C in the hundreds) the loop wins.
# Since then both kernels got cheaper (grouped_gemm: MKL batch calls, short blocks; C kernels for the rows and sums),
# but the rule stays as measured then on purpose: the two kernels round an expert with 1-3 slots differently (a short
# product in one, a row of a C-row block in the other), so moving the break-even would change sampled tokens, and
# with them every committed study's numbers.
PADDED_MAX_MEAN_GROUP = 8  # mean slots per expert at or below which padding is considered
PADDED_MAX_WASTE = 2.5  # padded rows E * C over real slots N that are always acceptable
PADDED_EXPERT_OVERHEAD_MACS = 100_000  # per-expert cost of the grouped loop, in multiply-adds


def choose_kernel(device: torch.device, counts_E: torch.Tensor, n_slots: int,
                  aligned: bool = True, row_macs: int | None = None) -> tuple[str, int]:
    """('padded', capacity C) or ('grouped_mm', 0) for this call. CUDA takes grouped_mm (a real grouped kernel, and
    no host sync) unless the widths break its 16-byte alignment (`aligned`: D and F multiples of 8), where the
    padded bmm has no such constraint. On CPU the choice needs the largest group, one host read per layer;
    `row_macs` (D * 3F, the multiply-adds of one slot) prices the loop's per-expert overhead in padded rows."""
    E = counts_E.numel()
    if device.type == "cuda" and not aligned:
        return "padded", int(counts_E.max())
    if device.type == "cuda" or n_slots > PADDED_MAX_MEAN_GROUP * E:
        return "grouped_mm", 0
    capacity = int(counts_E.max())
    overhead_rows = PADDED_EXPERT_OVERHEAD_MACS // row_macs if row_macs else 0
    affordable_rows = max(PADDED_MAX_WASTE * max(n_slots, 1), n_slots + E * overhead_rows)
    if E * capacity > affordable_rows:
        return "grouped_mm", 0
    return "padded", capacity


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights: w_gate_up (E, D, 2F) and w_down (E, F, D).

    Dispatch paths (they compute the same function and differ only in fp rounding): 'loop' is the reference, one
    matmul chain per expert; 'grouped_mm' sorts token-slots by expert and runs grouped matmuls with group offsets;
    'padded' scatters the sorted slots into an (E, C, D) buffer padded to the largest group C and runs two batched
    matmuls; 'grouped' picks grouped_mm or padded per call by shape (`choose_kernel`), and in the fp32 sampler a
    kernel may run every expert in one pass instead (`routed_experts`; the trainer's passes never do).
    """

    def __init__(self, n_experts: int, d_model: int, d_expert: int, dispatch: str):
        super().__init__()
        self.n_experts = n_experts
        self.dispatch = dispatch
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))

    def forward(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                kernels: Kernels | None = None) -> torch.Tensor:
        if self.dispatch == "loop":
            return self._loop(x_TD, weights_TK, ids_TK)
        slots = sort_slots(ids_TK, self.n_experts, kernels=kernels)
        if self.dispatch == "grouped":
            return routed_experts(x_TD, weights_TK, slots, self.w_gate_up, self.w_down, kernels=kernels)
        capacity = int(slots.counts_E.max()) if self.dispatch == "padded" else 0
        return experts_by_kernel(self.dispatch, capacity, x_TD, weights_TK, slots, self.w_gate_up, self.w_down,
                                 kernels)

    def _loop(self, x_TD, weights_TK, ids_TK):
        """Reference path: one plain matmul chain per expert that received tokens."""
        out_TD = torch.zeros(x_TD.shape, device=x_TD.device, dtype=accumulation_dtype(x_TD.dtype))
        for e in range(self.n_experts):
            token_idx, slot_idx = (ids_TK == e).nonzero(as_tuple=True)
            if token_idx.numel() == 0:
                continue
            gate, up = (x_TD[token_idx] @ self.w_gate_up[e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w_down[e]
            out_TD = out_TD.index_add(0, token_idx, y.to(out_TD.dtype) * weights_TK[token_idx, slot_idx, None])
        return out_TD.to(x_TD.dtype)


@replaceable("sampler_experts")
def routed_experts(x_TD, weights_TK, slots: SlotLayout, w_gate_up_EDF2, w_down_EFD,
                   kernels: Kernels | None = None) -> torch.Tensor:
    """Dispatch 'grouped': grouped_mm or padded for this call, by shape (choose_kernel)."""
    _, d_expert, d_model = w_down_EFD.shape
    aligned = d_expert % 8 == 0 and d_model % 8 == 0
    kernel, capacity = choose_kernel(x_TD.device, slots.counts_E, weights_TK.numel(), aligned,
                                     row_macs=3 * d_model * d_expert)
    return experts_by_kernel(kernel, capacity, x_TD, weights_TK, slots, w_gate_up_EDF2, w_down_EFD, kernels)


def experts_by_kernel(kernel: str, capacity: int, x_TD, weights_TK, slots, w_gate_up_EDF2, w_down_EFD,
                      kernels: Kernels | None = None):
    if kernel == "padded":
        return _padded(x_TD, weights_TK, slots, capacity, w_gate_up_EDF2, w_down_EFD, kernels)
    return _grouped_mm(x_TD, weights_TK, slots, w_gate_up_EDF2, w_down_EFD, kernels)


def _grouped_mm(x_TD, weights_TK, slots: SlotLayout, w_gate_up_EDF2, w_down_EFD, kernels: Kernels | None):
    """All experts as two grouped matmuls over the sorted token-slots."""
    dtype = _compute_dtype(x_TD)
    rows = expert_rows(x_TD, weights_TK, slots, kernels=kernels)
    gate_up_N2F = grouped_mm(rows.x_RD.to(dtype), w_gate_up_EDF2.to(dtype), slots.counts_E, kernels=kernels)
    gate_weight_N = rows.weight_R
    d_expert, d_model = w_down_EFD.shape[1:]
    if dtype == torch.float32 and d_expert < d_model:
        # The down matmul is linear, so the gate weight may scale its input instead of its output: the same
        # product on F-wide rows instead of D-wide ones, forward and backward (one fp32 rounding apart).
        hidden_NF = weighted_swiglu(gate_up_N2F, gate_weight_N, kernels=kernels)
        y_ND = grouped_mm(hidden_NF, w_down_EFD, slots.counts_E, kernels=kernels)
        return combine_rows(y_ND, rows.token_R, weights_TK.shape[0], kernels=kernels).to(x_TD.dtype)
    # low precision, or F >= D: the gate weight is applied in fp32 after the matmul
    y_ND = grouped_mm(swiglu(gate_up_N2F, kernels=kernels), w_down_EFD.to(dtype), slots.counts_E, kernels=kernels)
    return combine_weighted_rows(y_ND, gate_weight_N, rows.token_R, weights_TK.shape[0],
                                 kernels=kernels).to(x_TD.dtype)


def _padded(x_TD, weights_TK, slots: SlotLayout, capacity: int, w_gate_up_EDF2, w_down_EFD,
            kernels: Kernels | None):
    """Two batched matmuls over a buffer of per-expert row blocks: expert e's r-th slot sits in row
    block_start_e + r. Padding rows read a zero row (index T) and add into a row that is dropped, so they change no
    output and no gradient. The blocks hold C rows (the largest group; torch.bmm over an (E, C, D) view), or, where a
    kernel gives the very same numbers from shorter blocks (`short_block_rows`), at least n_e rows each: a decode
    step at 128 experts then multiplies about a third of the rows."""
    E, d_expert, d_model = w_down_EFD.shape
    dtype = _compute_dtype(x_TD)
    block_rows_E = short_block_rows(slots.counts_E, capacity, d_model, d_expert, dtype, kernels=kernels)
    uniform = block_rows_E is None
    if uniform:
        block_rows_E = slots.counts_E.new_full((E,), capacity)
    rows = expert_rows(x_TD, weights_TK, slots, block_rows_E, kernels=kernels)
    x_RD, n_rows = rows.x_RD.to(dtype), rows.x_RD.shape[0]

    def blocks_times(w_EDF, a_RD):
        if uniform:
            return torch.bmm(a_RD.view(E, capacity, -1), w_EDF).view(n_rows, -1)
        return grouped_mm(a_RD, w_EDF, block_rows_E, kernels=kernels)

    gate_up_R2F = blocks_times(w_gate_up_EDF2.to(dtype), x_RD)
    if dtype == torch.float32 and d_expert < d_model:  # the gate weight on the narrower side
        y_RD = blocks_times(w_down_EFD, weighted_swiglu(gate_up_R2F, rows.weight_R, kernels=kernels))
        return combine_rows(y_RD, rows.token_R, weights_TK.shape[0], kernels=kernels).to(x_TD.dtype)
    y_RD = blocks_times(w_down_EFD.to(dtype), swiglu(gate_up_R2F, kernels=kernels))
    return combine_weighted_rows(y_RD, rows.weight_R, rows.token_R, weights_TK.shape[0],
                                 kernels=kernels).to(x_TD.dtype)


def load_balancing_loss(scores_TE: torch.Tensor, ids_TK: torch.Tensor, valid_T: torch.Tensor | None = None):
    """Switch Transformer auxiliary loss E * sum_e f_e * P_e over the valid tokens; equals 1 under perfect balance.

    f_e is the fraction of token-slots sent to expert e (not differentiable), P_e the mean router probability.
    Padding is masked by weights rather than by indexing, which would copy (T, E) tensors forward and backward.
    """
    E = scores_TE.shape[-1]
    if valid_T is None:
        valid_T = torch.ones(scores_TE.shape[0], dtype=torch.bool, device=scores_TE.device)
    n_valid = valid_T.sum().clamp(min=1)
    slots_per_expert_E = torch.bincount(ids_TK[valid_T].reshape(-1), minlength=E).float()
    fraction_E = slots_per_expert_E / (n_valid * ids_TK.shape[-1])
    mean_prob_E = (valid_T.to(scores_TE.dtype) @ scores_TE) / n_valid
    return E * (fraction_E * mean_prob_E).sum()


def router_z_loss(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE z-loss over the valid tokens: keeps router logits small so the softmax stays well conditioned."""
    z_T = torch.logsumexp(logits_TE, dim=-1).pow(2)
    if valid_T is None:
        return z_T.mean()
    return (z_T * valid_T).sum() / valid_T.sum().clamp(min=1)


class MoEFeedForward(nn.Module):
    """Router + routed experts (+ optional shared expert). A routing session, when one is attached by
    `moe_rl.routing.replay`, supplies the router's replay inputs and observes every decision; otherwise routing is
    native."""

    def __init__(self, cfg: ModelConfig, moe_index: int):
        super().__init__()
        self.moe_index = moe_index  # position among MoE layers; the routing trace's layer axis
        self.router = Router(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_expert, cfg.dispatch)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.d_shared_expert) if cfg.d_shared_expert else None
        self.routing_session = None  # set only inside a moe_rl.routing.replay session
        self.computes_z_loss = cfg.z_loss_coef != 0  # at coefficient 0 it would add only zeros: not computed

    @property
    def n_experts(self) -> int:
        return self.experts.n_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor, kernels: Kernels | None = None,
                router_dtype: torch.dtype | None = None):
        """Returns (y_BSD, load-balancing loss, z-loss). `kernels` and `router_dtype`: precision.Numerics.

        The losses count valid (non-padding) tokens only and are None when gradients are off (the z-loss also at
        z_loss_coef 0).
        """
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        session = self.routing_session
        replay = session.replay_inputs(self.moe_index, B, S) if session is not None else None
        routing = self.router(x_TD, replay, kernels, router_dtype)
        if session is not None:
            session.observe(self.moe_index, routing, B, S)
        y_TD = self.experts(x_TD, routing.weights_TK, routing.ids_TK, kernels)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        if not torch.is_grad_enabled():  # sampling and no-grad passes need no auxiliary losses
            return y_TD.view(B, S, D), None, None
        valid_T = valid_BS.reshape(-1)
        lb_loss = load_balancing_loss(routing.scores_TE, routing.ids_TK, valid_T)
        # With coefficient 0 the z-loss adds zero to the loss and zeros to the router's gradient, at the price of a
        # logsumexp over every token and expert of every layer and its backward: None instead.
        z_loss = router_z_loss(routing.logits_TE, valid_T) if self.computes_z_loss else None
        return y_TD.view(B, S, D), lb_loss, z_loss
