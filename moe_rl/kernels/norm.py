"""RMS norm with autograd on CPU: torch's composite, its elementwise passes in C (native_kernels.c, rms_norm_rows).

With autograd, torch runs rms_norm as a composite of six ops (x.pow(2), mean, add_(eps), rsqrt, x.mul(rstd),
.mul(weight)) and backward through each of them: about fifteen passes over the activations and a dozen autograd nodes
per norm, two norms per layer. Measured on a Zen 4 (one thread, forward+backward of one norm): 1.25-2.2 ms at
d_model 256 and 1,024 tokens, 0.20-0.22 ms at the paper's 704 x 64; here 0.6 ms and 0.17-0.19 ms.

The forward computes rstd with torch's own ops (the same calls, so the same numbers) and the output in one C pass.
The backward makes the composite's products in two C passes (the second also carries rstd's gradient back through
rsqrt, add and mean, a few products per row) and leaves both reductions (the weight's gradient over the rows, rstd's
over each row) to torch's sum on the very tensors autograd would have reduced. Every value is one rounded product or
sum in the order torch makes it (the C file is built without fused multiply-adds), and x's two gradients are handed
back apart so that autograd adds them where the composite's are added: the composite's numbers bit for bit
(tests/kernels/test_native_kernels.py, at four widths, with special values). Without autograd torch runs the same six
ops with no graph to build (its `_fused_rms_norm` on CPU) and the reference runs: the output in C there measured no
faster at 704 x 64 (31 against 32 us) and slower at a decode step's 64 rows (17 against 15 us).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moe_rl.kernels.native import library as native_library
from moe_rl.kernels.registry import implements

_FORWARD, _PRODUCTS, _INPUT_GRAD = 0, 1, 2  # rms_norm_rows' modes


@implements("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return NotImplemented  # the same six ops without a graph: no faster in C (the module docstring)
    if not _serves(x, weight):
        return NotImplemented
    return _RMSNorm.apply(x, x, weight, eps)


def _serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() >= 2
            and weight.shape == x.shape[-1:] and weight.is_contiguous() and x.numel() > 0
            and not torch.is_autocast_enabled("cpu") and native_library() is not None)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) per row, (..., 1): the composite's ops, in its order."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))


def _rows(mode: int, x, rstd, weight, grad=None, grad_rstd=None, with_first: bool = True):
    """One C pass over the rows of x (contiguous): mode _FORWARD gives the output; _PRODUCTS and _INPUT_GRAD give
    two tensors (for _PRODUCTS the first is None unless `with_first`)."""
    out = torch.empty_like(x) if mode != _PRODUCTS or with_first else None
    out2 = torch.empty_like(x) if mode != _FORWARD else None
    d = x.shape[-1]
    status = native_library().rms_norm_rows(
        mode, x.data_ptr(), rstd.data_ptr(), weight.data_ptr(), None if grad is None else grad.data_ptr(),
        None if grad_rstd is None else grad_rstd.data_ptr(), x.numel() // d, d,
        None if out is None else out.data_ptr(), None if out2 is None else out2.data_ptr())
    if status != 0:
        raise RuntimeError(f"rms_norm_rows refused mode {mode} (status {status})")
    return out if mode == _FORWARD else (out, out2)


class _RMSNorm(torch.autograd.Function):
    """torch's composite rms_norm, forward and backward, with its elementwise passes in C.

    x comes in twice (`apply(x, x, weight, eps)`) because the composite uses it twice, in x.mul(rstd) and in
    x.pow(2): autograd adds those two gradients to the gradient from x's other uses (the residual stream) one at a
    time, the product's first, and a float sum depends on its order, so the backward returns them apart, in that
    order, for autograd to add the same way."""

    @staticmethod
    def forward(ctx, x, x_again, weight, eps):
        x = x.contiguous()
        rstd = _rstd(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        return _rows(_FORWARD, x, rstd, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        x_needs = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        weight_needs = ctx.needs_input_grad[2]
        # out = n * weight with n = x * rstd: weight's gradient sums grad * n over the rows (autograd's sum_to);
        # rstd's sums grad * weight * x over each row.
        grad_times_n, grad_n_times_x = _rows(_PRODUCTS, x, rstd, weight, grad, with_first=weight_needs)
        grad_weight = None
        if weight_needs:
            grad_weight = grad_times_n.sum(tuple(range(x.dim() - 1)), keepdim=True).view(weight.shape)
        grad_x_through_mul = grad_x_through_pow = None
        if x_needs:
            grad_rstd = grad_n_times_x.sum(-1, keepdim=True)
            grad_x_through_mul, grad_x_through_pow = _rows(_INPUT_GRAD, x, rstd, weight, grad, grad_rstd)
        return grad_x_through_mul, grad_x_through_pow, grad_weight, None
