"""Fast paths for the model's hot spots, behind one seam.

moe_rl/model/ holds the math in plain torch; a step a kernel may do faster is a function there marked
`@replaceable(family)` (moe_rl/model/replaceable.py), and this package holds the kernels that stand in for them.
A model uses them where it is given a kernel set, `machine()` (as moe_rl/rl/build.py builds every model), and hands
it down its forward's calls:

| family           | module           | replaces (moe_rl/model/)                         | numbers              |
|------------------|------------------|--------------------------------------------------|----------------------|
| topk             | topk.py          | moe.topk_indices (torch.topk)                    | the same bits        |
| slots            | rows.py          | moe.sort_slots (stable argsort)                  | the same bits        |
| rows             | rows.py          | moe.gather_rows, expert_rows, combine_rows,      | the same bits        |
|                  |                  | combine_weighted_rows                            |                      |
| mkl_products     | grouped_gemm.py  | moe.grouped_mm, moe.short_block_rows             | the same bits        |
| exact_products   | grouped_gemm.py  | MKL's products in mkl_products (AVX-512, AVX2)   | MKL's bits (checked) |
| swiglu           | activation.py    | moe.swiglu (silu(gate) * up), weighted_swiglu    | torch's bits (checked) |
| rotary           | attention.py     | layers.apply_rotary                              | the same bits        |
| rms_norm         | norm.py          | layers.rms_norm with autograd (the composite)    | the same bits        |
| decode_attention | attention.py     | layers.decode_attention, decode_keys_transposed  | fp32 rounding        |
| sampler_experts  | sampler.py       | moe.routed_experts in the fp32 sampler           | fp32 rounding        |

CUDA runs torch's own kernels (torch._grouped_mm is a real grouped GEMM there). The C source is native_kernels.c,
built once per machine (native.py); which families run is measured once per machine (selection.py, measure.py) and
recorded in every run's manifest and benchmark (`selection.report()`).
"""

from moe_rl.kernels import activation, attention, grouped_gemm, norm, rows, sampler, topk  # noqa: F401  (registers them)
from moe_rl.kernels.registry import KernelSet
from moe_rl.kernels.selection import FAMILIES, choices, enabled, forced, report
from moe_rl.runs.provenance import CPU_FACTS

CPU_FACTS["kernels"] = report  # every CPU run's manifest records the kernel paths it takes

_MACHINE = KernelSet(enabled)


def machine() -> KernelSet:
    """This machine's kernels: the families its measurement chose (selection.py), which `forced` overrides inside a
    block (tests, benchmarks, the measurement itself)."""
    return _MACHINE


__all__ = ["FAMILIES", "KernelSet", "choices", "enabled", "forced", "machine", "report"]
