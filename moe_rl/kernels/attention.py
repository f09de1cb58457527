"""Attention's CPU kernels (native_kernels.c): the rotary embedding, forward and backward, and the fp32 sampler's
one-query decode attention over a KV cache with transposed keys.

The rotary kernel makes the very products and sums of the three torch ops of moe_rl/model/layers.apply_rotary (two
products and one sum per element, each rounded once): the same bits. The decode kernel (16-lane vectors, a Cephes
exp within 1 ulp on [-87, 88]) agrees with torch's attention to fp32 rounding, as two torch attention kernels agree
with each other, not bit for bit; it serves only fp32 on CPU outside autocast and autograd (the sampler in the
trainer's precision; never the trainer's forwards, never the bf16 sampler). It reads 16 positions of one key
dimension as one vector, so it wants the cache's keys stored transposed (`decode_keys_transposed`).
"""

from __future__ import annotations

import math

import torch

from moe_rl.kernels.native import library as native_library
from moe_rl.kernels.registry import implements

DECODE_LANES = 16  # positions per vector of the decode kernel: rows of transposed keys are padded to a multiple


def padded_positions(positions: int) -> int:
    return -(-positions // DECODE_LANES) * DECODE_LANES


@implements("apply_rotary")
def apply_rotary(x_BSHDh: torch.Tensor, cos_BSDh: torch.Tensor, signed_sin_BSDh: torch.Tensor) -> torch.Tensor:
    if not _rotary_serves(x_BSHDh, cos_BSDh) or native_library() is None:
        return NotImplemented
    cos_BSDh, signed_sin_BSDh = cos_BSDh.contiguous(), signed_sin_BSDh.contiguous()
    if torch.is_grad_enabled() and x_BSHDh.requires_grad:
        return _Rotary.apply(x_BSHDh, cos_BSDh, signed_sin_BSDh)
    return _rotate(x_BSHDh, cos_BSDh, signed_sin_BSDh, backward=False)


def _rotary_serves(x_BSHDh: torch.Tensor, cos_BSDh: torch.Tensor) -> bool:
    return (x_BSHDh.device.type == "cpu" and x_BSHDh.dtype == torch.float32 and cos_BSDh.dtype == torch.float32
            and x_BSHDh.shape[-1] % 2 == 0 and x_BSHDh.stride(-1) == 1 and x_BSHDh.stride(-2) == x_BSHDh.shape[-1]
            and x_BSHDh.stride(0) == x_BSHDh.shape[1] * x_BSHDh.stride(1))


def _rotate(x_BSHDh: torch.Tensor, cos_BSDh, signed_sin_BSDh, backward: bool) -> torch.Tensor:
    B, S, H, Dh = x_BSHDh.shape
    out_BSHDh = torch.empty(B, S, H, Dh, dtype=torch.float32)
    if native_library().rotate_half(x_BSHDh.data_ptr(), B * S, x_BSHDh.stride(1), H, Dh, cos_BSDh.data_ptr(),
                                    signed_sin_BSDh.data_ptr(), int(backward), out_BSHDh.data_ptr()) != 0:
        raise ValueError(f"the rotary embedding needs an even head dim; got {Dh}")
    return out_BSHDh


class _Rotary(torch.autograd.Function):
    """The rotation with the C kernel both ways; its backward is torch's: g * cos + roll(g * signed_sin, -Dh/2)."""

    @staticmethod
    def forward(ctx, x_BSHDh, cos_BSDh, signed_sin_BSDh):
        ctx.save_for_backward(cos_BSDh, signed_sin_BSDh)
        return _rotate(x_BSHDh, cos_BSDh, signed_sin_BSDh, backward=False)

    @staticmethod
    def backward(ctx, grad_BSHDh):
        cos_BSDh, signed_sin_BSDh = ctx.saved_tensors
        return _rotate(grad_BSHDh.contiguous(), cos_BSDh, signed_sin_BSDh, backward=True), None, None


@implements("decode_keys_transposed")
def decode_keys_transposed(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a KV cache made now should store keys transposed for the decode kernel: fp32 on CPU outside autocast
    (the sampler makes its cache inside its precision context), a head dim that is a multiple of 16."""
    if not (torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % DECODE_LANES == 0
            and not torch.is_autocast_enabled("cpu") and native_library() is not None):
        return NotImplemented
    return True


@implements("decode_attention")
def decode_attention(q_BH1Dh, k_BGPDh, v_BGPDh, mask_B11P: torch.Tensor | None) -> torch.Tensor:
    if not _decode_serves(q_BH1Dh, k_BGPDh, v_BGPDh):
        return NotImplemented
    B, H, _, Dh = q_BH1Dh.shape
    G, P = k_BGPDh.shape[1], k_BGPDh.shape[2]
    q_BHDh = q_BH1Dh.reshape(B, H, Dh).contiguous()
    mask_BP = mask_B11P.reshape(B, P).contiguous() if mask_B11P is not None else None
    out_BH1Dh = torch.empty(B, H, 1, Dh, dtype=torch.float32)
    status = native_library().decode_attention(
        q_BHDh.data_ptr(), k_BGPDh.data_ptr(), v_BGPDh.data_ptr(), B, H, G, P, Dh, k_BGPDh.stride(0),
        k_BGPDh.stride(1), k_BGPDh.stride(-1), v_BGPDh.stride(0), v_BGPDh.stride(1),
        mask_BP.data_ptr() if mask_BP is not None else None, 1.0 / math.sqrt(Dh), out_BH1Dh.data_ptr())
    if status != 0:
        raise ValueError(f"decode attention kernel: status {status} for q {tuple(q_BH1Dh.shape)}, keys "
                         f"{tuple(k_BGPDh.shape)} with strides {k_BGPDh.stride()}")
    return out_BH1Dh


def _decode_serves(q_BH1Dh, k_BGPDh, v_BGPDh) -> bool:
    """Keys stored transposed (positions contiguous, rows padded), fp32 on CPU without autocast or autograd."""
    Dh, P = q_BH1Dh.shape[-1], k_BGPDh.shape[2]
    keys_transposed = k_BGPDh.stride(-2) == 1 and k_BGPDh.stride(-1) >= padded_positions(P)
    values_by_position = v_BGPDh.stride(-1) == 1 and v_BGPDh.stride(-2) == Dh
    fp32_on_cpu = q_BH1Dh.device.type == "cpu" and q_BH1Dh.dtype == k_BGPDh.dtype == v_BGPDh.dtype == torch.float32
    return (keys_transposed and values_by_position and fp32_on_cpu and Dh % DECODE_LANES == 0
            and not torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled() and native_library() is not None)
