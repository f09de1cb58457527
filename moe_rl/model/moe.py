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
from moe_rl.model.cpu_topk import topk_indices
from moe_rl.model.grouped_gemm import exact_min_block_rows, grouped_mm, mkl_grouped_mm
from moe_rl.model.layers import SwiGLU, engine_router_dtype
from moe_rl.model.native import library as native_library


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
        if torch.is_autocast_enabled(x_TD.device.type):
            with torch.autocast(device_type=x_TD.device.type, enabled=False):
                logits_TE = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype)).float()
        else:  # the common fp32 CPU case, without entering a context per layer and step
            logits_TE = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype)).float()
        scores_TE = logits_TE.softmax(dim=-1)
        if replay_ids_TK is None:
            ids_TK = topk_indices(scores_TE, self.top_k)  # scores_TE.topk(K).indices, faster on CPU
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


def gather_rows(x_TD: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """x_TD[index_N]. The embedding kernel copies the rows (about 3x faster than index_select on CPU at 8k rows of
    64, the same values). With autograd, index_select's backward (an index_add into zeros) is the cheaper one; on CPU
    in fp32 the C sum (native_kernels.c, add_rows) makes the very same additions, so `_NativeGatherRows` serves."""
    if not (x_TD.requires_grad and torch.is_grad_enabled()):
        return F.embedding(index_N, x_TD)
    if _native_for(x_TD) is not None:
        return _NativeGatherRows.apply(x_TD, index_N)
    return x_TD.index_select(0, index_N)


class _NativeGatherRows(torch.autograd.Function):
    """x_TD[index_N] by the embedding kernel; backward: each row's gradients summed into its token in index order,
    which is index_select's backward (index_add into zeros) bit for bit."""

    @staticmethod
    def forward(ctx, x_TD, index_N):
        ctx.save_for_backward(index_N)
        ctx.n_tokens = x_TD.shape[0]
        return F.embedding(index_N, x_TD)

    @staticmethod
    def backward(ctx, grad_ND):
        (index_N,) = ctx.saved_tensors
        return _add_rows(native_library(), grad_ND, index_N, ctx.n_tokens), None


class SlotLayout(NamedTuple):
    """Token-slots sorted by expert (stable, so each expert sees its tokens in token order)."""

    order_N: torch.Tensor  # slot index (t * K + k) of each sorted position
    ids_N: torch.Tensor  # expert id of each sorted position
    token_N: torch.Tensor  # token index (order_N // K) of each sorted position
    counts_E: torch.Tensor  # slots per expert


def sort_slots(ids_TK: torch.Tensor, n_experts: int) -> SlotLayout:
    """The stable sort of token-slots by expert id. On CPU a C counting sort (native_kernels.c) gives the same
    layout (a stable sort has one answer) in one pass: at 5,632 slots and 128 experts (a 32-sequence minibatch at the
    paper's routing shape) torch's argsort, gather, bincount and division take 127 us, the kernel 23 us (one thread,
    medians; inside a 48-layer forward, where caches are cold, 300 us against 55 us)."""
    kernel = native_library() if ids_TK.device.type == "cpu" else None
    if kernel is not None:
        return _counting_sort(kernel, ids_TK, n_experts)
    K = ids_TK.shape[1]
    ids_N = ids_TK.reshape(-1)
    # The same stable order from narrower keys: on CPU a stable sort of bytes is a radix sort, 4.5x faster than on
    # int64 at 36,864 slots (a whole-batch pass at 128 experts, top-8) and no slower at a few thousand.
    order_N = ids_N.to(torch.uint8 if n_experts <= 256 else torch.int32).argsort(stable=True)
    return SlotLayout(order_N, ids_N[order_N], order_N // K, torch.bincount(ids_N, minlength=n_experts))


def _counting_sort(kernel, ids_TK: torch.Tensor, n_experts: int) -> SlotLayout:
    K = ids_TK.shape[1]
    ids_N = ids_TK.reshape(-1).long().contiguous()
    N = ids_N.numel()
    order_N, sorted_ids_N, token_N = (torch.empty(N, dtype=torch.int64) for _ in range(3))
    counts_E = torch.empty(n_experts, dtype=torch.int64)
    status = kernel.sort_slots(ids_N.data_ptr(), N, K, n_experts, order_N.data_ptr(), sorted_ids_N.data_ptr(),
                               token_N.data_ptr(), counts_E.data_ptr())
    if status == -1:
        raise ValueError(f"expert ids must lie in [0, {n_experts}); got {ids_N.min()}..{ids_N.max()}")
    if status != 0:
        raise MemoryError("sorting token-slots by expert: out of memory")
    return SlotLayout(order_N, sorted_ids_N, token_N, counts_E)


class ExpertRows(NamedTuple):
    """The rows the expert products read: one block per expert, in expert order, each its sorted slots followed by
    any padding rows (Experts._padded)."""

    x_RD: torch.Tensor  # the input row of each buffer row: its slot's token's (zeros for padding)
    token_R: torch.Tensor  # its token (T for padding)
    weight_R: torch.Tensor  # its slot's gate weight (0 for padding)


def expert_rows(x_TD: torch.Tensor, weights_TK: torch.Tensor, slots: SlotLayout,
                block_rows_E: torch.Tensor | None = None) -> ExpertRows:
    """The buffer with block_rows_E[e] >= n_e rows for expert e (None: exactly n_e, no padding). Without autograd
    on CPU in fp32, one C pass (native_kernels.c, expert_rows) makes the same copies as the torch code."""
    kernel = _native_without_grad(x_TD, weights_TK)
    if kernel is not None:
        return _native_expert_rows(kernel, x_TD, weights_TK, slots, block_rows_E)
    if block_rows_E is None:
        return ExpertRows(gather_rows(x_TD, slots.token_N), slots.token_N,
                          weights_TK.reshape(-1).index_select(0, slots.order_N))
    T, D = x_TD.shape
    block_starts_E = block_rows_E.cumsum(0) - block_rows_E
    n_rows = int(block_rows_E.sum())
    rows_N = _buffer_rows(slots, block_starts_E)
    token_R = torch.full((n_rows,), T, device=x_TD.device, dtype=torch.long).index_copy(0, rows_N, slots.token_N)
    weight_R = weights_TK.new_zeros(n_rows).index_copy(0, rows_N, weights_TK.reshape(-1)[slots.order_N])
    x_padded_TD = torch.cat([x_TD, x_TD.new_zeros(1, D)])  # padding rows read the zero row T
    return ExpertRows(gather_rows(x_padded_TD, token_R), token_R, weight_R)


def combine_rows(y_RD: torch.Tensor, token_R: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """out_TD (fp32) = the sum of each token's rows of y_RD, in row order; padding rows (token T) are dropped. One C
    pass without autograd (native_kernels.c, add_rows: the additions of index_add, in its order), else index_add."""
    kernel = _native_without_grad(y_RD)
    if kernel is not None:
        return _add_rows(kernel, y_RD, token_R, n_tokens)
    if _native_for(y_RD) is not None:
        return _NativeCombineRows.apply(y_RD, token_R, n_tokens)
    out_TD = torch.zeros(n_tokens + 1, y_RD.shape[1], device=y_RD.device, dtype=torch.float32)
    return out_TD.index_add(0, token_R, y_RD)[:n_tokens]


def _add_rows(kernel, y_RD: torch.Tensor, token_R: torch.Tensor, n_tokens: int) -> torch.Tensor:
    y_RD, token_R = y_RD.contiguous(), token_R.contiguous()
    out_TD = torch.empty(n_tokens, y_RD.shape[1], dtype=torch.float32)
    if kernel.add_rows(y_RD.data_ptr(), y_RD.shape[0], y_RD.shape[1], token_R.data_ptr(), n_tokens,
                       out_TD.data_ptr()) != 0:
        raise ValueError(f"a buffer row names a token outside [0, {n_tokens}]")
    return out_TD


class _NativeCombineRows(torch.autograd.Function):
    """combine_rows with autograd: the C sum forward; backward, each row's token's gradient (zeros for padding
    rows), the copies index_add's backward (an index_select of the gradient) makes."""

    @staticmethod
    def forward(ctx, y_RD, token_R, n_tokens: int):
        ctx.save_for_backward(token_R)
        return _add_rows(native_library(), y_RD, token_R, n_tokens)

    @staticmethod
    def backward(ctx, grad_TD):
        (token_R,) = ctx.saved_tensors
        grad_with_padding_TD = torch.cat([grad_TD, grad_TD.new_zeros(1, grad_TD.shape[1])])
        return F.embedding(token_R, grad_with_padding_TD), None, None


def _native_without_grad(*tensors: torch.Tensor):
    """The C kernels, where they may stand in for torch directly: CPU fp32 tensors and no autograd through them."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return _native_for(*tensors)


def _native_for(*tensors: torch.Tensor):
    """The C kernels for CPU fp32 tensors (with autograd, inside the Functions that wrap them), else None."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return native_library()


SAMPLER_KERNEL_LANES = 16  # the sampler's experts kernel works in 16-float vectors of the model and expert widths


def _sampler_kernel_serves(x_TD: torch.Tensor, w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor) -> bool:
    """The fp32 sampler (inference mode marks the sampler's passes; the trainer's no-grad passes run under no_grad)
    outside autocast, with model and expert widths that are multiples of 16, and the kernels built."""
    _, d_expert, d_model = w_down_EFD.shape
    widths_fit = d_model % SAMPLER_KERNEL_LANES == 0 and d_expert % SAMPLER_KERNEL_LANES == 0
    return (torch.is_inference_mode_enabled() and not torch.is_autocast_enabled("cpu") and widths_fit
            and _native_for(x_TD, w_gate_up_EDF2, w_down_EFD) is not None)


def _sampler_experts(x_TD, weights_TK, slots: SlotLayout, w_gate_up_EDF2, w_down_EFD) -> torch.Tensor:
    """Every expert's SwiGLU on its slots in one C pass (native_kernels.c, sampler_experts): four slots of an expert
    per read of its weights, no buffers between the products. Agrees with the grouped path to fp32 rounding."""
    (T, D), (E, F) = x_TD.shape, w_down_EFD.shape[:2]
    x_TD, weights_TK = x_TD.contiguous(), weights_TK.contiguous()
    out_TD = torch.empty(T, D, dtype=torch.float32)
    status = native_library().sampler_experts(
        x_TD.data_ptr(), T, D, F, weights_TK.shape[1], slots.token_N.data_ptr(), slots.order_N.data_ptr(),
        weights_TK.data_ptr(), slots.counts_E.data_ptr(), E, w_gate_up_EDF2.contiguous().data_ptr(),
        w_down_EFD.contiguous().data_ptr(), out_TD.data_ptr())
    if status != 0:
        raise ValueError(f"sampler experts kernel: status {status} for {T} tokens, d_model {D}, d_expert {F}")
    return out_TD


def _native_expert_rows(kernel, x_TD, weights_TK, slots: SlotLayout, block_rows_E) -> ExpertRows:
    (T, D), E = x_TD.shape, slots.counts_E.numel()
    x_TD, weights_TK = x_TD.contiguous(), weights_TK.contiguous()
    n_rows = slots.token_N.numel() if block_rows_E is None else int(block_rows_E.sum())
    if block_rows_E is not None:
        block_rows_E = block_rows_E.to(torch.int64).contiguous()
    x_RD, token_R, weight_R = (torch.empty(n_rows, D, dtype=torch.float32), torch.empty(n_rows, dtype=torch.int64),
                                 torch.empty(n_rows, dtype=torch.float32))
    written = kernel.expert_rows(x_TD.data_ptr(), T, D, slots.token_N.data_ptr(), slots.order_N.data_ptr(),
                                 slots.token_N.numel(), weights_TK.data_ptr(), slots.counts_E.data_ptr(),
                                 None if block_rows_E is None else block_rows_E.data_ptr(), E, x_RD.data_ptr(),
                                 token_R.data_ptr(), weight_R.data_ptr())
    if written != n_rows:
        raise ValueError("expert groups that do not add up to the slots, blocks shorter than their groups, or slots "
                         "of tokens outside the batch")
    return ExpertRows(x_RD, token_R, weight_R)


def _buffer_rows(slots: SlotLayout, block_starts_E: torch.Tensor) -> torch.Tensor:
    """Buffer row of each sorted slot: its expert's block start + its rank within the expert's group."""
    starts_E = slots.counts_E.cumsum(0) - slots.counts_E
    rank_N = torch.arange(slots.ids_N.numel(), device=slots.ids_N.device) - starts_E[slots.ids_N]
    return block_starts_E[slots.ids_N] + rank_N


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
    matmul chain per expert; 'grouped_mm' sorts token-slots by expert and runs torch._grouped_mm with group offsets;
    'padded' scatters the sorted slots into an (E, C, D) buffer padded to the largest group C and runs two batched
    matmuls; 'grouped' picks grouped_mm or padded per call by shape (`choose_kernel`), and in the fp32 sampler runs
    every expert in one C pass instead (`_sampler_experts`; the trainer's passes never do).
    """

    def __init__(self, n_experts: int, d_model: int, d_expert: int, dispatch: str):
        super().__init__()
        self.n_experts = n_experts
        self.dispatch = dispatch
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))

    def forward(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        if self.dispatch == "loop":
            return self._loop(x_TD, weights_TK, ids_TK)
        slots = sort_slots(ids_TK, self.n_experts)
        if self.dispatch == "grouped" and _sampler_kernel_serves(x_TD, self.w_gate_up, self.w_down):
            return _sampler_experts(x_TD, weights_TK, slots, self.w_gate_up, self.w_down)
        kernel, capacity = self.dispatch, 0
        if kernel == "grouped":
            _, d_expert, d_model = self.w_down.shape
            aligned = d_expert % 8 == 0 and d_model % 8 == 0
            kernel, capacity = choose_kernel(x_TD.device, slots.counts_E, ids_TK.numel(), aligned,
                                             row_macs=3 * d_model * d_expert)
        elif kernel == "padded":
            capacity = int(slots.counts_E.max())
        if kernel == "padded":
            return self._padded(x_TD, weights_TK, slots, capacity)
        return self._grouped_mm(x_TD, weights_TK, slots)

    def _grouped_mm(self, x_TD, weights_TK, slots: SlotLayout):
        """All experts as two grouped matmuls over the sorted token-slots."""
        dtype = _compute_dtype(x_TD)
        rows = expert_rows(x_TD, weights_TK, slots)
        gate_up_N2F = grouped_mm(rows.x_RD.to(dtype), self.w_gate_up.to(dtype), slots.counts_E)
        gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
        hidden_NF = F.silu(gate_NF) * up_NF
        gate_weight_N = rows.weight_R
        d_expert, d_model = self.w_down.shape[1:]
        if dtype == torch.float32 and d_expert < d_model:
            # The down matmul is linear, so the gate weight may scale its input instead of its output: the same
            # product on F-wide rows instead of D-wide ones, forward and backward (one fp32 rounding apart).
            hidden_NF = hidden_NF * gate_weight_N[:, None]
            y_ND = grouped_mm(hidden_NF, self.w_down, slots.counts_E)
        else:  # low precision: the gate weight is applied in fp32 after the matmul
            y_ND = grouped_mm(hidden_NF, self.w_down.to(dtype), slots.counts_E)
            y_ND = y_ND.float() * gate_weight_N[:, None]
        return combine_rows(y_ND, rows.token_R, weights_TK.shape[0]).to(x_TD.dtype)

    def _padded(self, x_TD, weights_TK, slots: SlotLayout, capacity: int):
        """Two batched matmuls over a buffer of per-expert row blocks: expert e's r-th slot sits in row
        block_start_e + r. Padding rows read a zero row (index T) and add into a row that is dropped, so they change
        no output and no gradient. The blocks hold C rows (the largest group; torch.bmm over an (E, C, D) view),
        or, in passes without autograd where MKL gives the very same numbers from shorter blocks (`_short_blocks`),
        max(n_e, m0) rows each (one MKL batch call): a decode step at 128 experts then multiplies about a third of
        the rows."""
        E = self.n_experts
        dtype = _compute_dtype(x_TD)
        block_rows_E = self._short_blocks(x_TD, slots.counts_E, capacity, dtype)
        uniform = block_rows_E is None
        if uniform:
            block_rows_E = slots.counts_E.new_full((E,), capacity)
        rows = expert_rows(x_TD, weights_TK, slots, block_rows_E)
        x_RD, n_rows = rows.x_RD.to(dtype), rows.x_RD.shape[0]

        def blocks_times(w_EDF, a_RD):
            if uniform:
                return torch.bmm(a_RD.view(E, capacity, -1), w_EDF).view(n_rows, -1)
            return mkl_grouped_mm(a_RD, w_EDF, block_rows_E)

        gate_RF, up_RF = blocks_times(self.w_gate_up.to(dtype), x_RD).chunk(2, dim=-1)
        hidden_RF = F.silu(gate_RF) * up_RF
        if dtype == torch.float32 and hidden_RF.shape[-1] < x_TD.shape[1]:  # the gate weight on the narrower side
            y_RD = blocks_times(self.w_down, hidden_RF * rows.weight_R[:, None])
        else:
            y_RD = blocks_times(self.w_down.to(dtype), hidden_RF).float() * rows.weight_R[:, None]
        return combine_rows(y_RD, rows.token_R, weights_TK.shape[0]).to(x_TD.dtype)

    def _short_blocks(self, x_TD, counts_E, capacity: int, dtype) -> torch.Tensor | None:
        """Rows per expert block, max(n_e, m0), where shorter blocks give the C-row blocks' numbers exactly (see
        grouped_gemm.exact_min_block_rows); None where they might not or cannot (autograd, GPU, other dtypes, more
        than one thread, C below m0)."""
        if torch.is_grad_enabled() or x_TD.device.type != "cpu" or dtype != torch.float32:
            return None
        d_expert, d_model = self.w_down.shape[1:]
        exact_rows = [exact_min_block_rows(d_model, 2 * d_expert, capacity),
                      exact_min_block_rows(d_expert, d_model, capacity)]
        if None in exact_rows or max(exact_rows) >= capacity:
            return None
        return counts_E.clamp(min=max(exact_rows))

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
    `moe_rl.routing`, supplies replay ids and observes every decision; otherwise routing is native."""

    def __init__(self, cfg: ModelConfig, moe_index: int):
        super().__init__()
        self.moe_index = moe_index  # position among MoE layers; the routing trace's layer axis
        self.router = Router(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_expert, cfg.dispatch)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.d_shared_expert) if cfg.d_shared_expert else None
        self.routing_session = None  # set only inside a moe_rl.routing session
        self.computes_z_loss = cfg.z_loss_coef != 0  # at coefficient 0 it would add only zeros: not computed

    @property
    def n_experts(self) -> int:
        return self.experts.n_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor):
        """Returns (y_BSD, load-balancing loss, z-loss).

        The losses count valid (non-padding) tokens only and are None when gradients are off (the z-loss also at
        z_loss_coef 0).
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
        lb_loss = load_balancing_loss(routing.scores_TE, routing.ids_TK, valid_T)
        # With coefficient 0 the z-loss adds zero to the loss and zeros to the router's gradient, at the price of a
        # logsumexp over every token and expert of every layer and its backward: None instead.
        z_loss = router_z_loss(routing.logits_TE, valid_T) if self.computes_z_loss else None
        return y_TD.view(B, S, D), lb_loss, z_loss
