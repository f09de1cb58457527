"""SwiGLU of the experts' hidden rows in one C pass each way (native_kernels.c, swiglu): torch's bits, checked.

torch computes silu(gate) * up as two kernels forward (silu, mul; the halves are views) and four backward (two
products, silu_backward, and the cat that joins the gate's and the up's gradients), each a pass over memory. At
d_model 256 with 16 experts, 4,096 rows of 2 x 256, those passes took 3.2-3.5 ms of a layer's forward+backward on a
Zen 4 (one thread), one C pass each way 1.3-1.6 ms.

The C pass does torch's operations in torch's order, each rounded once, with the exp torch's kernels call: Sleef's
16-lane expf where torch dispatches to AVX-512, its 8-lane one under AVX2, the C library's expf at the baseline.
Two things about a torch wheel are not knowable from here: which exp its vectors call and whether its compiler fused
the multiply and add in silu_backward's 1 + x * (1 - s) (GCC may fuse intrinsics' products and sums; the Zen 4's
wheel did). So `exact_variant` runs each way on a test block of the width at hand (random values and the special
ones: signed zeros, infinities, NaN, values where exp overflows or underflows, subnormals) against torch, once per
width and process, and the kernel serves a width only where one way gave torch's bits for every value, forward and
backward. It serves fp32 rows on CPU at one torch thread (torch splits an elementwise op between threads at points
that move with the thread count, and its scalar code computes what is left of each part).

Where the gate weights scale the down product's input (expert width < d_model, as at the paper's shape), the same
pass multiplies each row by its weight (`weighted_swiglu`), and its backward makes the weight's product with the
incoming gradient and the gradient's product with the hidden row (torch sums those per row for the weights'
gradient): a product of two rounded values, rounded once, as torch's mul. At the paper shape (48 blocks, 704
tokens, one thread, a Zen 4) a minibatch's forward+backward took 380.5 and 407.2 ms with it against 405.9 and
435.4 ms with the SwiGLU pass followed by torch's product, in two interleaved runs of 15.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moe_rl.kernels.native import library as native_library
from moe_rl.kernels.native import torch_cpu_function
from moe_rl.kernels.registry import implements

_LANES = {"AVX512": 16, "AVX2": 8, "DEFAULT": 1}  # torch's dispatch capability -> the lanes of its float vectors
_SLEEF_EXP = {16: "Sleef_expf16_u10", 8: "Sleef_expf8_u10"}  # what torch's Vectorized<float>::exp calls
_SPECIAL = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 88.8, -88.8, 104.0, -104.0, 1e-30, -1e-30, 1e-42,
            -1e-42, 17.0, -17.0, 0.5)


class Variant(NamedTuple):
    lanes: int  # 16 (AVX-512), 8 (AVX2) or 1 (scalar)
    exp: int  # the address of the exp function the kernel calls
    fused: bool  # silu_backward's 1 + x * (1 - s) as one fused multiply-add


@implements("swiglu")
def swiglu(gate_up_N2F: torch.Tensor) -> torch.Tensor:
    if not _serves(gate_up_N2F):
        return NotImplemented
    variant = exact_variant(gate_up_N2F.shape[1] // 2)
    if variant is None:
        return NotImplemented
    if torch.is_grad_enabled() and gate_up_N2F.requires_grad:
        return _SwiGLU.apply(gate_up_N2F, variant)
    return _swiglu(variant, gate_up_N2F, None)


def _serves(gate_up_N2F: torch.Tensor) -> bool:
    return (gate_up_N2F.device.type == "cpu" and gate_up_N2F.dtype == torch.float32 and gate_up_N2F.dim() == 2
            and gate_up_N2F.shape[1] % 2 == 0 and gate_up_N2F.is_contiguous() and torch.get_num_threads() == 1
            and native_library() is not None)


class _SwiGLU(torch.autograd.Function):
    """The C pass both ways; it keeps only gate_up for the backward (torch's ops keep silu(gate) too)."""

    @staticmethod
    def forward(ctx, gate_up_N2F, variant):
        ctx.save_for_backward(gate_up_N2F)
        ctx.variant = variant
        return _swiglu(variant, gate_up_N2F, None)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_NF):
        (gate_up_N2F,) = ctx.saved_tensors
        return _swiglu(ctx.variant, gate_up_N2F, grad_NF.contiguous()), None


def _swiglu(variant: Variant, gate_up_N2F: torch.Tensor, grad_NF: torch.Tensor | None) -> torch.Tensor:
    """Forward (grad_NF None): hidden_NF. Backward: the gradient of gate_up_N2F."""
    return _checked(variant, gate_up_N2F, *_run(variant, gate_up_N2F, grad_NF))[0]


def _checked(variant: Variant, gate_up_N2F: torch.Tensor, status: int, *outs):
    if status != 0:
        width = gate_up_N2F.shape[1] // 2
        raise RuntimeError(f"the SwiGLU kernel refused {variant} at width {width} (status {status})")
    return outs


