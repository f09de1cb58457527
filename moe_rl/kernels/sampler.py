"""The fp32 sampler's experts in one C pass (native_kernels.c, sampler_experts): four slots of an expert per read of
its weights, the next expert's prefetched, no buffers between the products. It agrees with the grouped path to fp32
rounding (tests/kernels/test_native_kernels.py checks it against float64), not bit for bit, so it serves only the
sampler in the trainer's precision: inference mode (which marks the sampler's passes; the trainer's no-grad passes run
under no_grad), no autocast (the bf16 sampler), CPU fp32, model and expert widths that are multiples of 16.

Its arithmetic is 16-lane vectors, the products tiled to fit the registers: 16-float accumulators on AVX-512, pairs
of 8-float ones on AVX2 and the baseline (the 16-float tiling spilled AVX2's 16 registers and ran 3.7-5.3x slower
than the grouped path on a 2-core AMD EPYC; the 8-float pairs run 0.55-0.82x, process time at decode shapes; on a
Zen 4 capped to AVX2 they ran 2.3x until their vector type was naturally aligned, native_kernels.c, vec8). Both
tilings sum each output in the same order, so every version gives the same bits. selection.py still measures it
per machine, at a decode step (measure.py).
"""

from __future__ import annotations

import torch

from moe_rl.kernels.native import library as native_library
from moe_rl.kernels.registry import implements
from moe_rl.model.moe import SlotLayout

LANES = 16  # the kernel works in 16-float vectors of the model and expert widths


def serves(x_TD: torch.Tensor, w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor) -> bool:
    _, d_expert, d_model = w_down_EFD.shape
    widths_fit = d_model % LANES == 0 and d_expert % LANES == 0
    fp32_cpu = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x_TD, w_gate_up_EDF2, w_down_EFD))
    return (torch.is_inference_mode_enabled() and not torch.is_autocast_enabled("cpu") and widths_fit and fp32_cpu
            and native_library() is not None)


@implements("routed_experts")
def sampler_experts(x_TD, weights_TK, slots: SlotLayout, w_gate_up_EDF2, w_down_EFD) -> torch.Tensor:
    """Every expert's SwiGLU on its slots, gate-weighted and summed per token: out_TD (fp32)."""
    if not serves(x_TD, w_gate_up_EDF2, w_down_EFD):
        return NotImplemented
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
