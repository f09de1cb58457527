"""The experts' data movement on CPU in C (native_kernels.c): token-slots sorted by expert, the experts' input rows
gathered, and their outputs summed back into tokens. Each makes the very copies and additions of the torch code in
moe_rl/model/moe.py it stands in for (same order, no fused multiply-add), so the numbers are torch's bit for bit.

Why: at the paper's routing shape (128 experts, top-8, a few thousand slots per call) torch's argsort, bincount,
index_select and index_add spend most of their time on set-up and temporaries, once per layer and call. Measured
(one thread, medians; 5,632 slots, 128 experts): the slot sort 127 us in torch, 23 us here; the gather is the
embedding kernel's copy (about 3x faster than index_select at 8k rows of 64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_rl.kernels.native import library as native_library
from moe_rl.kernels.registry import implements
from moe_rl.model.moe import ExpertRows, SlotLayout


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def without_grad(*tensors: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@implements("sort_slots")
def sort_slots(ids_TK: torch.Tensor, n_experts: int) -> SlotLayout:
    """The stable sort of token-slots by expert id as one C counting sort (a stable sort has one answer)."""
    kernel = native_library()
    if ids_TK.device.type != "cpu" or kernel is None:
        return NotImplemented
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


@implements("gather_rows")
def gather_rows(x_TD: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """x_TD[index_N] with autograd: the embedding kernel's copy forward, the C sum backward (_GatherRows)."""
    if without_grad(x_TD) or not fp32_cpu(x_TD) or native_library() is None:
        return NotImplemented  # without autograd the reference is already the embedding kernel
    return _GatherRows.apply(x_TD, index_N)


class _GatherRows(torch.autograd.Function):
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
        return add_rows(grad_ND, index_N, ctx.n_tokens), None


@implements("expert_rows")
def expert_rows(x_TD: torch.Tensor, weights_TK: torch.Tensor, slots: SlotLayout,
                block_rows_E: torch.Tensor | None = None) -> ExpertRows:
    """The rows buffer in one C pass, without autograd (the copies of the torch code)."""
    kernel = native_library()
    if not (without_grad(x_TD, weights_TK) and fp32_cpu(x_TD, weights_TK)) or kernel is None:
        return NotImplemented
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


@implements("combine_rows")
def combine_rows(y_RD: torch.Tensor, token_R: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The sum of each token's rows in one C pass (index_add's additions, in its order); with autograd inside a
    Function whose backward is index_add's (a gather of the gradient)."""
    if not fp32_cpu(y_RD) or native_library() is None:
        return NotImplemented
    if without_grad(y_RD):
        return add_rows(y_RD, token_R, n_tokens)
    return _CombineRows.apply(y_RD, token_R, n_tokens)


def add_rows(y_RD: torch.Tensor, token_R: torch.Tensor, n_tokens: int,
             weight_R: torch.Tensor | None = None) -> torch.Tensor:
    rows = y_RD.shape[0]
    if token_R.shape != (rows,) or (weight_R is not None and weight_R.shape != (rows,)):
        weights = "" if weight_R is None else f" and {tuple(weight_R.shape)} weights"
        raise ValueError(f"summing {rows} rows into tokens needs one token and one weight per row; got "
                         f"{tuple(token_R.shape)} tokens{weights}")  # the C loop would read past their ends
    y_RD, token_R = y_RD.contiguous(), token_R.contiguous()
    if weight_R is not None:
        weight_R = weight_R.contiguous()
    out_TD = torch.empty(n_tokens, y_RD.shape[1], dtype=torch.float32)
    if native_library().add_rows(y_RD.data_ptr(), None if weight_R is None else weight_R.data_ptr(), y_RD.shape[0],
                                 y_RD.shape[1], token_R.data_ptr(), n_tokens, out_TD.data_ptr()) != 0:
        raise ValueError(f"a buffer row names a token outside [0, {n_tokens}]")
    return out_TD


class _CombineRows(torch.autograd.Function):
    """combine_rows with autograd: the C sum forward; backward, each row's token's gradient (zeros for padding
    rows), the copies index_add's backward (an index_select of the gradient) makes."""

    @staticmethod
    def forward(ctx, y_RD, token_R, n_tokens: int):
        ctx.save_for_backward(token_R)
        return add_rows(y_RD, token_R, n_tokens)

    @staticmethod
    def backward(ctx, grad_TD):
        (token_R,) = ctx.saved_tensors
        grad_with_padding_TD = torch.cat([grad_TD, grad_TD.new_zeros(1, grad_TD.shape[1])])
        return F.embedding(token_R, grad_with_padding_TD), None, None


@implements("combine_weighted_rows")
def combine_weighted_rows(y_RD: torch.Tensor, weight_R: torch.Tensor, token_R: torch.Tensor,
                          n_tokens: int) -> torch.Tensor:
    """Each row times its gate weight, summed into its token, in one C pass (the product and index_add's additions,
    in its order); with autograd inside a Function whose backward makes the products autograd makes in one pass."""
    if not fp32_cpu(y_RD, weight_R) or native_library() is None:
        return NotImplemented
    if without_grad(y_RD, weight_R):
        return add_rows(y_RD, token_R, n_tokens, weight_R)
    return _CombineWeightedRows.apply(y_RD, weight_R, token_R, n_tokens)


class _CombineWeightedRows(torch.autograd.Function):
    """combine_weighted_rows with autograd. Backward: the rows' gradient is their token's gradient (zeros for
    padding rows) times the weight; the weights' gradient is the row sum of that token gradient times the row, summed
    by torch (the sum of `(g * y).sum(-1)` that the product's backward reduces with)."""

    @staticmethod
    def forward(ctx, y_RD, weight_R, token_R, n_tokens: int):
        y_RD, weight_R, token_R = y_RD.contiguous(), weight_R.contiguous(), token_R.contiguous()
        ctx.save_for_backward(y_RD, weight_R, token_R)
        return add_rows(y_RD, token_R, n_tokens, weight_R)

    @staticmethod
    def backward(ctx, grad_TD):
        y_RD, weight_R, token_R = ctx.saved_tensors
        grad_TD = grad_TD.contiguous()
        grad_y_RD, grad_times_y_RD = torch.empty_like(y_RD), torch.empty_like(y_RD)
        if native_library().add_rows_backward(grad_TD.data_ptr(), grad_TD.shape[0], y_RD.shape[1], token_R.data_ptr(),
                                              weight_R.data_ptr(), y_RD.data_ptr(), y_RD.shape[0],
                                              grad_y_RD.data_ptr(), grad_times_y_RD.data_ptr()) != 0:
            raise ValueError(f"a buffer row names a token outside [0, {grad_TD.shape[0]}]")
        grad_weight_R = grad_times_y_RD.sum(-1) if ctx.needs_input_grad[1] else None
        return grad_y_RD, grad_weight_R, None, None