def _run(variant: Variant, gate_up_N2F: torch.Tensor, grad_NF: torch.Tensor | None,
         weight_N: torch.Tensor | None = None, with_weight_grad: bool = False):
    """(status, out, out2): forward (grad_NF None) the hidden rows (times weight_N where given); backward the
    gradient of gate_up_N2F, and with a weight and `with_weight_grad` the products whose row sums are the weights'
    gradient (out2, else None)."""
    rows, width = gate_up_N2F.shape
    out = gate_up_N2F.new_empty(rows, width // 2 if grad_NF is None else width)
    out2 = gate_up_N2F.new_empty(rows, width // 2) if grad_NF is not None and with_weight_grad else None
    status = native_library().swiglu(variant.lanes, variant.exp, int(variant.fused), gate_up_N2F.data_ptr(),
                                     None if grad_NF is None else grad_NF.data_ptr(),
                                     None if weight_N is None else weight_N.data_ptr(), rows, width // 2,
                                     out.data_ptr(), None if out2 is None else out2.data_ptr())
    return status, out, out2


@implements("weighted_swiglu")
def weighted_swiglu(gate_up_N2F: torch.Tensor, weight_N: torch.Tensor) -> torch.Tensor:
    """swiglu(gate_up) * weight[:, None] in the same C pass: the product rounded after the activation, as torch
    rounds it; backward, the weight's product with the incoming gradient and, for the weights' gradient, the
    gradient times the hidden rows (torch sums them per row)."""
    if not (_serves(gate_up_N2F) and weight_N.dtype == torch.float32 and weight_N.device.type == "cpu"
            and weight_N.shape == gate_up_N2F.shape[:1]):
        return NotImplemented
    variant = exact_variant(gate_up_N2F.shape[1] // 2)
    if variant is None:
        return NotImplemented
    weight_N = weight_N.contiguous()
    if torch.is_grad_enabled() and (gate_up_N2F.requires_grad or weight_N.requires_grad):
        return _WeightedSwiGLU.apply(gate_up_N2F, weight_N, variant)
    return _checked(variant, gate_up_N2F, *_run(variant, gate_up_N2F, None, weight_N))[0]


class _WeightedSwiGLU(torch.autograd.Function):
    """weighted_swiglu with autograd: the C pass both ways; it keeps gate_up and the weights for the backward."""

    @staticmethod
    def forward(ctx, gate_up_N2F, weight_N, variant):
        ctx.save_for_backward(gate_up_N2F, weight_N)
        ctx.variant = variant
        return _checked(variant, gate_up_N2F, *_run(variant, gate_up_N2F, None, weight_N))[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_NF):
        gate_up_N2F, weight_N = ctx.saved_tensors
        weight_needs = ctx.needs_input_grad[1]
        grad_gate_up, grad_times_hidden = _checked(
            ctx.variant, gate_up_N2F, *_run(ctx.variant, gate_up_N2F, grad_NF.contiguous(), weight_N, weight_needs))
        # autograd's gradient of weight[:, None]: the products summed to (N, 1), then the unsqueeze undone
        grad_weight = grad_times_hidden.sum(1, keepdim=True).view(-1) if weight_needs else None
        return (grad_gate_up if ctx.needs_input_grad[0] else None), grad_weight, None


@functools.cache
def exact_variant(d_expert: int) -> Variant | None:
    """The way of the C pass that gives torch's bits at this width on this machine and torch build, or None."""
    lanes = _LANES.get(torch.backends.cpu.get_cpu_capability())
    exp = _torch_exp(lanes) if lanes else None
    if exp is None or native_library() is None or d_expert < 1:
        return None
    gate_up_N2F, grad_NF = _check_block(d_expert)
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        theirs_N2F = gate_up_N2F.clone().requires_grad_()
        gate_NF, up_NF = theirs_N2F.chunk(2, dim=-1)
        hidden_NF = F.silu(gate_NF) * up_NF
        hidden_NF.backward(grad_NF)
    for fused in (True, False) if lanes > 1 else (False,):
        variant = Variant(lanes, exp, fused)
        status, ours_NF, _ = _run(variant, gate_up_N2F, None)
        if status != 0:  # a width it does not take (d_expert % (2 * lanes)), or vectors the build or CPU lacks
            return None
        backward_N2F = _swiglu(variant, gate_up_N2F, grad_NF)
        if same_bits(ours_NF, hidden_NF.detach()) and same_bits(backward_N2F, theirs_N2F.grad):
            return variant
    return None


def _check_block(d_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """64 rows of gates and ups at four scales, with the special values in the gates of row 0, the ups of row 1, and
    both (in opposite orders) in row 2; an upstream gradient for them."""
    generator = torch.Generator().manual_seed(0)
    scales_N = torch.tensor([0.5, 3.0, 12.0, 40.0]).repeat(16)
    gate_up_N2F = torch.randn(64, 2 * d_expert, generator=generator) * scales_N[:, None]
    k = min(len(_SPECIAL), d_expert)
    special = torch.tensor(_SPECIAL[:k])
    gate_up_N2F[0, :k] = special
    gate_up_N2F[1, d_expert:d_expert + k] = special
    gate_up_N2F[2, :k], gate_up_N2F[2, d_expert:d_expert + k] = special, special.flip(0)
    return gate_up_N2F, torch.randn(64, d_expert, generator=generator)


def same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """The same shape and bits (fp32), where NaN equals NaN (the payload of a NaN is not a number anyone reads)."""
    if ours.shape != theirs.shape:
        return False
    both_nan = ours.isnan() & theirs.isnan()
    return bool(((ours.view(torch.int32) == theirs.view(torch.int32)) | both_nan).all())


@functools.cache
def _torch_exp(lanes: int) -> int | None:
    """The address of the exp that torch's kernels call at these lanes: Sleef's, exported by torch's library, or the C
    library's expf for the scalar code. None where it is not found."""
    if lanes > 1:
        return torch_cpu_function(_SLEEF_EXP[lanes])
    try:
        return ctypes.cast(ctypes.CDLL(ctypes.util.find_library("m")).expf, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):
        return None
